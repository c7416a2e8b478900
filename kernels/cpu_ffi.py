"""The C++ ragged paged attention for the CPU (``cpu_paged_attention.cc``), built on first use and called through
XLA FFI.

``paged_attention`` computes every sequence's query tokens (prefill chunks and decode tokens alike) with the
contract of ``reference.ragged_paged_attention_ref``; ``ragged_paged_attention_xla`` hands its whole call to it on
the CPU when the caches are float32, bfloat16 or fp8 arrays, or ``Int8Pages`` (int8 values and one float32 scale per
token and KV head: a second target that also takes the scales). ``write_kv`` writes new K/V rows into the pool in
place (into an ``Int8Pages`` pool: the rows quantized with ``quantize_rows``, values and scales each in place).
Two products that are not attention take a few float32 rows (steps of up to 8 tokens: a few requests decoding)
and read a layer's matrix in place in its stack (``layer``), where XLA would copy the scan's slice of it first:
``matmul_rows`` by bfloat16 or float32 weights (XLA:CPU's own bfloat16 product is pathologically slow there) and
``matmul_quant_rows`` by quantized ones (``jaxserve.quant.QArray``: int8 and 4-bit values widened in registers,
never dequantized to a float copy). ``ROWS`` is both, as the model's ``RowsFn``.

The library is compiled with the system C++ compiler (``$CXX``, else ``g++``/``c++``) against the FFI headers that
ship with jaxlib, once per source/jaxlib/compiler combination, into ``$JAXSERVE_CACHE_DIR/ffi`` (default
``~/.cache/jaxserve/ffi``). ``available()`` says whether it could be built and loaded, and ``unavailable_reason()``
says why not. Without it the public ``ragged_paged_attention(impl="auto" | "xla")`` silently keeps the jnp/lax
blocks (and ``write_kv`` the reference scatter); only a direct call of the lower-level
``ragged_paged_attention_xla(..., impl="ffi")`` (tests, ``bench/attention_cpu.py``) insists on the C++ kernel and
raises with that reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxserve.kernels._common import (
    FP8_DTYPES,
    AttentionBatch,
    Int8Pages,
    int32_metadata,
    is_int8_pages,
    quantize_rows,
    write_slots,
)

TARGET = "jaxserve_paged_attention"
INT8_TARGET = "jaxserve_paged_attention_int8"
WRITE_TARGET = "jaxserve_write_kv"
MATMUL_TARGET = "jaxserve_matmul_rows"
QUANT_TARGET = "jaxserve_matmul_quant_rows"
DEQUANT_TARGET = "jaxserve_dequantize"
W8A8_TARGET = "jaxserve_matmul_w8a8_rows"
MATMUL_MAX_ROWS = 8  # the C++ product's limit (kMaxRows)
# What the C++ attention reads as plain arrays: float32, bfloat16, and fp8 pools (stored without scales).
CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) + FP8_DTYPES
# And as ``Int8Pages`` only (int8 values with their scales): a plain int8 array is refused.
INT8 = jnp.dtype(jnp.int8)
_SOURCE = Path(__file__).with_name("cpu_paged_attention.cc")
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-pthread"]
_error: str | None = None


def _cache_dir() -> Path:
    root = os.environ.get("JAXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return Path(root) / "ffi"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_id() -> bytes:
    """What -march=native depends on (a shared cache dir may be seen by machines with other CPUs)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor().encode()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))})).encode()


def _build() -> Path:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    flags = _FLAGS + (["-march=native"] if os.environ.get("JAXSERVE_FFI_NATIVE", "1") == "1" else [])
    key = hashlib.sha256(
        b"\0".join(
            [
                _SOURCE.read_bytes(),
                jax.ffi.include_dir().encode(),
                cxx.encode(),
                " ".join(flags).encode(),
                jax.__version__.encode(),
                _cpu_id(),
            ]
        )
    ).hexdigest()[:16]
    name = f"cpu_paged_attention-{key}.so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "jaxserve-ffi"):  # a read-only home: /tmp
        if (folder / name).is_file():
            return folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:
            continue
    else:
        raise RuntimeError(f"no writable folder for the build: {_cache_dir()} or {folder}")
    out = folder / name
    # One build at a time per folder (~1 minute of g++): a process that starts while another builds (a test worker,
    # a notebook's kernel, ``make``'s early build) waits for that build and loads its library.
    with open(folder / f"{name}.lock", "w") as lock:
        _flock(lock)
        if out.is_file():
            return out
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(tmp_out)]
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
            os.replace(tmp_out, out)  # atomic: a reader never sees a partial file
    return out


