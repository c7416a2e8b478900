"""Weight preparation: a checkpoint's parameters placed on a replica's mesh, ready for the step.

Each tensor goes to its devices in its shard only (``jaxserve.parallel.sharding`` says which); KV heads fewer than
the devices are repeated; float weights are quantized on their devices when ``quantization`` asks for it; a
quantized expert stack whose groups tensor parallelism would cut is dequantized; and, for bfloat16 products with
float32 weights, the products' bfloat16 copies are made. The runner keeps what comes out (``PreparedWeights``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxserve import quant
from jaxserve.config import ModelConfig
from jaxserve.models.decoder import OUTPUT_AXES, model_from_params
from jaxserve.models.schema import ParamSpec, matmul_names, param_schema, quantizable_names
from jaxserve.parallel.sharding import fit_sharding, kv_heads_for, param_shardings, replicate_kv_heads, rules_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PreparedWeights:
    """A model's weights on a mesh.

    Attributes:
        cfg: the model's config as served (``num_key_value_heads`` counts the repeated KV heads).
        param_shardings: each parameter's sharding.
        graphdef / state: the model (``flax.nnx``), its parameters placed.
        matmul_weights: the products' bfloat16 copies of float32 weights (``matmul_dtype="bfloat16"``), or None.
    """

    cfg: ModelConfig
    param_shardings: dict[str, NamedSharding]
    graphdef: nnx.GraphDef
    state: nnx.State
    matmul_weights: dict | None


def prepare_weights(
    model_cfg: ModelConfig,
    params: dict,
    mesh: Mesh,
    *,
    quantization: str | None = None,
    matmul_dtype: str | None = None,
    expert_parallel: bool = False,
    platform: str | None = None,
) -> PreparedWeights:
    """``params`` (host arrays, or ``jax.ShapeDtypeStruct``s when compiling for another platform: then nothing is
    allocated) placed on ``mesh``; see ``ModelRunner`` for the arguments.

    Raises:
        ValueError: a quantization the backend cannot run, or an int4 group that does not divide a device's part.
    """
    abstract = isinstance(params["final_norm"], jax.ShapeDtypeStruct)
    dtype = params["final_norm"].dtype  # the float weights' (a quantized model's norms stay float)
    # Fewer KV heads than devices: each is repeated so that every device holds one (cfg says how many now).
    model_cfg, params = replicate_kv_heads(model_cfg, params, kv_heads_for(model_cfg, mesh.shape["model"]))
    schema = param_schema(model_cfg)
    shardings = param_shardings(schema, mesh, rules_for(model_cfg, mesh, expert_parallel))
    # Tensor by tensor, each device receiving only its shard (every leaf of a quantized one alike).
    placed = {
        name: jax.tree.map(lambda x, s=shardings[name]: _place(x, fit_sharding(s, x.shape)), value)
        for name, value in params.items()
    }
    placed = _split_expert_groups(placed, schema, dtype, shardings, mesh, abstract)
    if quantization not in (None, "gguf"):  # "gguf": the checkpoint's own quantized weights, as loaded
        if platform is None:  # compiling for another platform (jaxserve.aot) checks its chip itself
            quant.check_backend(quantization)
        placed = _quantize(placed, schema, quantization, shardings, mesh, abstract)
    bf16_products = matmul_dtype is not None and jnp.dtype(matmul_dtype) != dtype
    if bf16_products and any(quant.is_quantized(v) for v in placed.values()):
        # No copies: the products that dequantize whole matrices (steps of more than 8 tokens) do it in bfloat16.
        placed = {
            n: dataclasses.replace(v, dot_dtype=str(jnp.dtype(matmul_dtype))) if quant.is_quantized(v) else v
            for n, v in placed.items()
        }
        bf16_products = False
    graphdef, state = model_from_params(model_cfg, placed)
    matmul_weights = None
    if bf16_products:
        make = lambda s: nnx.merge(graphdef, s).matmul_weights()  # noqa: E731
        shapes = {n: a.shape for n, a in jax.eval_shape(make, state).items()}  # packed: last dim halved
        axes = {n: schema[n] for n in matmul_names(schema)} | {"output": ParamSpec(shapes["output"], OUTPUT_AXES)}
        mm_shardings = param_shardings(axes, mesh, shapes=shapes)
        matmul_weights = (
            jax.tree.map(_place, jax.eval_shape(make, state), mm_shardings)
            if abstract
            else jax.jit(make, out_shardings=mm_shardings)(state)
        )
    return PreparedWeights(model_cfg, shardings, graphdef, state, matmul_weights)


def _split_expert_groups(params: dict, schema: dict, dtype, shardings: dict, mesh: Mesh, abstract: bool) -> dict:
    """A checkpoint's quantized expert stack whose groups tensor parallelism would cut (gpt-oss's MXFP4 down
    stack: groups of 32 along 2880 inputs, 360 a device at TP 8) cannot be dequantized inside the MoE's
    ``shard_map`` from the device's own part: it is dequantized to the model's dtype on its devices, logged.
    Expert parallelism (whole experts per device) never cuts a group."""
    out = dict(params)
    for name, w in params.items():
        if not quant.is_quantized(w) or schema[name].kind != "experts" or w.scale.shape[w.axis] == 1:
            continue
        dim, ways = len(w.shape) + w.axis, _split_ways(shardings[name], mesh, len(w.shape), w.axis)
        if ways == 1 or (w.shape[dim] // ways) % w.group == 0:
            continue
        logger.warning(
            "%s: quantized in groups of %d along its %d input channels, which tensor_parallel_size=%d splits "
            "into %d a device: served as %s (enable_expert_parallel keeps whole experts on each device, "
            "quantized)",
            name,
            w.group,
            w.shape[dim],
            ways,
            w.shape[dim] // ways,
            jnp.dtype(dtype).name,
        )
        fn = functools.partial(quant.dequantize, dtype=dtype)
        sharding = shardings[name]
        out[name] = (
            jax.ShapeDtypeStruct(w.shape, dtype, sharding=sharding)
            if abstract
            else jax.jit(fn, out_shardings=sharding)(w)
        )
    return out


def _split_ways(sharding: NamedSharding, mesh: Mesh, ndim: int, axis: int) -> int:
    """How many devices a parameter's axis ``axis`` (of ``ndim``) is split over (1: whole on each)."""
    spec = tuple(sharding.spec)
    dim = ndim + axis
    return mesh.shape[spec[dim]] if dim < len(spec) and spec[dim] is not None else 1


