"""Hugging Face tensor names -> jaxserve's stacked parameter layout.

Every loader (GGUF, HF safetensors, orbax) yields ``(hf_name, array)`` in HF naming and layout; this module
streams them into preallocated stacked arrays (``[L, ...]`` per layer weight, linear weights transposed to
``[in, out]``), so peak host memory is the model plus one tensor.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from jaxserve.models import registry
from jaxserve.models.schema import ParamSpec, param_schema

logger = logging.getLogger(__name__)

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter of the decoder for this config (from its schema)."""
    return {name: spec.shape for name, spec in param_schema(cfg).items()}


class _Targets:
    """Where each HF tensor goes: ``(param name, stack index or None, expert or None)`` from the schema's ``hf``
    names; per-expert tensors (``{e}`` in the name) and whole expert stacks both."""

    def __init__(self, cfg: ModelConfig, schema: dict[str, ParamSpec]):
        self.cfg, self.schema = cfg, schema
        self.mtp = registry.family(cfg.architecture).hf_mtp_layers
        self.mtp_skipped: set[int] = set()  # the multi-token-prediction layers skipped
        self.globals = {s.hf: n for n, s in schema.items() if s.hf and not s.per_layer}
        self.layer = {}  # per-layer tail -> name (an expert stack's whole-stack name too)
        self.experts = []  # (regex of a per-expert tail, name)
        for n, s in schema.items():
            if not (s.hf and s.per_layer):
                continue
            if "{e}" in s.hf:
                head, tail = s.hf.split("{e}")
                self.experts.append((re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + "$"), n))
                self.layer[head + tail.lstrip(".")] = n
            else:
                self.layer[s.hf] = n

    def __call__(self, hf_name: str) -> tuple[str, int | None, int | None] | None:
        """(param name, stack index or None, expert or None); None: a tensor to skip.

        Raises:
            ValueError: a tensor with no place in the model (or in that layer), naming it.
        """
        cfg = self.cfg
        if hf_name in self.globals:
            return self.globals[hf_name], None, None
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None
        m = _LAYER_RE.match(hf_name)
        if m:
            layer, tail = int(m.group(1)), m.group(2)
            if layer >= cfg.num_layers and self.mtp:
                self.mtp_skipped.add(layer)
                return None
            name, expert = self.layer.get(tail), None
            for pattern, n in self.experts if name is None else ():
                e = pattern.match(tail)
                if e:
                    name, expert = n, int(e.group(1))
                    break
            if name is not None:
                if layer >= cfg.num_layers:
                    raise ValueError(f"tensor {hf_name!r} is for layer {layer}, but the model has {cfg.num_layers}")
                index = self.schema[name].stack_index(layer)
                if index is None:
                    raise ValueError(
                        f"tensor {hf_name!r}: layer {layer} has no {name!r} in this {cfg.architecture} model"
                    )
                if expert is not None and expert >= cfg.num_experts:
                    raise ValueError(f"tensor {hf_name!r} is for expert {expert}, but the model has {cfg.num_experts}")
                return name, index, expert
        if _IGNORED.search(hf_name):
            return None
        raise ValueError(
            f"tensor {hf_name!r} has no place in a {cfg.architecture} model with this config "
            "(no parameter of its schema has that name)"
        )


def _unfused(family, schema: dict[str, ParamSpec], tensors: Iterable) -> Iterable:
    """The checkpoint's tensors under the schema's names: the family's prefixes renamed (or skipped) and its fused
    tensors split along their rows into the tensors they hold (a quantized one too: its blocks run along the
    input channels, so rows split whole)."""
    rows = {s.hf: s.shape[-1] for s in schema.values() if s.hf and s.per_layer}  # output channels per tensor
    for name, array in tensors:
        name = family.hf_tensor_name(name)
        if name is None:
            continue
        m = _LAYER_RE.match(name)
        if m and (family.hf_renames or family.hf_fixup):
            for tail, piece in family.hf_layer_tensors(m.group(2), array):
                yield f"model.layers.{m.group(1)}.{tail}", piece
            continue
        parts = family.hf_fused.get(m.group(2)) if m else None
        if not parts:
            yield name, array
            continue
        sizes = [rows[p] for p in parts if p in rows]
        got = (array.values if hasattr(array, "scale") else array).shape[0]
        if len(sizes) != len(parts) or got != sum(sizes):
            raise ValueError(
                f"fused tensor {name!r} has {got} rows, expected {' + '.join(map(str, sizes))} for {parts}"
            )
        start = 0
        for part, n in zip(parts, sizes):
            rows_of = slice(start, start + n)
            piece = array.map_rows(lambda x, r=rows_of: x[r]) if hasattr(array, "scale") else array[rows_of]
            yield f"model.layers.{m.group(1)}.{part}", piece
            start += n


