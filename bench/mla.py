"""Multi-head latent attention's decode on the CPU: the absorbed form over the latent pool against expanded attention
on the same latents, in one invocation.

    python bench/mla.py [--seqs 8] [--context 512] [--runs 5]

DeepSeek-V2-Lite's attention shapes (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128), float32, one layer, ``--seqs`` sequences decoding one token each after ``--context`` cached tokens,
pages of 16. Three ways to one step's attention output [seqs, 16, 128]:

- ``absorbed``: what jaxserve runs (``kernels.attention.mla``): the query times W_uk, attention over the latent pool
  [pages, 16, 1, 576] (the CPU's paged attention, one KV head), the output times W_uv;
- ``expand per step``: what a latent cache costs without the absorption (HF transformers' DeepseekV3): every
  cached latent up-projected to each head's key and value on every step, then multi-head attention;
- ``expanded pool``: keys and values per head cached (16 x (192 + 128) values a token instead of 576), attention
  only: the memory the latent saves, at the speed of a plain pool.

The median of ``--runs`` jitted calls each; the ratios are against ``absorbed``. All three agree within 1e-4 (checked
before timing).
"""

from __future__ import annotations

import argparse
import platform
import time

HEADS, RANK, ROPE, NOPE, V_DIM, PAGE = 16, 512, 64, 128, 128, 16


def _median(fn, runs: int) -> float:
    fn().block_until_ready()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn().block_until_ready()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxserve.kernels.attention.batch import AttentionBatch
    from jaxserve.kernels.attention.mla import absorb_query, expand_output

    from jaxserve import kernels

    S, ctx = args.seqs, args.context
    pages_per_seq = -(-(ctx + 1) // PAGE)
    num_pages = 1 + S * pages_per_seq
    rng = np.random.default_rng(0)
    table = (1 + np.arange(S * pages_per_seq)).reshape(S, pages_per_seq).astype(np.int32)
    batch = AttentionBatch(
        kv_lens=jnp.full((S,), ctx + 1, jnp.int32),
        page_indices=jnp.asarray(table),
        cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32),
        num_seqs=jnp.int32(S),
    )
    f32 = np.float32
    latent = jnp.asarray(rng.normal(size=(1, num_pages, PAGE, RANK + ROPE)).astype(f32))
    w_uk = jnp.asarray(rng.normal(scale=RANK**-0.5, size=(HEADS, NOPE, RANK)).astype(f32))
    w_uv = jnp.asarray(rng.normal(scale=RANK**-0.5, size=(HEADS, V_DIM, RANK)).astype(f32))
    q_nope = jnp.asarray(rng.normal(size=(S, HEADS, NOPE)).astype(f32))
    q_pe = jnp.asarray(rng.normal(size=(S, HEADS, ROPE)).astype(f32))
    scale = (NOPE + ROPE) ** -0.5

    def attend(q, k, v):
        return kernels.ragged_paged_attention(q, k, v, 0, batch, sm_scale=scale, max_q_len=1)

    def expand(latent):  # every head's key [.., 16, 192] and value (zero-padded to 192) from the latents
        c, k_pe = latent[..., :RANK], latent[..., RANK:]
        k_nope = jnp.einsum("lpsr,hdr->lpshd", c, w_uk)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[..., None, :], (*k_nope.shape[:-1], ROPE))], -1)
        v = jnp.einsum("lpsr,hvr->lpshv", c, w_uv)
        return k, jnp.pad(v, ((0, 0),) * 4 + ((0, NOPE + ROPE - V_DIM),))

    @jax.jit
    def absorbed(latent, q_nope, q_pe):
        q = jnp.concatenate([absorb_query(q_nope, w_uk), q_pe], -1)
        pool = latent[:, :, :, None, :]
        return expand_output(attend(q, pool, pool)[..., :RANK], w_uv)

    @jax.jit
    def per_step(latent, q_nope, q_pe):
        k, v = expand(latent)
        return attend(jnp.concatenate([q_nope, q_pe], -1), k, v)[..., :V_DIM]

    k_pool, v_pool = jax.jit(expand)(latent)

    @jax.jit
    def pooled(k_pool, v_pool, q_nope, q_pe):
        return attend(jnp.concatenate([q_nope, q_pe], -1), k_pool, v_pool)[..., :V_DIM]

    runs = {
        "absorbed": lambda: absorbed(latent, q_nope, q_pe),
        "expand per step": lambda: per_step(latent, q_nope, q_pe),
        "expanded pool": lambda: pooled(k_pool, v_pool, q_nope, q_pe),
    }
    ref = np.asarray(runs["absorbed"]())
    for name, fn in runs.items():
        np.testing.assert_allclose(np.asarray(fn()), ref, rtol=1e-4, atol=1e-4, err_msg=name)
    per_token = {
        "absorbed": (RANK + ROPE) * 4,
        "expand per step": (RANK + ROPE) * 4,
        "expanded pool": HEADS * (NOPE + ROPE + V_DIM) * 4,
    }
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, jax {jax.__version__}, float32")
    print(f"# DeepSeek-V2-Lite attention: {S} sequences x 1 decode token after {ctx} cached, one layer")
    print("| form | ms / step | vs absorbed | pool bytes / token / layer |")
    print("|---|---:|---:|---:|")
    base = None
    for name, fn in runs.items():
        ms = _median(fn, args.runs) * 1e3
        base = base or ms
        print(f"| {name} | {ms:.2f} | {ms / base:.2f}x | {per_token[name]:,} |")


if __name__ == "__main__":
    main()
