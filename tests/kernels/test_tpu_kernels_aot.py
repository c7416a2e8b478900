"""The TPU Pallas kernels compile for real TPUs: deviceless ahead-of-time compilation on this CPU machine.

``libtpu`` (the dev extra's ``jax[tpu]``) holds XLA's and Mosaic's TPU compilers; ``get_topology_desc`` gives
devices of a TPU topology that exists only as a description, and ``jit(...).lower(abstract args).compile()``
runs the real compilers on them. That checks what interpret mode cannot: Mosaic lowering (layouts, matmul
operand types, DMA shapes, scalar prefetch) and the scoped-VMEM limit. Numerics are checked elsewhere
(tests/kernels/test_kernels.py, interpret mode against the reference).

The grid covers the corners of what we serve on v5e, v6e and v5p: head_dim 64/128/256, GQA groups 1-8
(and an odd one), page sizes 16/32/64, bf16 and float32 caches, decode-only and mixed prefill steps,
sliding window (a traced scalar) and soft cap, one KV head per chip (TP) and 8. Compiles run inside
``jax.set_mesh`` of the topology: Mosaic takes the TPU generation from it (outside, it asks the CPU).
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxserve.kernels import AttentionBatch, Int8Pages, ragged_paged_attention_tpu, write_kv_tpu
from jaxserve.kernels.attention.tpu import (
    _VMEM_BUDGET,
    default_block_sizes,
    default_kv_heads_per_block,
    vmem_bytes,
)

BF16, F32 = jnp.bfloat16, jnp.float32
NUM_PAGES, LAYERS, MAX_CTX = 512, 2, 2048


@pytest.fixture(autouse=True, scope="module")
def _no_persistent_cache():
    """TPU executables stay out of the persistent cache an earlier test's engine turned on (see jaxserve.aot)."""
    from jaxserve.aot import no_persistent_cache

    with no_persistent_cache():
        yield