def params_from_hf_tensors(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: str = "float32",
    total: int | None = None,
    shardings: dict | None = None,
    gguf: bool = False,
) -> dict[str, np.ndarray]:
    """Streams HF-named tensors into stacked host arrays of ``dtype``.

    With ``shardings`` ({name: Sharding}) each tensor goes straight to its devices instead, each device
    receiving its part, and is written into its stacked device array in place: the host holds one tensor at a
    time, not the model, and the result is device arrays. ``gguf``: the tensors come from a GGUF file (a missing
    one is named as llama.cpp names it, and as HF does).

    Raises:
        ValueError: an unexpected tensor, a tensor of the wrong shape (naming both shapes), or missing ones (named
            as the checkpoint names them).
    """
    np_dtype = _NP_DTYPES[dtype]
    schema = param_schema(cfg)
    target_of = _Targets(cfg, schema)
    shapes = {name: spec.shape for name, spec in schema.items()}
    params = (
        {name: np.empty(shape, np_dtype) for name, shape in shapes.items()}
        if shardings is None
        else _DeviceParams(shapes, np_dtype, shardings)
    )
    filled: dict[str, set] = {name: set() for name in shapes}
    quantized: dict[str, dict] = {}  # name -> {layer: QArray parts} of checkpoints served quantized
    experts: dict[tuple[str, int], dict[int, np.ndarray]] = {}  # (name, stack index) -> {expert: [in, out]}
    family = registry.family(cfg.architecture)
    stream = tqdm(tensors, total=total, desc="loading weights", unit="tensor", delay=1.0, leave=False)
    for hf_name, array in _unfused(family, schema, stream):
        target = target_of(hf_name)
        if target is None:
            continue
        name, layer, expert = target
        transpose = schema[name].transposed
        expected = shapes[name] if layer is None else shapes[name][1:]
        if expert is not None:
            expected = expected[1:]
        if hasattr(array, "scale"):  # a pre-quantized matrix (loading.gguf.GGUFQuantized): kept quantized
            got = np.swapaxes(array.values, -1, -2).shape if transpose else array.values.shape
            if got != expected or expert is not None:
                hf_expected = (*expected[:-2], *expected[:-3:-1]) if transpose else expected
                raise ValueError(f"tensor {hf_name!r} has shape {array.values.shape}, expected {tuple(hf_expected)}")
            quantized.setdefault(name, {})[layer] = _quantized_parts(array, transpose)
            filled[name].add(layer)
            continue
        array = np.asarray(array, np_dtype)
        if transpose and array.ndim >= 2:
            array = np.swapaxes(array, -1, -2)  # [..., out, in] -> [..., in, out]
        if array.shape != expected:
            hf_shape = np.swapaxes(array, -1, -2).shape if transpose and array.ndim >= 2 else array.shape
            hf_expected = (*expected[:-2], *expected[:-3:-1]) if transpose and len(expected) >= 2 else expected
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(hf_shape)}, expected {tuple(hf_expected)}")
        if expert is not None:  # one expert's matrix: the layer's stack is written once all its experts are in
            got = experts.setdefault((name, layer), {})
            got[expert] = array
            if len(got) < cfg.num_experts:
                continue
            array = np.stack([got[e] for e in range(cfg.num_experts)])
            del experts[(name, layer)]
        if layer is None:
            params[name][...] = array
        else:
            params[name][layer] = array
        filled[name].add(layer)
    if target_of.mtp_skipped:
        logger.info(
            "skipped the checkpoint's multi-token-prediction layer(s) %s (jaxserve does not serve them)",
            sorted(target_of.mtp_skipped),
        )
    for (name, layer), got in experts.items():
        missing = sorted(set(range(cfg.num_experts)) - set(got))
        raise ValueError(
            f"checkpoint is missing expert(s) {missing[:8]} of weight {name!r} in layer {_model_layer(schema[name], layer)}"
        )
    missing = []
    for name, spec in schema.items():
        want = set(range(spec.num_stacked)) if spec.per_layer else {None}
        missing += [
            _missing_tensor(family, name, spec, i, gguf)
            for i in sorted(want - filled[name], key=lambda i: -1 if i is None else i)
        ]
    missing = list(dict.fromkeys(missing))  # a fused tensor once, not once per parameter it holds
    if missing:
        more = f", and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing {_plural(len(missing), 'tensor')} {', '.join(missing[:8])}{more}")
    out = params if shardings is None else params.arrays
    for name, layers in quantized.items():
        if len(filled[name]) != len(layers):
            raise ValueError(
                f"weight {name!r} is quantized in some layers and not in others: it cannot be served quantized"
            )
        out[name] = _stack_quantized(layers)
    return out


def _model_layer(spec: ParamSpec, index: int) -> int:
    """The model layer of a stack's entry."""
    return index if spec.layers is None else spec.layers[index]


def _plural(n: int, word: str) -> str:
    return word if n == 1 else f"{n} {word}s"


