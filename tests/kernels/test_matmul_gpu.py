"""The GPU product that reads a layer's matrix in place (kernels/matmul/gpu.py): the Pallas kernel in the interpreter
against the plain-jnp product, and Triton's compile of it for an H100 at Llama-3-8B's shapes (no GPU needed: JAX's
CUDA plugin compiles for a target description, jaxserve.aot.gpu_devices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxserve.kernels.matmul import gpu


@pytest.mark.parametrize(
    "m, k, n, dtype",
    [
        (5, 300, 70, jnp.bfloat16),  # ragged rows, K and columns
        (64, 2048, 40, jnp.bfloat16),  # K split over several programs (few column blocks)
        (130, 96, 32, jnp.float16),  # more rows than one block of 128
        (7, 96, 40, jnp.float32),  # float32 weights: full float32 products
    ],
)
def test_interpreted_kernel_matches_the_jnp_product_of_the_layer(m, k, n, dtype):
    """A layer of a stack, read in place, against jnp's product of that layer's slice: both accumulate in float32 over
    the same bf16 / f16 / f32 inputs, only the order of the additions differs (relative 1e-5 of the largest)."""
    keys = jax.random.split(jax.random.key(m * k + n), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(keys[1], (3, k, n), jnp.float32).astype(dtype)
    got = gpu.matmul_rows(x, w, jnp.int32(1), interpret=True)
    want = jnp.dot(x.astype(jnp.float32), w[1].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    assert not np.allclose(np.asarray(got), np.asarray(gpu.reference(x, w, 2)), atol=1e-2)  # the layer asked for


def test_several_matrices_in_one_launch_match_each_product():
    """q, k and v (or gate and up) of one layer in one launch: their column blocks share a grid, each program in its
    own matrix's branch; each output against jnp's product of that matrix (the q / k / v widths of a GQA model,
    narrower than a block and ragged)."""
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (6, 200), jnp.float32).astype(jnp.bfloat16)
    ws = tuple(
        jax.random.normal(kk, (2, 200, n), jnp.float32).astype(jnp.bfloat16) for kk, n in zip(keys[1:], (96, 24, 40))
    )
    outs = gpu.matmul_rows_many(x, ws, jnp.int32(1), interpret=True)
    assert [o.shape for o in outs] == [(6, 96), (6, 24), (6, 40)]
    for got, w in zip(outs, ws):
        want = jnp.dot(x.astype(jnp.float32), w[1].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    with pytest.raises(ValueError, match="one dtype for all"):
        gpu.matmul_rows_many(x, (ws[0], ws[1].astype(jnp.float32)), interpret=True)


def test_blocks_split_k_only_for_narrow_matrices():
    # Llama-3-8B's q projection: 128 column blocks fill an H100's SMs, no split; k / v (1,024 columns): split
    assert gpu.plan_blocks(64, 4096, 4096, 2) == (64, 32, 128, 1)
    assert gpu.plan_blocks(64, 4096, 1024, 2)[3] == 4
    assert gpu.plan_blocks(256, 4096, 14336, 2)[:3] == (256, 32, 64)


def test_bad_input_is_named():
    x = jnp.zeros((4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        gpu.matmul_rows(x, jnp.zeros((2, 32, 16), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="M <= 256"):
        gpu.matmul_rows(jnp.zeros((300, 64), jnp.bfloat16), jnp.zeros((64, 16), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match=r"bfloat16, float16 or float32 \(one dtype for all\), got int8"):
        gpu.matmul_rows(x, jnp.zeros((64, 16), jnp.int8), interpret=True)
    rows = gpu.RowsProduct()
    assert rows.serves(jax.ShapeDtypeStruct((4, 64, 16), jnp.bfloat16), 256)
    assert not rows.serves(jax.ShapeDtypeStruct((4, 64, 16), jnp.bfloat16), 257)  # a prefill: XLA's GEMMs
    assert not rows.serves(jax.ShapeDtypeStruct((64, 16), jnp.bfloat16), 8)  # not a stack: nothing to slice


def test_triton_compiles_it_for_an_h100_and_a_layer_scan_reads_each_matrix_once():
    """Triton's compile of the kernel for sm_90 inside a scan over Llama-3-8B's 32 gate projections at a decode batch
    of 64, as the decoder runs it: no layer's slice is copied (XLA's own product copies each first), and the step
    moves each matrix once: the audit's bytes are the weights read once, and per layer the rows read, the product
    written, and the sum's two reads and one write of float32 [64, N] (1% for the audit's small change)."""
    from jaxserve.aot import gpu_devices, no_persistent_cache
    from jaxserve.audit import audit

    layers, k, n = 32, 4096, 14336
    (device,) = gpu_devices("h100", 1)
    spec = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((64, k), jnp.bfloat16, sharding=spec)
    w = jax.ShapeDtypeStruct((layers, k, n), jnp.bfloat16, sharding=spec)

    def scan_layers(product, x, w):
        def body(acc, layer):
            return acc + product(x, w, layer), None

        return jax.lax.scan(body, jnp.zeros((64, n), jnp.float32), jnp.arange(layers))[0]

    with no_persistent_cache():
        ours = jax.jit(lambda x, w: scan_layers(gpu.matmul_rows, x, w)).lower(x, w).compile().as_text()
        xla = jax.jit(lambda x, w: scan_layers(gpu.reference, x, w)).lower(x, w).compile().as_text()
    assert "matmul_rows_gpu_1_bm64_bn32_bk128_s1" in ours
    weights = layers * k * n * 2
    a = audit(ours, kv_shapes=())
    assert a.weight_copies == 0 and a.whiles == 1, a
    assert a.bytes == pytest.approx(weights + layers * (64 * k * 2 + 4 * 64 * n * 4), rel=0.01), a.summary()
    b = audit(xla, kv_shapes=())  # the same scan over XLA's product: the copy this kernel exists to avoid
    assert b.weight_copies == layers and b.bytes > 2.5 * weights, b.summary()


@pytest.mark.multidevice
def test_sharded_rows_over_n_and_over_k_equal_the_layers_product():
    """Under tensor parallelism on GPUs each device runs the product on its shard of the stack (``ShardedRows``, the
    kernel under ``shard_map``): split over N (q, k, v, gate, up) the product stays split over its columns; split
    over K (the attention's output, the MLP's down, a spec that leaves N out) the devices' partial products are
    summed; replicated (KV heads fewer than devices) each device computes it all. Against jnp's product of the whole
    layer, to bfloat16's rounding of the output (relative 1e-2 of the largest)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.parallel.sharding import ShardedRows, make_mesh

    mesh = make_mesh(4, jax.devices()[:4])
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (6, 256), jnp.float32).astype(jnp.bfloat16)
    stacks = [
        jax.random.normal(key, (3, 256, n), jnp.float32).astype(jnp.bfloat16) for key, n in zip(keys[1:], (128, 64))
    ]

    def want(w):
        return np.asarray(jnp.dot(x.astype(jnp.float32), w[2].astype(jnp.float32), precision="highest"))

    rows = gpu.RowsProduct(interpret=True)
    for spec, out_spec in (
        (P(None, None, "model"), P(None, "model")),
        (P(None, "model"), P(None, None)),
        (P(), P(None, None)),
    ):
        f = ShardedRows(rows, mesh, spec)
        ws = [jax.device_put(w, NamedSharding(mesh, spec)) for w in stacks]
        got = jax.jit(f)(x, ws[0], jnp.int32(2))
        assert got.dtype == x.dtype and got.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 2), spec
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want(stacks[0]), atol=1e-2 * np.abs(want(stacks[0])).max()
        )
        both = jax.jit(f.many)(x, tuple(ws), jnp.int32(2))  # q, k and v in one launch on each device
        for got, w in zip(both, stacks):
            np.testing.assert_allclose(np.asarray(got, np.float32), want(w), atol=1e-2 * np.abs(want(w)).max())
