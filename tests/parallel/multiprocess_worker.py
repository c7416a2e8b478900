"""One process of a jax.distributed group (tests/parallel/test_multiprocess.py starts several).

    python tests/parallel/multiprocess_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID MODEL_DIR TP [DP [PP]]

Generates greedily through ``LLM``, with default options otherwise (async scheduling with $JAXSERVE_TEST_ASYNC),
for the prompts in $JAXSERVE_TEST_PROMPTS (JSON token-id lists) and prints the tokens as one JSON line prefixed
with "TOKENS ". Every process prints process 0's outputs; process 0 also prints how many steps each replica ran
("STEPS [...]"). Faults to inject, for the tests of a group's failures:
  $JAXSERVE_TEST_MAX_NUM_SEQS_ON (a process id): that process starts with max_num_seqs=4, unlike the others;
  $JAXSERVE_TEST_RAISE_ON (a process id): that process raises after the first generation, while the others
  generate again.
"""

import json
import os
import sys

coordinator, num_processes, process_id, model_dir, tp = sys.argv[1:6]
dp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
pp = int(sys.argv[7]) if len(sys.argv) > 7 else 1

from jaxserve.parallel.distributed import initialize  # noqa: E402

initialize(coordinator, int(num_processes), int(process_id))

from jaxserve import LLM, SamplingParams  # noqa: E402

settings = {"max_num_seqs": 4} if os.environ.get("JAXSERVE_TEST_MAX_NUM_SEQS_ON") == process_id else {}
if os.environ.get("JAXSERVE_TEST_ASYNC"):
    settings["async_scheduling"] = True  # the CPU's default is off; GPUs' and TPUs' is on
llm = LLM(model_dir, tensor_parallel_size=int(tp), data_parallel_size=dp, pipeline_parallel_size=pp, **settings)
prompts = json.loads(os.environ["JAXSERVE_TEST_PROMPTS"])
params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
outs = llm.generate(prompts, params, use_tqdm=False)
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
if process_id == "0":
    print("STEPS " + json.dumps([r.runner.num_steps for r in llm.engine.replicas]), flush=True)
if "JAXSERVE_TEST_RAISE_ON" in os.environ:  # every process has printed its tokens before the fault
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("tokens printed")
if os.environ.get("JAXSERVE_TEST_RAISE_ON") == process_id:
    raise RuntimeError("injected after the first generation")
if "JAXSERVE_TEST_RAISE_ON" in os.environ:
    llm.generate(prompts, params, use_tqdm=False)  # never ends: the raising process ends the group
