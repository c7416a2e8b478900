"""Pipeline parallelism's split of a model's layers over stages (plain Python, no tensor library).

Each stage holds a contiguous run of layers, their weights and their KV pages; the embedding, the final norm and the
output head are on every stage (replicated: 2.1 B of Llama-3.1-70B's 70.6 B parameters). Layer counts the stages do
not divide split as evenly as possible: the first ``num_layers % stages`` stages take one layer more (30 over 4: 8,
8, 7, 7). ``jaxserve plan`` plans such splits; the engine serves only layer counts the stages divide
(``jaxserve.parallel.sharding.check_pipeline`` refuses the others).
"""

from __future__ import annotations


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The layers of each stage, in order.

    Raises:
        ValueError: ``stages`` is not a positive int, or exceeds the layers (each stage needs one).
    """
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive int, got {stages!r}")
    if stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={stages} exceeds the model's {num_layers} layers (each stage needs at least one)"
        )
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out
