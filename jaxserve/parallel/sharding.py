"""The device mesh, logical-axis rules, and how parameters, the KV pool and the kernels are laid over it.

One engine replica runs one SPMD program over a ``Mesh`` with axes ``("stage", "data", "model")``:

* ``model`` is tensor parallelism. Attention heads, the MLP hidden and the vocabulary are split over it
  (Megatron style): the q/k/v and gate/up products are column-parallel, the output and down products are
  row-parallel (one all-reduce each per layer), the logits are computed per vocabulary shard and the sampler
  reduces them there (only per-row values and each shard's top candidates cross). The KV pool is split over KV
  heads, so each device stores and reads only its heads.
* ``data`` is reserved for data parallelism inside one program; today data-parallel replicas are separate
  programs on disjoint sub-meshes (see ``jaxserve.engine.llm_engine``), so a replica's mesh has ``data`` of size 1.
* ``stage`` is pipeline parallelism: the layer stacks and the KV pool split over it by layer
  (``jaxserve.parallel.pipeline.PipelineTick``), each stage's devices holding their layers' weights and pages. Size 1 without it.

Every parameter is declared once with logical axes (``jaxserve.models.schema``); ``DEFAULT_RULES``
maps logical axes to mesh axes. The custom kernels (Pallas, the CPU's C++ FFI calls) are not partitionable by
XLA, so they run under ``jax.shard_map`` on each device's heads; without it XLA would gather the whole pool.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig

MESH_AXES = ("stage", "data", "model")

# logical axis -> mesh axis (None: replicated)
DEFAULT_RULES: Mapping[str, str | None] = {
    "layers": None,
    "embed": None,
    "head_dim": None,
    "vocab": "model",
    "q_heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "heads": "model",
    # MoE: every expert's matrices split over the devices (tensor parallelism), or under expert parallelism
    # (EXPERT_PARALLEL_RULES) whole experts placed on each device.
    "experts": None,
    "expert_mlp": "model",
    "routes": None,
    "latent": None,  # MLA's latent and low-rank dims: every device computes (and caches) the whole latent
}
EXPERT_PARALLEL_RULES: Mapping[str, str | None] = {**DEFAULT_RULES, "experts": "model", "expert_mlp": None}

# A step's heads [tokens, heads, head_dim] (the KV pool's own specs: ``jaxserve.runner.kv_pool``).
HEADS_SPEC = P(None, "model", None)
VOCAB_SPEC = P(None, "model")  # [rows, vocab] logits


def check_parallelism(
    tensor_parallel_size: int,
    data_parallel_size: int = 1,
    num_devices: int | None = None,
    pipeline_parallel_size: int = 1,
) -> None:
    """Raises ValueError when the degrees (positive ints, as ``EngineConfig`` checks) need more devices than exist
    (before anything loads)."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    need = tensor_parallel_size * data_parallel_size * pipeline_parallel_size
    if need > num_devices:
        pp = f" x pipeline_parallel_size={pipeline_parallel_size}" if pipeline_parallel_size > 1 else ""
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size}{pp} "
            f"needs {need} devices, but {num_devices} {jax.default_backend()} device(s) exist"
        )


