"""Pipeline parallelism: the split of a model's layers over stages, its checks, and the tick that runs them.

Each stage holds a contiguous run of layers, their weights and their KV pages; the embedding, the final norm and the
output head are on every stage (replicated: 2.1 B of Llama-3.1-70B's 70.6 B parameters). Layer counts the stages do
not divide split as evenly as possible: the first ``num_layers % stages`` stages take one layer more (30 over 4: 8,
8, 7, 7). ``jaxserve plan`` plans such splits; the engine serves only layer counts the stages divide
(``check_pipeline`` refuses the others). ``PipelineTick`` runs one step of every stage.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.models import registry
from jaxserve.parallel.sharding import stages


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


def check_pipeline(cfg: ModelConfig, pipeline_parallel_size: int, dtype: str | None = None) -> None:
    """Raises ValueError, before any weight is read, for what the engine cannot split over that many stages: more
    stages than layers, layers the stages do not divide (planned by ``jaxserve plan``, not served yet), dense and
    MoE layers in separate stacks, and a program XLA aborts on (a SIGABRT, not an error, so refused here):
    weights other than float32 on the CPU ("Invalid binary instruction opcode copy")."""
    from jaxserve.models.schema import block_layers

    pp = pipeline_parallel_size
    if pp == 1:
        return
    stage_layers(cfg.num_layers, pp)  # more stages than layers: named there
    if dtype not in (None, "float32") and jax.default_backend() == "cpu":
        raise ValueError(
            f"pipeline_parallel_size={pp} on the CPU runs float32 weights (got dtype={dtype!r}): XLA:CPU aborts "
            "compiling other dtypes inside the pipeline"
        )
    if cfg.num_layers % pp:
        raise ValueError(
            f"pipeline_parallel_size={pp} must divide the model's {cfg.num_layers} layers: uneven stages are "
            "planned (jaxserve plan) but not served yet"
        )
    dense, moe = block_layers(cfg)
    if dense not in (None, ()) and moe not in (None, ()):
        settings = ", ".join(registry.family(cfg.architecture).hf_dense_layer_settings) or "moe_layers"
        raise ValueError(
            "pipeline_parallel_size > 1 does not serve a model whose dense and MoE layers are stacked apart yet "
            f"({cfg.architecture}'s {settings}: dense layers {list(dense)})"
        )


class PipelineTick:
    """One tick of the pipeline, as the decoder's ``scan_fn``: every stage runs its layers on its own batch. The layer
    stacks and the pools are split over the mesh's ``stage`` axis by layer (S stages of L / S layers), and the step's
    ``batch`` stacks S batches, stage s's being the one that entered the pipeline s ticks ago (an empty one, every
    slot -1, where none did). Stage 0 takes the embedded tokens of the batch entering now; stage s > 0 the hidden
    states stage s - 1 passed it at the end of the previous tick, held in ``passed`` ([S, T, D], split over
    ``stage``). Inside one ``shard_map`` manual over ``stage`` (tensor parallelism stays automatic within a stage):
    each stage scans its layers, passes its output on (``ppermute``; what stage S - 1 computed, the batch leaving
    the pipeline, is summed onto every stage and returned) and ``self.passed`` becomes the next tick's.

    Every stage computes every tick, on an empty batch while the pipeline fills or drains: the bubble of
    docs/parallelism.md (a ``lax.cond`` around a stage's layers made XLA's partitioner abort under tensor
    parallelism)."""

    def __init__(self, mesh: Mesh, passed: jax.Array):
        self.mesh, self.passed = mesh, passed

    def __call__(self, layer_on, step, carry, xs):
        num_stages = stages(self.mesh)
        x, k_cache, v_cache = carry
        params, layer_ids, windows = xs

        def body(x, passed, k_cache, v_cache, params, layer_ids, windows, step):
            s = jax.lax.axis_index("stage")
            mine = jax.tree.map(lambda a: a[s], step)  # this stage's batch and rotary tables
            h = jnp.where(s == 0, x, passed[0])
            local = (params, layer_ids, windows, jnp.arange(layer_ids.shape[0], dtype=jnp.int32))
            (h, k_cache, v_cache), _ = jax.lax.scan(functools.partial(layer_on, mine), (h, k_cache, v_cache), local)
            out = jax.lax.psum(jnp.where(s == num_stages - 1, h, jnp.zeros_like(h)), "stage")
            passed = jax.lax.ppermute(h, "stage", [(j, j + 1) for j in range(num_stages - 1)])  # stage 0 gets zeros
            return out, passed[None], k_cache, v_cache

        staged = P("stage")
        every = lambda tree, spec: jax.tree.map(lambda _: spec, tree)  # noqa: E731
        x, self.passed, k_cache, v_cache = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(
                P(),
                staged,
                every(k_cache, staged),
                every(v_cache, staged),
                every(params, staged),
                staged,
                staged,
                every(step, P()),
            ),
            out_specs=(P(), staged, every(k_cache, staged), every(v_cache, staged)),
            axis_names={"stage"},
            check_vma=False,
        )(x, self.passed, k_cache, v_cache, params, layer_ids, windows, step)
        return x, k_cache, v_cache