def _flock(f) -> None:
    """An exclusive lock on an open file, released when it is closed (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: no C++ build there anyway
        return
    fcntl.flock(f, fcntl.LOCK_EX)


@functools.cache
def _load() -> bool:
    global _error
    if sys.platform == "win32":
        _error = "the C++ paged attention is built for Linux/macOS only"
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxservePagedAttention), platform="cpu")
        jax.ffi.register_ffi_target(INT8_TARGET, jax.ffi.pycapsule(lib.JaxservePagedAttentionInt8), platform="cpu")
        jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(lib.JaxserveWriteKV), platform="cpu")
        jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxserveMatmulRows), platform="cpu")
        jax.ffi.register_ffi_target(QUANT_TARGET, jax.ffi.pycapsule(lib.JaxserveMatmulQuantRows), platform="cpu")
        jax.ffi.register_ffi_target(DEQUANT_TARGET, jax.ffi.pycapsule(lib.JaxserveDequantize), platform="cpu")
        jax.ffi.register_ffi_target(W8A8_TARGET, jax.ffi.pycapsule(lib.JaxserveMatmulW8A8Rows), platform="cpu")
    except Exception as e:  # noqa: BLE001 - no compiler, headers missing, build error: reported, XLA path kept
        _error = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"jaxserve: the C++ paged attention is unavailable, using the XLA path ({_error})",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def available() -> bool:
    """True when the library is built (or was built before) and registered with XLA."""
    return _load()


def unavailable_reason() -> str | None:
    return None if _load() else _error


def serves(dtype) -> bool:
    """Whether the C++ kernels apply to a pool of this dtype on the current backend (built or not: see
    ``available``). int8 means an ``Int8Pages`` pool (its values' dtype)."""
    dtype = jnp.dtype(dtype)
    return (dtype in CACHE_DTYPES or dtype == INT8) and jax.default_backend() == "cpu"


def _pool_kind(k_cache, v_cache, what: str) -> bool:
    """True for two ``Int8Pages`` pools, False for two plain arrays of one dtype; raises ValueError otherwise (a
    plain int8 array has no scales to read it with)."""
    int8 = is_int8_pages(k_cache), is_int8_pages(v_cache)
    if int8[0] != int8[1]:
        raise ValueError(
            f"{what}: k_cache and v_cache must both be Int8Pages or both arrays, got "
            f"{type(k_cache).__name__}/{type(v_cache).__name__}"
        )
    if not int8[0] and INT8 in (k_cache.dtype, v_cache.dtype):
        raise ValueError(
            f"{what}: an int8 pool needs its scales: pass Int8Pages(values, scales), not a plain int8 array"
        )
    return int8[0]


def paged_attention(
    q,
    k_cache,
    v_cache,
    layer,
    batch: AttentionBatch,
    *,
    sm_scale: float,
    sliding_window=0,
    soft_cap: float | None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """[T, Nq, H] float32 ragged paged attention (``reference.ragged_paged_attention_ref``'s contract): every
    sequence's query tokens, zeros for padding tokens. float32, bfloat16 or fp8 caches (one dtype for both), or two
    ``Int8Pages`` (each row widened times its scale); products and softmax in float32; ``sliding_window`` <= 0 means
    no window; ``sinks`` [Nq] the attention sinks' logits (None: none)."""
    if not _load():
        raise RuntimeError(f"the C++ paged attention is unavailable: {_error}")
    int8 = _pool_kind(k_cache, v_cache, "the C++ paged attention")
    if not int8 and (k_cache.dtype != v_cache.dtype or k_cache.dtype not in CACHE_DTYPES):
        raise ValueError(
            f"the C++ paged attention needs float32, bfloat16 or fp8 caches (or Int8Pages), got "
            f"{k_cache.dtype}/{v_cache.dtype}"
        )
    if int8 and (k_cache.scales.dtype != jnp.float32 or v_cache.scales.dtype != jnp.float32):
        raise ValueError(f"Int8Pages scales must be float32, got {k_cache.scales.dtype}/{v_cache.scales.dtype}")
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    caches = (k_cache.values, v_cache.values, k_cache.scales, v_cache.scales) if int8 else (k_cache, v_cache)
    call = jax.ffi.ffi_call(INT8_TARGET if int8 else TARGET, out, vmap_method="sequential")
    return call(
        q.astype(jnp.float32),
        *caches,
        i32(layer),
        *int32_metadata(batch),
        i32(sliding_window),
        jnp.zeros((0,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(q.shape[1]),
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
    )


def write_kv(k_cache, v_cache, layer, new_k, new_v, batch: AttentionBatch) -> tuple:
    """``reference.write_kv_ref`` in place: the caches are aliased to the outputs, so inside a jit that donates
    them only the new rows are written (without donation XLA copies the pool first, as for any aliased call).

    ``Int8Pages`` caches give ``Int8Pages``: the new rows are quantized (``quantize_rows``, T rows in jnp), then the
    values and the scales are each written in place by the same byte-copying target (the scales as [T, K] rows
    into [L, P, S, K])."""
    if not _load():
        raise RuntimeError(f"the C++ K/V write is unavailable: {_error}")
    if new_k.shape != new_v.shape or new_k.shape[1:] != k_cache.shape[3:] or k_cache.shape != v_cache.shape:
        raise ValueError(f"write_kv: new rows {new_k.shape}/{new_v.shape} do not fit caches {k_cache.shape}")
    slot_mapping = write_slots(batch)
    if _pool_kind(k_cache, v_cache, "write_kv"):
        kq, ks = quantize_rows(new_k)
        vq, vs = quantize_rows(new_v)
        values = _write_rows(k_cache.values, v_cache.values, layer, kq, vq, slot_mapping)
        scales = _write_rows(k_cache.scales, v_cache.scales, layer, ks, vs, slot_mapping)
        return Int8Pages(values[0], scales[0]), Int8Pages(values[1], scales[1])
    return _write_rows(k_cache, v_cache, layer, new_k, new_v, slot_mapping)


def _write_rows(k_cache, v_cache, layer, new_k, new_v, slot_mapping) -> tuple[jax.Array, jax.Array]:
    """The C++ write of [T, K, H] rows into two [L, P, S, K, H] arrays, or [T, K] into [L, P, S, K] (any 1-, 2- or
    4-byte dtype), aliased."""
    out = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    call = jax.ffi.ffi_call(WRITE_TARGET, out, input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
    return call(
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32),
        new_k.astype(k_cache.dtype),
        new_v.astype(v_cache.dtype),
        jnp.asarray(slot_mapping, jnp.int32),
    )


def _layer(layer) -> jax.Array:
    return jnp.asarray(0 if layer is None else layer, jnp.int32)


def matmul_rows(x: jax.Array, w: jax.Array, layer=None) -> jax.Array:
    """x [M, K] (M <= 8) times a bfloat16 matrix w [K, N] (or [K, N / 2] uint32 pairs of bfloat16, as
    ``layers.linear.pack_bf16`` stores it, or float32), or times matrix ``layer`` of a stack [L, K, N] -> [M, N]
    float32, accumulated in float32 (C++: XLA:CPU's own bfloat16 products with fewer than 8 rows read the weights at
    a fifteenth of the float32 rate, and its float32 ones copy the scan's slice of a stack first)."""
    if not _load():
        raise RuntimeError(f"the C++ rows product is unavailable: {_error}")
    if x.ndim != 2 or w.ndim not in (2, 3) or x.shape[1] != w.shape[-2] or x.shape[0] > MATMUL_MAX_ROWS:
        raise ValueError(
            f"matmul_rows: x must be [M <= {MATMUL_MAX_ROWS}, K] and w [K, N] or [L, K, N], got {x.shape} and {w.shape}"
        )
    if w.dtype not in (jnp.bfloat16, jnp.uint32, jnp.float32):
        raise ValueError(f"matmul_rows: w must be bfloat16 or uint32 pairs of it (or float32), got {w.dtype}")
    n = w.shape[-1] * (2 if w.dtype == jnp.uint32 else 1)
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32), vmap_method="sequential")
    return call(x.astype(jnp.float32), w, _layer(layer))


def quant_rows_serves(w) -> bool:
    """Whether ``matmul_quant_rows`` takes this ``QArray``: int8 or 4-bit values, float32 or float16 scales (or
    uint8 codes with their multipliers), not W8A8 (whose products quantize their activations); the transposed
    [V, D] embedding needs groups of a multiple of 16 bytes, or of 8 in rows of a multiple of 16."""
    from jaxserve.quant import QArray

    if not isinstance(w, QArray) or w.act_quant:
        return False
    if w.scale.dtype not in ((jnp.uint8,) if w.scale_mul is not None else (jnp.float32, jnp.float16)):
        return False
    if (w.bits, w.q.dtype) not in ((8, jnp.int8), (4, jnp.uint8)) or w.q.ndim not in (2, 3):
        return False
    group_bytes, row_bytes = w.group * w.bits // 8, w.q.shape[-1]
    return w.axis == -2 or (w.axis == -1 and (group_bytes % 16 == 0 or (group_bytes == 8 and row_bytes % 16 == 0)))


def matmul_quant_rows(x: jax.Array, w, layer=None) -> jax.Array:
    """x [M, K] (M <= 8) times a quantized weight (a ``jaxserve.quant.QArray``: [K, N] grouped along K, or the
    [N, K] embedding grouped along K, which gives ``x @ W.T`` as ``quant.matmul`` does), or times matrix ``layer``
    of a stack of them [L, ...] -> [M, N] float32. The values are widened to float32 in registers; per group,
    ``scale * sum(x * q) + (zero - scale * offset) * sum(x)``, the dequantized weights' product up to float32
    rounding."""
    out = _rows_out("matmul_quant_rows", x, w)
    return _quantized_call("matmul_quant_rows", QUANT_TARGET, out, w, layer, x.astype(jnp.float32))


def _rows_out(name: str, x: jax.Array, w) -> jax.ShapeDtypeStruct:
    """The [M, N] float32 result of x [M <= 8, K] times a quantized weight ([K, N], or the transposed [N, K]
    embedding: ``axis`` -1); raises ValueError naming ``name`` for another x."""
    transposed = getattr(w, "axis", -2) == -1  # not a QArray: each caller refuses it
    k, n = (w.shape[-1], w.shape[-2]) if transposed else (w.shape[-2], w.shape[-1])
    if x.ndim != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MATMUL_MAX_ROWS:
        raise ValueError(f"{name}: x must be [M <= {MATMUL_MAX_ROWS}, {k}], got {x.shape}")
    return jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)


def _quantized_call(name: str, target: str, out: jax.ShapeDtypeStruct, w, layer, *lead: jax.Array) -> jax.Array:
    """``target`` on (*lead, w's values, scales, zeros (empty: none), layer), w's format as its attributes."""
    if not _load():
        raise RuntimeError(f"{name}: the C++ library is unavailable: {_error}")
    if not quant_rows_serves(w):
        raise ValueError(
            f"{name}: not a QArray it serves (int8 or 4-bit values, float16 / float32 scales or uint8 "
            f"codes with multipliers, no activation quantization): {w!r:.200}"
        )
    empty = jnp.zeros((0,), jnp.float32)
    zero = w.zero if w.zero is not None else jnp.zeros((0,), w.scale.dtype)
    if w.scale_mul is None:  # float scales: zeros in their dtype, no multipliers
        zero, smul, zmul = zero.astype(w.scale.dtype), empty, empty
    else:  # codes: int8 zero codes, float32 multipliers
        smul, zmul = w.scale_mul, w.zero_mul if w.zero_mul is not None else empty
    call = jax.ffi.ffi_call(target, out, vmap_method="sequential")
    return call(
        *lead,
        w.q,
        w.scale,
        zero,
        smul,
        zmul,
        _layer(layer),
        bits=np.int64(w.bits),
        group=np.int64(w.group),
        offset=np.int64(w.offset),
        transposed=w.axis == -1,
    )


def dequantize(w, layer=None, dtype=jnp.float32) -> jax.Array:
    """The float weight of a quantized matrix (a ``jaxserve.quant.QArray`` that ``matmul_quant_rows`` serves), or of
    matrix ``layer`` of a stack of them, in ``dtype`` (float32, or bfloat16 rounded to nearest even): [K, N], or
    [N, K] for the embedding grouped along its last axis. Computed as ``quant.dequantize`` does (one product and one
    sum in float32), the stack read in place, on both cores."""
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"dequantize: dtype must be float32 or bfloat16, got {dtype}")
    return _quantized_call("dequantize", DEQUANT_TARGET, jax.ShapeDtypeStruct(w.shape[-2:], dtype), w, layer)