def make_mesh(tensor_parallel_size: int = 1, devices=None, pipeline_parallel_size: int = 1) -> Mesh:
    """A ("stage", "data", "model") mesh of ``pipeline_parallel_size`` x ``tensor_parallel_size`` devices (default:
    the first ones of ``jax.devices()``), stage by stage."""
    n = tensor_parallel_size * pipeline_parallel_size
    devices = list(jax.devices()[:n] if devices is None else devices)
    if len(devices) != n:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x pipeline_parallel_size={pipeline_parallel_size} needs "
            f"{n} devices, got {len(devices)}"
        )
    grid = np.array(devices, dtype=object).reshape(pipeline_parallel_size, 1, tensor_parallel_size)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def kv_heads_for(cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """KV heads the pool holds under ``tensor_parallel_size``-way tensor parallelism.

    With at least as many KV heads as devices they are split evenly; with fewer, each KV head is replicated onto
    ``tp / kv_heads`` devices (as vLLM and tpu-inference do), so every device holds one.

    Raises:
        ValueError: the degree does not divide the query heads, or neither divides the other for the KV heads.
    """
    tp, n, k = tensor_parallel_size, cfg.num_heads, cfg.num_kv_heads
    if n % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {n} attention heads")
    if cfg.is_mla:  # one latent a token, on every device (the latent pool is replicated: jaxserve.runner.kv_pool)
        return k
    if k % tp == 0:
        return k
    if tp % k == 0:
        return tp
    raise ValueError(
        f"tensor_parallel_size={tp} and the model's {k} KV heads must divide one another "
        f"(KV heads are split over the devices, or replicated when there are fewer of them)"
    )


def replicate_kv_heads(cfg: ModelConfig, params: dict, kv_heads: int) -> tuple[ModelConfig, dict]:
    """(config, params) with each KV head repeated ``kv_heads / cfg.num_kv_heads`` times (a no-op when equal).

    Query head ``j`` reads KV head ``j // (N / K)``; after repeating each KV head r times it reads KV head
    ``j // (N / (K r))`` of the new layout, which holds the same values: the attention is unchanged.
    """
    r = kv_heads // cfg.num_kv_heads
    if r == 1:
        return cfg, params
    h = cfg.head_dim
    out = dict(params)

    def repeat(w):  # the last axis is the heads' (a quantized weight's values and scales alike)
        if isinstance(w, jax.ShapeDtypeStruct):  # abstract (jaxserve.aot): the shape is all there is
            return jax.ShapeDtypeStruct((*w.shape[:-1], kv_heads * h), w.dtype)
        xp = jnp if isinstance(w, jax.Array) else np  # restored onto devices: repeat there
        heads = w.reshape(*w.shape[:-1], cfg.num_kv_heads, h)
        return xp.repeat(heads, r, axis=-2).reshape(*w.shape[:-1], kv_heads * h)

    for name in ("wk", "wv", "bk", "bv"):
        if name in params:
            out[name] = jax.tree.map(repeat, params[name])
    return dataclasses.replace(cfg, num_kv_heads=kv_heads), out


def fit_sharding(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """``sharding`` for an array of ``shape``, each dimension the mesh axes do not divide replicated instead: a
    quantized weight's per-channel scales have one entry along the weight's split input axis, and a checkpoint's
    group count need not divide by the tensor-parallel size (the jitted product reshards what it needs)."""
    spec = tuple(sharding.spec)

    def ways(axis) -> int:
        return math.prod(sharding.mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,)))

    fitted = tuple(
        None if axis is not None and i < len(shape) and shape[i] % ways(axis) else axis for i, axis in enumerate(spec)
    )
    return sharding if fitted == spec else NamedSharding(sharding.mesh, P(*fitted))


def checkpoint_shardings(cfg: ModelConfig, mesh: Mesh, expert_parallel: bool = False) -> dict[str, NamedSharding]:
    """Where a checkpoint's parameters are restored: as served, except the KV projections of a model with fewer
    KV heads than devices, which come whole (the runner then repeats their heads, see ``replicate_kv_heads``)."""
    from jaxserve.models.schema import param_schema

    rules = dict(rules_for(cfg, mesh, expert_parallel))
    if cfg.num_kv_heads % mesh.shape["model"]:
        rules["kv_heads"] = None
    return param_shardings(param_schema(cfg), mesh, rules)


def logical_spec(
    name: str,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    mesh: Mesh,
    rules: Mapping[str, str | None] = DEFAULT_RULES,
) -> P:
    """The PartitionSpec of one parameter.

    Raises:
        ValueError: naming the parameter, when an axis has no rule, two dimensions map to one mesh axis, or a
            dimension does not divide by its mesh axis' size.
    """
    if len(axes) != len(shape):
        raise ValueError(f"parameter {name!r}: {len(axes)} logical axes {axes} for shape {shape}")
    spec, used = [], {}
    for dim, (size, axis) in enumerate(zip(shape, axes)):
        if axis not in rules:
            raise ValueError(f"parameter {name!r}: logical axis {axis!r} has no sharding rule")
        mesh_axis = rules[axis]
        if mesh_axis is not None:
            if mesh_axis in used:
                raise ValueError(
                    f"parameter {name!r}: logical axes {used[mesh_axis]!r} and {axis!r} both map to "
                    f"mesh axis {mesh_axis!r}"
                )
            used[mesh_axis] = axis
            n = mesh.shape[mesh_axis]
            if size % n:
                raise ValueError(
                    f"parameter {name!r}: dimension {dim} ({axis}, size {size}) does not divide over "
                    f"mesh axis {mesh_axis!r} of size {n}"
                )
        spec.append(mesh_axis)
    return P(*spec)


def param_shardings(
    schema: Mapping,
    mesh: Mesh,
    rules: Mapping[str, str | None] = DEFAULT_RULES,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, NamedSharding]:
    """{name: NamedSharding} for a ``param_schema`` (``shapes`` overrides a schema's shapes, e.g. packed ones)."""
    return {
        name: NamedSharding(mesh, logical_spec(name, (shapes or {}).get(name, spec.shape), spec.axes, mesh, rules))
        for name, spec in schema.items()
    }


def stages(mesh) -> int:
    """The mesh's pipeline stages (1 without a ``stage`` axis)."""
    return dict(mesh.shape).get("stage", 1)


