"""One process of a two-process jax.distributed group (tests/test_multiprocess.py starts two).

    python tests/multiprocess_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID MODEL_DIR TP

Generates greedily through ``LLM`` for the prompts in $JAXSERVE_TEST_PROMPTS (JSON token-id lists) and prints the
tokens as one JSON line prefixed with "TOKENS ". Every process prints process 0's outputs.
"""

import json
import os
import sys

coordinator, num_processes, process_id, model_dir, tp = sys.argv[1:6]

from jaxserve.distributed import initialize  # noqa: E402

initialize(coordinator, int(num_processes), int(process_id))

from jaxserve import LLM, SamplingParams  # noqa: E402

llm = LLM(
    model_dir, tensor_parallel_size=int(tp), num_pages=64, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64
)
prompts = json.loads(os.environ["JAXSERVE_TEST_PROMPTS"])
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