def w8a8_rows_serves(w) -> bool:
    """Whether ``matmul_w8a8_rows`` takes this ``QArray``: W8A8's int8 values with a float32 scale per output
    channel (the layers' [K, N] stacks and the [V, D] embedding)."""
    from jaxserve.quant import QArray

    if not isinstance(w, QArray) or not w.act_quant or w.q.dtype != jnp.int8 or w.scale.dtype != jnp.float32:
        return False
    k = w.q.shape[-1] if w.axis == -1 else w.q.shape[-2]
    return w.group == k and w.zero is None and not w.offset and w.q.ndim in (2, 3)


def matmul_w8a8_rows(x: jax.Array, w, layer=None) -> jax.Array:
    """x [M, K] (M <= 8) times a W8A8 weight (or matrix ``layer`` of a stack), as ``quant.matmul`` computes it: x
    quantized to int8 per row (in C++, bit for bit as ``quant.quantize_rows``: a fused op fewer per product, ~1 ms
    per token of SmolLM2), the int8 x int8 sums exact in int32 (AVX-512 VNNI where the build has it), then
    ``sums * x_scale * w_scale`` in float32."""
    if not _load():
        raise RuntimeError(f"the C++ W8A8 product is unavailable: {_error}")
    if not w8a8_rows_serves(w):
        raise ValueError(
            f"matmul_w8a8_rows: not a W8A8 QArray (int8 values, a float32 scale per output channel): {w!r:.200}"
        )
    call = jax.ffi.ffi_call(W8A8_TARGET, _rows_out("matmul_w8a8_rows", x, w), vmap_method="sequential")
    return call(x.astype(jnp.float32), w.q, w.scale, _layer(layer), transposed=w.axis == -1)


