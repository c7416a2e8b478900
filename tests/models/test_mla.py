"""Absorbed multi-head latent attention (``jaxserve.kernels.attention.mla``) against the expanded form: every head's
keys and values up-projected from the same latents and attended by the jnp reference as plain multi-head attention
(num_kv_heads = heads). Ragged steps over paged pools: a decode token, a prompt chunk after cached context, a whole
prompt; float32 within 1e-5."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jaxserve.kernels.attention.batch import AttentionBatch
from jaxserve.kernels.attention.mla import absorb_query, expand_output, mla_attention
from jaxserve.kernels.attention.reference import ragged_paged_attention_ref

from jaxserve import kernels

H, R, ROPE, NOPE, DV, PAGE = 4, 32, 8, 16, 12, 4


def _step(rng):
    """Three sequences: (context before this step, tokens this step); their pages shuffled over a 2-layer pool."""
    seqs = [(9, 1), (6, 5), (0, 7)]
    pages_per_seq = 5
    num_pages = 1 + pages_per_seq * len(seqs)
    table = rng.permutation(np.arange(1, num_pages)).reshape(len(seqs), pages_per_seq).astype(np.int32)
    kv_lens = np.asarray([a + b for a, b in seqs], np.int32)
    cu = np.concatenate([[0], np.cumsum([b for _, b in seqs])]).astype(np.int32)
    batch = AttentionBatch(
        kv_lens=jnp.asarray(kv_lens),
        page_indices=jnp.asarray(table),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.int32(len(seqs)),
    )
    return batch, num_pages, int(cu[-1])


IMPLS = {  # kernels.ragged_paged_attention's options; the Pallas kernels in interpret mode
    "reference": dict(impl="reference"),
    "xla": dict(impl="xla"),
    "pallas-tpu": dict(impl="pallas", backend="tpu", interpret=True),
    "pallas-gpu": dict(impl="pallas", backend="gpu", interpret=True),
}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_absorbed_latent_attention_equals_expanded_heads(impl):
    rng = np.random.default_rng(0)
    batch, num_pages, T = _step(rng)
    latent = rng.normal(size=(2, num_pages, PAGE, R + ROPE)).astype(np.float32)  # layer 1 is read
    w_uk = rng.normal(scale=0.3, size=(H, NOPE, R)).astype(np.float32)
    w_uv = rng.normal(scale=0.3, size=(H, DV, R)).astype(np.float32)
    q_nope = rng.normal(size=(T, H, NOPE)).astype(np.float32)
    q_pe = rng.normal(size=(T, H, ROPE)).astype(np.float32)
    scale = (NOPE + ROPE) ** -0.5

    def attention(q, k, v, layer, batch, **kw):  # k, v: the [L, pages, page_size, R + r] latent pool
        assert k.ndim == 4
        return kernels.ragged_paged_attention(q, k, v, layer, batch, **IMPLS[impl], **kw)

    got = expand_output(
        mla_attention(
            absorb_query(jnp.asarray(q_nope), jnp.asarray(w_uk)),
            jnp.asarray(q_pe),
            jnp.asarray(latent),
            1,
            batch,
            sm_scale=scale,
            attention=attention,
        ),
        jnp.asarray(w_uv),
    )

    # Expanded: per head, k = [W_uk c ; k_pe] and v = W_uv c (zero-padded to k's width), as HF's DeepseekV3 builds them.
    c, k_pe = latent[..., :R], latent[..., R:]
    k = np.concatenate(
        [np.einsum("lpsr,hdr->lpshd", c, w_uk), np.broadcast_to(k_pe[:, :, :, None], (2, num_pages, PAGE, H, ROPE))], -1
    )
    v = np.zeros_like(k)
    v[..., :DV] = np.einsum("lpsr,hvr->lpshv", c, w_uv)
    q = np.concatenate([q_nope, q_pe], -1)
    want = ragged_paged_attention_ref(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 1, batch, sm_scale=scale)
    want = np.asarray(want)[..., :DV]
    assert np.abs(want).max(axis=(1, 2)).min() > 1e-3  # every token (none is padding) attended something
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_a_latent_pool_of_the_wrong_width_is_named():
    rng = np.random.default_rng(1)
    batch, num_pages, T = _step(rng)
    with pytest.raises(ValueError, match=r"latent_cache must be \[layers, pages, page_size, 32 \+ 8\]"):
        mla_attention(
            jnp.zeros((T, H, R)), jnp.zeros((T, H, ROPE)), jnp.zeros((1, num_pages, PAGE, R)), 0, batch, sm_scale=1.0
        )


@pytest.mark.parametrize("kernel", ["reference", "gpu"])
def test_latent_rows_land_in_their_slots(kernel):
    """``kernels.write_latent``: row t into page slot // page_size, offset slot % page_size of the layer; a negative
    slot writes nothing. The Triton writer (interpret mode) and the reference scatter against numpy."""
    from jaxserve.kernels.kv_write import write_latent

    rng = np.random.default_rng(2)
    pool = rng.normal(size=(2, 6, PAGE, R + ROPE)).astype(np.float32)
    rows = rng.normal(size=(5, R + ROPE)).astype(np.float32)
    slots = np.asarray([3, 9, -1, 4, 22], np.int32)
    got = write_latent(
        jnp.asarray(pool),
        1,
        jnp.asarray(rows),
        AttentionBatch(slot_mapping=jnp.asarray(slots)),
        kernel=kernel,
        interpret=True,
    )
    want = pool.copy()
    for row, slot in zip(rows, slots):
        if slot >= 0:
            want[1, slot // PAGE, slot % PAGE] = row
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match=r"latent rows \(5, 32\) must be \[T, 40\]"):
        write_latent(jnp.asarray(pool), 1, jnp.asarray(rows[:, :R]), AttentionBatch(slot_mapping=jnp.asarray(slots)))
