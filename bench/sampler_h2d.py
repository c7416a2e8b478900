"""Host-to-device bytes of a decode step in one process: what the jitted step receives from the host each step.

Counted: every numpy input of the step (tokens, page tables, per-row sampler scalars, ...) and every device array
placed for this step alone; not counted: the sampler arrays the runner keeps on the devices (its constants).
Model: 2 layers with SmolLM2-135M's vocabulary (49,152; the token mask is [B, 1,536] words) and random weights,
max_model_len 2048 (the token history is [B, 2,048]); 32-token prompts, 8 greedy tokens out, with and without a
repetition penalty (which needs each row's history). Medians over the decode-only steps.

    python bench/sampler_h2d.py [--batches 32,128]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="32,128")
    args = p.parse_args()
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import load_preset
    from jaxserve.defaults import default_model_path
    from jaxserve.loading import LoadedModel
    from jaxserve.models.schema import random_params

    cfg = dataclasses.replace(load_preset("smollm2-135m"), num_layers=2)
    model = LoadedModel("2-layers", cfg, random_params(cfg, 0.02, np.random.default_rng(0)), default_model_path())
    print("| batch | penalties | host-to-device bytes per decode step |")
    print("|---|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        llm = LLM(model, max_num_seqs=b, max_num_batched_tokens=2048, max_model_len=2048, num_pages=b * 8 + 1)
        runner = llm.engine.runner
        launch = runner._launch
        for penalized in (False, True):
            sizes: list[int] = []

            def recording_launch(copy, step, runner=runner, sizes=sizes, launch=launch):
                if step is not None and step[0]:  # decode-only
                    kept = {id(v) for v in getattr(runner, "_constants", {}).values()}
                    sizes.append(
                        sum(
                            x.nbytes
                            for x in jax.tree.leaves(step[1:])
                            if isinstance(x, np.ndarray) or (isinstance(x, jax.Array) and id(x) not in kept)
                        )
                    )
                return launch(copy, step)

            runner._launch = recording_launch
            rng = np.random.default_rng(1)
            prompts = [rng.integers(3, 49000, size=32).tolist() for _ in range(b)]
            extra = {"repetition_penalty": 1.2} if penalized else {}
            llm.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **extra), use_tqdm=False
            )
            print(f"| {b} | {'yes' if penalized else 'no'} | {int(np.median(sizes)):,} |", flush=True)
        runner._launch = launch


if __name__ == "__main__":
    main()