class RowsProduct:
    """The model's ``RowsFn`` on one CPU device: the C++ products for steps of few rows, and the C++ dequantization
    of grouped quantized weights for larger ones.

    bfloat16 weights and float32 layer stacks below 8 rows (from 8, XLA's products are the faster); quantized ones
    up to 8 (XLA dequantizes whole 4-bit or grouped matrices each step: the whole model's 8-row products took 65 ms
    in XLA against 13.5 here for int4), except int8 per output channel at 8 rows, whose conversion XLA fuses into its
    product (14.3 against 15.7 ms). From 9 rows, grouped quantized weights (not int8 per output channel, which XLA
    converts in its product) are dequantized here, each layer in place, and multiplied by XLA in ``w.dot_dtype``
    (int4 in groups of 32, the whole model's products at 64 rows: 85 ms with XLA's dequantizing fusion)."""

    @staticmethod
    def serves(w, rows: int) -> bool:
        if w8a8_rows_serves(w):
            return rows <= MATMUL_MAX_ROWS
        if quant_rows_serves(w):
            return rows < MATMUL_MAX_ROWS or not w.per_channel
        if rows >= MATMUL_MAX_ROWS or not isinstance(w, jax.Array | np.ndarray | jax.ShapeDtypeStruct):
            return False
        # float32: the layers' stacks only (read in place: XLA copies the scan's slice of each first); a lone float32
        # matrix, such as the tied [V, D] embedding's transpose, XLA streams as fast and the call would copy it
        return w.dtype in (jnp.bfloat16, jnp.uint32) or (w.dtype == jnp.float32 and w.ndim == 3)

    def __call__(self, x: jax.Array, w, layer=None) -> jax.Array:
        if w8a8_rows_serves(w):
            return matmul_w8a8_rows(x, w, layer)
        if not quant_rows_serves(w):
            return matmul_rows(x, w, layer)
        if x.shape[0] <= MATMUL_MAX_ROWS:
            return matmul_quant_rows(x, w, layer)
        from jaxserve.quant import dot_dequantized

        if w.axis == -1 and layer is None and (blocks := _vocab_blocks(w.q.shape[0])) > 1:
            return _output_by_blocks(x, w, blocks)
        return dot_dequantized(x, dequantize(w, layer, w.dot_dtype or x.dtype), w)