@functools.cache
def _mesh(topology: str) -> jax.sharding.Mesh:
    """A one-chip mesh of ``topology``. A missing libtpu is an install error (it is in the dev extra): fail."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.fail(
            "libtpu is not installed, so nothing can compile for a TPU: install the dev extra "
            "(pip install -e '.[dev]', which brings jax[tpu] and its libtpu)",
            pytrace=False,
        )
    from jaxserve.aot import topology_devices  # sets ALLOW_MULTIPLE_LIBTPU_LOAD: the other worker may hold libtpu

    return jax.sharding.Mesh(np.array(topology_devices(topology)[:1]), ("x",))


def _abstract(mesh, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def _pool(mesh, shape, dtype):
    """An abstract pool: an array, or for int8 an Int8Pages (values and a float32 scale per token and KV head)."""
    if jnp.dtype(dtype) == jnp.int8:
        return Int8Pages(_abstract(mesh, shape, jnp.int8), _abstract(mesh, shape[:4], jnp.float32))
    return _abstract(mesh, shape, dtype)


def _check_tpu_kernel(compiled, name: str) -> None:
    """The executable holds the Mosaic kernel (a tpu_custom_call), not an interpreted or XLA fallback."""
    hlo = compiled.as_text()
    assert "tpu_custom_call" in hlo and name in hlo, f"no Mosaic kernel {name} in the compiled HLO"
    mem = compiled.memory_analysis()
    assert mem is not None and mem.argument_size_in_bytes > 0


@functools.cache  # an identical compile in two tests (Llama-3-8B's decode is also a corner) is done once
def compile_attention(
    topology,
    dtype,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    num_tokens,
    num_seqs,
    soft_cap=None,
    kv_dtype=None,
    sinks=False,
    latent=False,
    layout="tokens_heads",
    **kernel_options,
):
    """AOT-compiles ragged_paged_attention_tpu for one chip of ``topology`` (pages in ``kv_dtype``, default
    ``dtype``; ``sinks``: with traced attention sinks; ``latent``: over a latent pool [L, pages, page_size,
    head_dim], multi-head latent attention's); returns the compiled executable."""
    mesh = _mesh(topology)
    a = functools.partial(_abstract, mesh)
    if latent:
        shape = (LAYERS, NUM_PAGES, page_size, head_dim)
    elif layout == "heads_tokens":
        shape = (LAYERS, NUM_PAGES, num_kv_heads, page_size, head_dim)
    else:
        shape = (LAYERS, NUM_PAGES, page_size, num_kv_heads, head_dim)
    cache = _pool(mesh, shape, kv_dtype or dtype)
    i32 = lambda *shape: a(shape, jnp.int32)  # noqa: E731
    args = (
        a((num_tokens, num_q_heads, head_dim), dtype),
        cache,
        cache,
        i32(),
        AttentionBatch(
            positions=i32(num_tokens),
            slot_mapping=i32(num_tokens),
            kv_lens=i32(num_seqs),
            page_indices=i32(num_seqs, MAX_CTX // page_size),
            cu_q_lens=i32(num_seqs + 1),
            num_seqs=i32(),
        ),
        i32(),
    ) + ((a((num_q_heads,), jnp.float32),) if sinks else ())

    def step(q, k, v, layer, batch, window, sinks=None):
        return ragged_paged_attention_tpu(
            q,
            k,
            v,
            layer,
            batch,
            sm_scale=head_dim**-0.5,
            sliding_window=window,
            soft_cap=soft_cap,
            sinks=sinks,
            layout=layout,
            **kernel_options,
        )

    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(*args).compile()
    _check_tpu_kernel(compiled, "ragged_paged_attention_tpu")
    out = compiled.out_info
    assert (out.shape, out.dtype) == ((num_tokens, num_q_heads, head_dim), jnp.dtype(dtype))
    return compiled


def compile_write_kv(topology, dtype, num_kv_heads, head_dim, page_size, num_tokens, kv_dtype=None):
    mesh = _mesh(topology)
    a = functools.partial(_abstract, mesh)
    cache = _pool(mesh, (LAYERS, NUM_PAGES, page_size, num_kv_heads, head_dim), kv_dtype or dtype)
    new = a((num_tokens, num_kv_heads, head_dim), dtype)
    i32 = lambda *shape: a(shape, jnp.int32)  # noqa: E731
    batch = AttentionBatch(i32(num_tokens), i32(num_tokens), i32(1), i32(1, 1), i32(2), i32())
    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(write_kv_tpu, donate_argnums=(0, 1))
            .lower(cache, cache, a((), jnp.int32), new, new, batch)
            .compile()
        )
    _check_tpu_kernel(compiled, "write_kv_tpu")
    return compiled


DECODE, MIXED = (32, 32), (256, 8)  # (num_tokens, num_seqs): one token each / prefill chunks + decodes

# (dtype, q heads, kv heads, head_dim, page_size, step, soft_cap). Each runs on every topology.
ATTENTION_CORNERS = {
    "bf16-d128-g4-p16-decode": (BF16, 32, 8, 128, 16, DECODE, None),  # Llama-3-8B
    "bf16-d256-g2-p64-mixed-softcap": (BF16, 16, 8, 256, 64, MIXED, 50.0),  # Gemma-2-9B
    "bf16-d64-g8-p64-decode-1kv": (BF16, 8, 1, 64, 64, DECODE, None),  # one KV head per chip under TP
    "bf16-d128-g7-p32-mixed": (BF16, 14, 2, 128, 32, MIXED, None),  # odd group: rows not a power of two
    "f32-d64-g1-p32-mixed-1kv": (F32, 1, 1, 64, 32, MIXED, None),  # MHA, the smallest tiles
    "f32-d256-g8-p16-mixed": (F32, 64, 8, 256, 16, MIXED, 30.0),  # over 16 MiB VMEM with all 8 heads a program
}
TOPOLOGIES = ("v5e:2x2", "v6e:2x2", "v5p:2x2x1")


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("corner", list(ATTENTION_CORNERS))
def test_attention_compiles_for_tpu(topology, corner):
    dtype, hq, hk, d, page, (tokens, seqs), cap = ATTENTION_CORNERS[corner]
    compile_attention(topology, dtype, hq, hk, d, page, tokens, seqs, soft_cap=cap)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_attention_sinks_compile_for_tpu(topology):
    """gpt-oss's attention: traced sinks (each row's running max starts at its head's sink), a sliding window,
    bfloat16 and float32, decode and mixed steps."""
    compile_attention(topology, BF16, 64, 8, 64, 16, *DECODE, sinks=True)
    compile_attention(topology, F32, 14, 2, 128, 32, *MIXED, sinks=True)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_heads_tokens_layout_compiles_for_tpu(topology):
    """The TPU's pool layout [L, pages, kv_heads, page_size, head_dim] (each page's heads DMA'd as (page_size,
    head_dim) tiles): Llama-3-8B's decode with one KV head per chip (TP 8), a mixed step with an odd group and
    heads split over programs, float32 with sinks, fp8 pages."""
    ht = dict(layout="heads_tokens")
    compile_attention(topology, BF16, 4, 1, 128, 16, *DECODE, **ht)
    compile_attention(topology, BF16, 14, 2, 128, 32, *MIXED, kv_heads_per_block=1, **ht)
    compile_attention(topology, F32, 14, 2, 64, 16, *MIXED, sinks=True, **ht)
    compile_attention(topology, BF16, 32, 8, 128, 32, *DECODE, kv_dtype=jnp.float8_e4m3fn, **ht)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_latent_attention_compiles_for_tpu(topology):
    """Multi-head latent attention over a latent pool: DeepSeek-V3 at TP 8 (16 query heads a chip, latents of
    512 + 64, bfloat16, pages of 16), decode and a mixed step; float32 with Kimi-K2's 8 heads a chip at TP 8."""
    for tokens, seqs in (DECODE, MIXED):
        compile_attention(topology, BF16, 16, 1, 576, 16, tokens, seqs, latent=True)
    compile_attention(topology, F32, 8, 1, 576, 16, *MIXED, latent=True)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize(
    "dtype,num_kv_heads,head_dim,page_size,num_tokens",
    [(BF16, 8, 128, 16, 256), (F32, 1, 64, 64, 32), (BF16, 2, 256, 32, 32)],
)
def test_write_kv_compiles_for_tpu(topology, dtype, num_kv_heads, head_dim, page_size, num_tokens):
    compile_write_kv(topology, dtype, num_kv_heads, head_dim, page_size, num_tokens)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_pages_compile_for_tpu(topology, kv_dtype):
    """bfloat16 queries over fp8 pages (kv_cache_dtype="fp8_e4m3" / "fp8_e5m2"), Llama-3-8B's decode and a mixed
    step; the write of bfloat16 rows into fp8 pages."""
    compile_attention(topology, BF16, 32, 8, 128, 16, *DECODE, kv_dtype=kv_dtype)
    compile_attention(topology, BF16, 14, 2, 128, 32, *MIXED, kv_dtype=kv_dtype)
    compile_write_kv(topology, BF16, 8, 128, 16, 256, kv_dtype=kv_dtype)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_int8_pages_compile_for_tpu(topology):
    """Int8Pages (kv_cache_dtype="int8"): the attention DMAs each page's scales beside its values and dequantizes in
    VMEM; the write DMAs the quantized rows and their scales. Llama-3-8B decode, a mixed step with an odd group and
    float32 queries with one KV head; bfloat16 and float32 rows written."""
    compile_attention(topology, BF16, 32, 8, 128, 16, *DECODE, kv_dtype=jnp.int8)
    compile_attention(topology, BF16, 14, 2, 128, 32, *MIXED, kv_dtype=jnp.int8)
    compile_attention(topology, F32, 8, 1, 64, 64, *MIXED, kv_dtype=jnp.int8)
    compile_write_kv(topology, BF16, 8, 128, 16, 256, kv_dtype=jnp.int8)
    compile_write_kv(topology, F32, 1, 64, 64, 32, kv_dtype=jnp.int8)


@pytest.mark.parametrize("num_tokens,num_seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_llama3_8b_bf16_compiles(num_tokens, num_seqs):
    """Llama-3-8B heads (32 q, 8 kv, head_dim 128), bf16, on v5e. It failed in Mosaic with 'Bad lhs type' when
    a bf16 x bf16 tpu.matmul asked for fp32 contraction (Precision.HIGHEST)."""
    compiled = compile_attention("v5e:2x2", BF16, 32, 8, 128, 16, num_tokens, num_seqs)
    assert compiled.cost_analysis()["flops"] > 0


def test_explicit_kv_heads_per_block_compiles():
    """Heads split over the grid: each program DMAs a strided head slice of every page."""
    compile_attention("v5e:2x2", BF16, 32, 8, 128, 32, *MIXED, kv_heads_per_block=2)


def test_raised_vmem_limit_keeps_heads_together_and_compiles():
    """With a 32 MiB scoped-VMEM limit the 14 MiB all-heads program is chosen, and Mosaic accepts it."""
    rows = default_block_sizes(*MIXED, 8, 16, MAX_CTX // 16, F32)[0] * 8
    assert default_kv_heads_per_block(8, rows, 256, 256, F32, F32) < 8
    assert default_kv_heads_per_block(8, rows, 256, 256, F32, F32, budget=(32 << 20) * 5 // 8) == 8
    compile_attention("v5e:2x2", F32, 64, 8, 256, 16, *MIXED, vmem_limit_bytes=32 << 20)


def test_vmem_estimate_counts_the_sinks_block():
    """With sinks the kernel takes one more input block, [heads, rows, 128] float32 and double-buffered (0.5 MiB
    for 8 heads of 64 rows): the estimate grows by it, and the head blocking that fits the budget may shrink."""
    rows = default_block_sizes(*MIXED, 8, 16, MAX_CTX // 16, F32)[0] * 8
    args = (rows, 256, 256, F32, F32)
    for h in (1, 4, 8):
        assert vmem_bytes(h, *args, sinks=True) - vmem_bytes(h, *args) == 2 * h * rows * 128 * 4
    with_sinks = default_kv_heads_per_block(8, *args, sinks=True)
    assert with_sinks <= default_kv_heads_per_block(8, *args)
    assert vmem_bytes(with_sinks, *args, sinks=True) <= _VMEM_BUDGET
    # the float32 head_dim 256 corner with sinks: the head blocking chosen with the sinks' block counted compiles
    compile_attention("v5e:2x2", F32, 64, 8, 256, 16, *MIXED, soft_cap=30.0, sinks=True)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", range(1, 9))
@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_default_blocks_fit_vmem_budget(dtype, head_dim, group, page_size):
    """The default head blocking keeps every served shape under the VMEM budget that Mosaic's 16 MiB scoped
    limit (v4/v5e/v5p) leaves; float32 head_dim 256 with 8 KV heads in one program (14 MiB) did not compile."""
    for tokens, seqs in (DECODE, MIXED):
        block_q, pages = default_block_sizes(tokens, seqs, group, page_size, MAX_CTX // page_size, dtype)
        for kv_heads in (1, 2, 4, 8):
            args = (block_q * group, head_dim, pages * page_size, dtype, dtype)
            h = default_kv_heads_per_block(kv_heads, *args)
            assert kv_heads % h == 0 and vmem_bytes(h, *args) <= _VMEM_BUDGET
            if vmem_bytes(kv_heads, *args) <= _VMEM_BUDGET:
                assert h == kv_heads  # no needless split of the heads