def _shard_map(f, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` of ``f`` over ``mesh``; inside a region already manual over some axes (the pipeline's
    stages, ``jaxserve.parallel.pipeline.PipelineTick``), over the context mesh's other axes, the manual ones dropped from the specs."""
    ctx = jax.sharding.get_abstract_mesh()
    manual = set() if ctx.empty else {n for n, t in zip(ctx.axis_names, ctx.axis_types) if t == AxisType.Manual}
    if not manual:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def drop(spec):
        return spec if spec is None else P(*(None if a in manual else a for a in spec))

    def specs(tree):
        return jax.tree.map(drop, tree, is_leaf=lambda x: x is None or isinstance(x, P))

    return jax.shard_map(
        f,
        mesh=ctx,
        in_specs=specs(in_specs),
        out_specs=specs(out_specs),
        axis_names=set(ctx.axis_names) - manual,
        check_vma=False,
    )


def shard_kernels(attention, write_kv, mesh: Mesh, pool_spec: Callable[[Any], Any]):
    """Wraps the model's (attention, write_kv) so each device runs them on its own heads of q, K/V and the pool.

    Both take and return arrays laid out as ``HEADS_SPEC`` / ``pool_spec(cache)`` (the pool's partition spec, which
    the pool says: ``KVPool.spec_of``); the batch description is replicated. With one device this is a plain call of
    the kernel.
    """
    rep = P()

    def batch_specs(batch):  # the step's AttentionBatch, every array replicated
        return jax.tree.map(lambda _: rep, batch)

    def sharded_attention(q, k_cache, v_cache, layer, batch, *, sm_scale, sliding_window=0, soft_cap=None, sinks=None):
        kv = pool_spec(k_cache)

        def local(q, k_cache, v_cache, layer, batch, sliding_window, sinks):
            return attention(
                q,
                k_cache,
                v_cache,
                layer,
                batch,
                sm_scale=sm_scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
                sinks=sinks,
            )

        sinks_spec = None if sinks is None else P("model")  # one per query head, split as the heads are
        return _shard_map(
            local,
            mesh,
            in_specs=(HEADS_SPEC, kv, kv, rep, batch_specs(batch), rep, sinks_spec),
            out_specs=HEADS_SPEC,
        )(q, k_cache, v_cache, layer, batch, sliding_window, sinks)

    def sharded_write_kv(k_cache, v_cache, layer, new_k, new_v, batch):
        kv = pool_spec(k_cache)
        rows = rep if k_cache.ndim == 4 else HEADS_SPEC  # a latent pool's rows [T, width]: whole on every device
        return _shard_map(
            write_kv,
            mesh,
            in_specs=(kv, kv, rep, rows, rows, batch_specs(batch)),
            out_specs=(kv, kv),
        )(k_cache, v_cache, layer, new_k, new_v, batch)

    return sharded_attention, sharded_write_kv


@dataclasses.dataclass(frozen=True)
class ShardedRows:
    """A few-rows product (``jaxserve.layers.linear.RowsFn``: a GPU's Pallas product reading a layer's matrix in place
    in its stack) under tensor parallelism, for the matrices split as ``spec`` (a stack [L, K, N]'s): each device
    multiplies by its own shard. Split over N (column-parallel: q, k, v, gate, up), x is whole on every device and
    the product stays split; split over K (row-parallel: the attention's output, the MLP's down), x comes split over
    K and the devices' partial products are summed (the all-reduce XLA's own product does)."""

    rows: Any  # the RowsFn each device runs
    mesh: Mesh
    spec: P

    def serves(self, w, rows: int) -> bool:
        return self.rows.serves(w, rows)

    def _sharded(self, f, x, ws, layer):
        full = (*self.spec, *(None,) * (ws[0].ndim - len(self.spec)))  # a spec may leave trailing dimensions out
        k_axis, n_axis, w_spec = full[-2], full[-1], P(*full)

        def local(x, ws, layer):
            outs = tuple(o.astype(x.dtype) for o in f(x, ws, layer))
            return tuple(jax.lax.psum(o, k_axis) for o in outs) if k_axis is not None else outs

        return _shard_map(
            local,
            self.mesh,
            in_specs=(P(None, k_axis), (w_spec,) * len(ws), P()),
            out_specs=(P(None, n_axis),) * len(ws),
        )(x, tuple(ws), jnp.asarray(0 if layer is None else layer, jnp.int32))

    def __call__(self, x: jax.Array, w, layer=None) -> jax.Array:
        return self._sharded(lambda x, ws, layer: (self.rows(x, ws[0], layer),), x, (w,), layer)[0]

    def many(self, x: jax.Array, ws: tuple, layer=None) -> tuple[jax.Array, ...]:
        return self._sharded(lambda x, ws, layer: self.rows.many(x, ws, layer), x, ws, layer)


def rules_for(cfg: ModelConfig, mesh: Mesh, expert_parallel: bool = False) -> Mapping[str, str | None]:
    """The logical-axis rules of ``cfg`` on ``mesh``: ``DEFAULT_RULES``, or ``EXPERT_PARALLEL_RULES`` (whole
    experts on each device of the "model" axis) for a MoE model under ``expert_parallel``; with pipeline stages,
    the layer stacks split over them.

    Raises:
        ValueError: expert parallelism whose degree does not divide the experts, naming both.
    """
    rules = DEFAULT_RULES
    if expert_parallel and cfg.is_moe:
        tp = mesh.shape["model"]
        if cfg.num_experts % tp:
            raise ValueError(
                f"enable_expert_parallel: tensor_parallel_size={tp} must divide the model's {cfg.num_experts} "
                "experts (each device holds num_experts / tensor_parallel_size whole experts)"
            )
        rules = EXPERT_PARALLEL_RULES
    return {**rules, "layers": "stage"} if stages(mesh) > 1 else rules


def shard_moe(cfg: ModelConfig, mesh: Mesh, *, expert_parallel: bool = False, impl: str = "auto", interpret=None):
    """The MoE block (``moe_fn(h [T, D], one layer's parameters) -> [T, D]``) on ``mesh``, each device computing with
    its own part of the experts inside ``jax.shard_map``:

    - tensor parallel (default): every expert's hidden split over the devices: each device runs every token's
      experts on its columns, the partial outputs are summed (``psum``, as the dense MLP's row-parallel product);
    - ``expert_parallel``: whole experts on each device: each device runs, for every token, those of its k experts
      that it holds (the rest are skipped: ids outside its slice), and the outputs are summed (``psum``).

    The routing (router product, top-k) is computed on every device from the replicated hidden states, so all agree.
    The down bias (gpt-oss) is added once, after the sum.
    """
    from jaxserve import kernels
    from jaxserve.layers.moe import MoeSpec, moe_mlp
    from jaxserve.models.schema import moe_block

    spec = MoeSpec.of(cfg)
    tp = mesh.shape["model"]
    if tp == 1:
        return functools.partial(moe_mlp, spec=spec, impl=impl, interpret=interpret)
    rules = rules_for(cfg, mesh, expert_parallel)
    expert_parallel = rules["experts"] == "model"
    per_expert = spec.num_experts // tp if expert_parallel else spec.num_experts
    # each parameter's spec for one layer (the stacked layer axis dropped)
    specs = {n: logical_spec(n, s.shape[1:], s.axes[1:], mesh, rules) for n, s in moe_block(cfg).items()}

    def local(h, p):
        ids, weights = spec.route(h, p)
        here = ids - jax.lax.axis_index("model") * per_expert if expert_parallel else ids
        y = kernels.moe_experts(
            h,
            (here, weights),
            p["expert_gate"],
            p["expert_up"],
            p["expert_down"],
            activation=spec.activation,
            gate_bias=p.get("expert_gate_bias"),
            up_bias=p.get("expert_up_bias"),
            down_bias=p.get("expert_down_bias") if expert_parallel else None,
            swiglu_alpha=spec.swiglu_alpha,
            swiglu_limit=spec.swiglu_limit,
            impl=impl,
            interpret=interpret,
        )
        y = jax.lax.psum(y.astype(jnp.float32), "model")
        if not expert_parallel and "expert_down_bias" in p:
            y = y + jnp.einsum("tk,tkd->td", weights, p["expert_down_bias"].astype(jnp.float32)[ids])
        return y.astype(h.dtype)

    def leaf_specs(n, w):
        """A parameter's spec, fitted leaf by leaf to a quantized one's values and scales (``fit_sharding``)."""
        return jax.tree.map(lambda leaf: fit_sharding(NamedSharding(mesh, specs[n]), leaf.shape).spec, w)

    def moe_fn(h, p):
        in_specs = (P(), {n: leaf_specs(n, w) for n, w in p.items()})
        return _shard_map(local_groups, mesh, in_specs=in_specs, out_specs=P())(h, p)

    def local_groups(h, p):
        # a quantized stack with one scale along its contraction axis (int8 per channel) keeps that scale whole
        # while its values are split: its group is this device's part of the axis
        p = {n: _one_group_here(w) for n, w in p.items()}
        return local(h, p)

    return moe_fn


def _one_group_here(w):
    """A quantized weight inside ``shard_map`` whose scales have one group along its contraction axis: that group
    is the local part of the axis (the values may be split, the scale is not). Other parameters as they are."""
    from jaxserve.kernels.matmul.qarray import QArray

    if isinstance(w, QArray) and w.scale.shape[w.axis] == 1 and w.group != w.shape[w.axis]:
        return dataclasses.replace(w, group=w.shape[w.axis])
    return w