_VOCAB_BLOCK = 4096  # rows of the [V, D] embedding dequantized at a time for the output projection


def _vocab_blocks(v: int) -> int:
    """Blocks of at most ``_VOCAB_BLOCK`` (and at least 1,024) rows that split ``v`` evenly; 1 if none do."""
    for n in range(-(-v // _VOCAB_BLOCK), v // 1024 + 1):
        if v % n == 0:
            return n
    return 1


def _output_by_blocks(x: jax.Array, w, blocks: int) -> jax.Array:
    """``x @ W.T`` for the quantized [V, D] embedding, ``blocks`` runs of its rows dequantized at a time (float32,
    whatever ``w.dot_dtype``: XLA:CPU's bfloat16 product with a [V, D] matrix transposed ran at a sixth of its rate).
    One block's buffer is reused: a whole float copy (113 MB for SmolLM2) was a fresh allocation each step, and
    touching its pages took longer than the product (26 ms at 64 rows)."""
    wb = jax.tree.map(lambda a: a.reshape(blocks, a.shape[0] // blocks, a.shape[1]), w)  # every leaf is [V, .]

    def block(_, b):
        return None, x.astype(jnp.float32) @ dequantize(wb, b, jnp.float32).T

    _, out = jax.lax.scan(block, None, jnp.arange(blocks, dtype=jnp.int32))  # [blocks, M, V / blocks]
    return jnp.moveaxis(out, 0, 1).reshape(x.shape[0], w.q.shape[0]).astype(x.dtype)


ROWS = RowsProduct()