def _quantize(params: dict, schema: dict, mode: str, shardings: dict, mesh: Mesh, abstract: bool) -> dict:
    """The float weights the schema calls quantizable quantized on their devices, one at a time, each
    leaf sharded as its weight (int4 groups never straddle a shard: the group divides each device's part)."""
    out = dict(params)
    tp = mesh.shape["model"]
    for name in quantizable_names(schema):
        w = params.get(name)
        if w is None or quant.is_quantized(w):
            continue
        sharding = shardings[name]
        axis = quant.weight_axis(name)
        n = w.shape[axis] // _split_ways(sharding, mesh, len(w.shape), axis)  # each device's part of the axis
        try:
            group = quant.pick_group(n, quant.int4_group(name)) if mode == "int4" else None
        except ValueError as e:
            raise ValueError(f"quantization={mode!r} of {name!r} under tensor_parallel_size={tp}: {e}") from None
        fn = functools.partial(quant.quantize_param, name, mode=mode, group=group)
        shapes = jax.eval_shape(fn, w)
        leaf_shardings = jax.tree.map(lambda x, s=sharding: fit_sharding(s, x.shape), shapes)
        if abstract:
            out[name] = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, leaf_shardings
            )
        else:
            out[name] = jax.jit(fn, out_shardings=leaf_shardings)(w)
    return out


def _place(value, sharding: NamedSharding):
    """A parameter onto its devices; an abstract one (ShapeDtypeStruct) only annotated with its sharding."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    return jax.device_put(value, sharding)