def _missing_tensor(family, name: str, spec: ParamSpec, index: int | None, gguf: bool) -> str:
    """A missing tensor as the checkpoint names it (a GGUF file's name and HF's, or HF's; per-expert tensors with
    ``*`` for the expert; a fused tensor's name where the family stores the parameter fused), then the parameter,
    its layer and the tensor's shape as the checkpoint stores it."""
    layer = None if index is None else _model_layer(spec, index)
    fused = next((f for f, parts in family.hf_fused.items() if spec.hf in parts), None)
    hf = (fused or spec.hf or name).replace("{e}", "*")
    hf = hf if layer is None else f"model.layers.{layer}.{hf}"
    text, about = repr(hf), []
    if gguf:
        stored = next((g for g, f in family.gguf_fused.items() if f == fused), None) if fused else spec.gguf
        if stored:
            text, about = repr(stored if layer is None else f"blk.{layer}.{stored}"), [f"HF {hf}"]
    shape = spec.shape[1:] if spec.per_layer else spec.shape
    if spec.per_layer and "experts" in spec.axes and not gguf and "{e}" in (spec.hf or ""):
        shape = shape[1:]  # one expert's tensor
    if spec.transposed and len(shape) >= 2:
        shape = (*shape[:-2], shape[-1], shape[-2])
    of = "" if layer is None else f" of layer {layer}"
    if fused:  # one entry for all its parts
        about.append(f"{' + '.join(family.hf_fused[fused])} fused{of}")
    else:
        about.append(f"weight {name!r}{of}, shape {tuple(shape)}")
    return f"{text} ({'; '.join(about)})"


def _quantized_parts(q, transpose: bool) -> dict:
    """A ``GGUFQuantized`` matrix (GGUF blocks, or a compressed-tensors / AWQ weight: [..., out, in], grouped along
    in) as ``QArray`` fields in our layout: linear weights and expert stacks [..., in, out] grouped along axis -2,
    the embedding [V, D] grouped along axis -1; 4-bit values packed."""
    from jaxserve.quant import pack4_host

    axis = -2 if transpose else -1
    leaves = {"q": q.values, "scale": q.scale, "zero": q.zero}
    if transpose:
        leaves = {k: None if v is None else np.ascontiguousarray(np.swapaxes(v, -1, -2)) for k, v in leaves.items()}
    if q.bits == 4:
        leaves["q"] = pack4_host(leaves["q"], axis)
    return dict(leaves, bits=q.bits, group=q.group, offset=q.offset, axis=axis, act_quant=q.act_quant)


def _stack_quantized(layers: dict):
    """{layer or None: parts} -> one host ``QArray`` (stacked over the layers when there are some)."""
    from jaxserve.quant import QArray

    static = {k: v for k, v in layers[next(iter(layers))].items() if k not in ("q", "scale", "zero")}
    if any({k: p[k] for k in static} != static for p in layers.values()):
        raise ValueError("a weight is quantized in different formats across layers: it cannot be served quantized")
    if None in layers:
        return QArray(**layers[None])
    order = sorted(layers)
    stacked = {
        k: None if layers[order[0]][k] is None else np.stack([layers[i][k] for i in order])
        for k in ("q", "scale", "zero")
    }
    return QArray(**stacked, **static)


class _DeviceParams:
    """Stacked parameters filled tensor by tensor on their devices (``params[name][layer] = x`` and
    ``params[name][...] = x``, as on numpy arrays). A stacked array is allocated at its first layer; a whole
    tensor is placed as it comes, so nothing is allocated twice."""

    def __init__(self, shapes: dict, dtype, shardings: dict):
        import jax

        self.shapes, self.dtype, self.shardings = shapes, dtype, shardings
        self.arrays: dict = {}
        self._write = jax.jit(
            lambda buf, x, i: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0), donate_argnums=0
        )  # in place: the stacked array is never copied

    def __contains__(self, name) -> bool:
        return name in self.shapes

    def __getitem__(self, name):
        return _DeviceSlot(self, name)


class _DeviceSlot:
    def __init__(self, params: _DeviceParams, name: str):
        self.params, self.name = params, name

    def __setitem__(self, index, array: np.ndarray) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        p, name = self.params, self.name
        sharding = p.shardings[name]
        if index is Ellipsis:
            p.arrays[name] = jax.device_put(array, sharding)
            return
        if name not in p.arrays:
            p.arrays[name] = jax.jit(lambda: jnp.zeros(p.shapes[name], p.dtype), out_shardings=sharding)()
        layer_sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))  # the layer axis is whole
        p.arrays[name] = p._write(p.arrays[name], jax.device_put(array, layer_sharding), index)


def cast_params(params: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Float parameters cast to ``dtype``; quantized ones (``jaxserve.quant.QArray``) kept as they are."""
    np_dtype = _NP_DTYPES[dtype]
    return {k: v if hasattr(v, "scale") else v.astype(np_dtype, copy=False) for k, v in params.items()}
