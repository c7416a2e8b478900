"""One replica's paged K/V pool: its layout on the devices, its size from memory, its allocation and
copy-on-write.

The pool is two arrays (K and V) of ``[layers, pages, page_size, kv_heads, head_dim]`` (or ``kernels.Int8Pages``:
int8 values and one float32 scale per token and KV head), split over KV heads on the ``model`` mesh axis and laid
out row-major. Multi-head latent attention (``ModelConfig.is_mla``) keeps one latent a token in the K array,
``[layers, pages, page_size, kv_lora_rank + qk_rope_head_dim]``, replicated over the ``model`` axis (every device's
heads read every latent), and an empty V array (last dim 0): ``ModelConfig.kv_cache_dims``. The arrays move with
every step (the step donates and returns them), so the runner holds them; this module decides everything else
about them.
"""

from __future__ import annotations

import logging
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve import kernels
from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig, kv_dtype
from jaxserve.parallel.sharding import stages
from jaxserve.utils import cdiv

_CPU_KV_CAP_BYTES = 4 << 30  # on the CPU the pool defaults to at most this, or what the workload needs
_CPU_KV_AVAILABLE_SHARE = 0.25  # ... and to at most this share of the memory available at startup

logger = logging.getLogger(__name__)


# The KV pool [layers, pages, page_size, kv_heads, head_dim], split over KV heads.
KV_POOL_SPEC = P(None, None, None, "model", None)
KV_SCALES_SPEC = P(None, None, None, "model")  # an int8 pool's scales [layers, pages, page_size, kv_heads]
# A latent pool (multi-head latent attention) [layers, pages, page_size, width], replicated: every device's heads
# read every latent, and the latents are computed whole on every device.
LATENT_POOL_SPEC = P(None, None, None, None)
# The TPU's pool layout [layers, pages, kv_heads, page_size, head_dim] ("heads_tokens"), split over KV heads.
HEADS_TOKENS_POOL_SPEC = P(None, None, "model", None, None)


def kv_pool_specs(mesh, latent: bool = False, layout: str = "tokens_heads") -> tuple[P, P]:
    """(pool spec, int8 scales spec) on ``mesh``: split over KV heads (a ``latent`` pool: replicated; ``layout``:
    the pool's, ``kernels.POOL_LAYOUTS``), and over layers by pipeline stage."""
    pool = LATENT_POOL_SPEC if latent else HEADS_TOKENS_POOL_SPEC if layout == "heads_tokens" else KV_POOL_SPEC
    if stages(mesh) == 1:
        return pool, KV_SCALES_SPEC
    return P("stage", *pool[1:]), P("stage", *KV_SCALES_SPEC[1:])


def pool_spec(cache, layout: str = "tokens_heads"):
    """The partition spec of a K or V pool: ``KV_POOL_SPEC`` (a latent pool, 4-D: ``LATENT_POOL_SPEC``; the TPU's
    layout: ``HEADS_TOKENS_POOL_SPEC``), or for an ``Int8Pages`` one per leaf."""
    if isinstance(cache, kernels.Int8Pages):
        return kernels.Int8Pages(KV_POOL_SPEC, KV_SCALES_SPEC)
    if cache.ndim == 4:
        return LATENT_POOL_SPEC
    return HEADS_TOKENS_POOL_SPEC if layout == "heads_tokens" else KV_POOL_SPEC


def page_bytes(cfg: ModelConfig, page_size: int, dtype, layers: int | None = None, kv_heads: int | None = None) -> int:
    """Bytes of one page of the K and V pools of ``dtype``, before any device's padding: ``layers`` layers (default:
    all) of ``kv_heads`` KV heads (default: the model's), a row of each of ``cfg.kv_cache_dims`` a token (int8 rows
    carry a float32 scale). ``jaxserve.aot`` asks it for a chip's share of a stage."""
    dtype = np.dtype(dtype)
    rows = sum(d * dtype.itemsize + (4 if dtype == np.int8 else 0) for d in cfg.kv_cache_dims)
    layers = cfg.num_layers if layers is None else layers
    return layers * page_size * (cfg.num_kv_heads if kv_heads is None else kv_heads) * rows


def available_host_memory(meminfo: str = "/proc/meminfo") -> int:
    """Bytes of host memory available now: MemAvailable from /proc/meminfo (what the kernel can hand out
    without swapping), else the free physical pages."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def coarse_floor(n: int) -> int:
    """The largest m * 2**k <= n with m in 4..7 (at most 20% below n): a few values per octave. n below 8 as is."""
    if n < 8:
        return n
    shift = n.bit_length() - 3
    return (n >> shift) << shift


class KVPool:
    """The pool's layout and size for a model, a mesh and the cache settings.

    Args:
        cfg: the model (its layers, KV heads and head_dim).
        cache_cfg, sched_cfg: page size, dtype and memory budget; the batching limits bound the CPU's default size.
        mesh: the replica's mesh; the pool is split over its ``model`` axis.
        weights_dtype: the KV dtype when ``cache_cfg.dtype`` is None.
        platform: None (the one JAX runs on), or "tpu" / "gpu" when compiling for it (``jaxserve.aot``).
        cpp_attention: the CPU's C++ attention reads this pool (without it a narrow dtype is slow on the CPU).
        attention_impl: the attention implementation ("pallas" on the CPU: interpret mode, no warning;
            "pallas-tpu": the TPU's kernels and layout).

    Raises:
        ValueError: not enough memory for two pages.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        cache_cfg: CacheConfig,
        sched_cfg: SchedulerConfig,
        mesh: Mesh,
        weights_dtype,
        platform: str | None = None,
        cpp_attention: bool = False,
        attention_impl: str = "auto",
    ):
        self.cfg, self.mesh, self.page_size = cfg, mesh, cache_cfg.page_size
        self.dtype = kv_dtype(cache_cfg.dtype, weights_dtype)  # default: the weights' dtype
        # int8 pages travel as kernels.Int8Pages: the values and one float32 scale per token and KV head.
        self.int8 = self.dtype == jnp.int8
        if self.int8 and cfg.is_mla:
            raise ValueError(
                "kv_cache_dtype='int8' is not supported for multi-head latent attention (the latent pool); use "
                "the weights' dtype, bfloat16 or an fp8 dtype"
            )
        # The pool row-major, as the kernels read it, from allocation on: left to itself XLA:TPU gives a pool with
        # small trailing dims another layout and copies the whole pool in and out of every step (AOT showed
        # 2.8x the pool in temporaries for SmolLM2 and Llama-3-8B shapes).
        platform = platform or jax.default_backend()
        # A TPU's pool keeps each page's heads outside its tokens, [L, P, K, page_size, H]: its minor dims are then
        # the TPU tiles' (page_size, head_dim), where [.., page_size, K, H] pads a chip's K heads to 8-16 sublanes.
        # int8 pages keep the other layout (their scales' [.., page_size] rows would pad to 128 lanes here).
        tpu = platform == "tpu" or attention_impl == "pallas-tpu"
        self.layout = "heads_tokens" if tpu and not self.int8 and not cfg.is_mla else "tokens_heads"
        pool_spec, scales_spec = kv_pool_specs(mesh, cfg.is_mla, self.layout)  # split over KV heads (and by stage)
        self.format = Format(Layout(tuple(range(len(pool_spec)))), NamedSharding(mesh, pool_spec))
        if self.int8:
            scales = Format(Layout(tuple(range(4))), NamedSharding(mesh, scales_spec))
            self.format = kernels.Int8Pages(self.format, scales)
        interpreted = attention_impl in ("pallas", "pallas-tpu")
        if self.dtype != jnp.float32 and platform == "cpu" and not interpreted and not cpp_attention:
            warnings.warn(
                f"a {self.dtype} KV cache on the CPU is slow without the C++ attention: XLA:CPU converts "
                "the whole pool to float32 for every K/V write (seconds per step for a GiB pool); "
                "kv_cache_dtype='float32' is the CPU default",
                RuntimeWarning,
                stacklevel=4,
            )
        if self.int8 and platform == "tpu":
            warnings.warn(
                "int8 KV pages take more HBM per page than bfloat16 on a TPU: the pool's two minor dims "
                "(KV heads, head_dim) and the scales' (page_size, KV heads) are padded to the TPU's tiles "
                "(`jaxserve plan` measures it); bfloat16 or fp8 pages are the better choice there today",
                RuntimeWarning,
                stacklevel=4,
            )
        self.num_pages = cache_cfg.num_pages or self.pages_from_memory(cache_cfg, sched_cfg)
        if jax.process_count() > 1:  # every process must allocate the same pool: the smallest any can hold
            self.num_pages = int(np.min(multihost_utils.process_allgather(np.int32(self.num_pages))))
        self.copy = jax.jit(
            _copy_pages,
            donate_argnums=(0, 1),
            in_shardings=(self.format,) * 2 + (None,) * 2,
            out_shardings=(self.format,) * 2,
        )  # (k, v, src, dst) -> (k, v): copy-on-write of pages src to dst, in place

    def spec_of(self, cache):
        """The partition spec of a K or V pool of this layout (a leaf-wise ``Int8Pages`` for an int8 one), without the
        stage axis: what a kernel sharded over the mesh's other axes sees."""
        return pool_spec(cache, self.layout)

    def allocate(self, abstract: bool = False) -> tuple:
        """(k, v) pools of ``num_pages``, allocated already split over KV heads (``abstract``: shapes and
        shardings only, for ``jaxserve.aot``)."""
        if abstract:
            return tuple(
                jax.tree.map(
                    lambda x, f: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=f.sharding),
                    jax.eval_shape(self.zeros(self.num_pages, value)),
                    self.format,
                )
                for value in (False, True)
            )
        return self.zeros(self.num_pages)(), self.zeros(self.num_pages, value=True)()

    def page_bytes(self) -> int:
        """Bytes of one page of the K and V pools over every layer (before any device's padding)."""
        return page_bytes(self.cfg, self.page_size, self.dtype)

    def shape(self, num_pages: int, value: bool = False) -> tuple[int, ...]:
        """The K pool's shape (``value``: the V pool's)."""
        c = self.cfg
        if c.is_mla:  # one latent a token and layer (and an empty V pool)
            return c.num_layers, num_pages, self.page_size, c.kv_cache_dims[value]
        if self.layout == "heads_tokens":
            return c.num_layers, num_pages, c.num_kv_heads, self.page_size, c.kv_cache_dims[value]
        return c.num_layers, num_pages, self.page_size, c.num_kv_heads, c.kv_cache_dims[value]

    def zeros(self, num_pages: int, value: bool = False):
        """A jitted allocation of the K (``value``: V) pool, split over KV heads and laid out row-major (int8: an
        ``Int8Pages`` of zero values and scales)."""
        shape = self.shape(num_pages, value)

        def zeros():
            values = jnp.zeros(shape, self.dtype)
            return kernels.Int8Pages(values, jnp.zeros(shape[:4], jnp.float32)) if self.int8 else values

        return jax.jit(zeros, out_shardings=self.format)

    def device_page_bytes(self) -> int:
        """What one page of the K and V pools takes on each device, as the compiler lays it out: a TPU pads the
        pool's two minor dims (KV heads per device, head_dim) to its tiles, e.g. one bfloat16 KV head to two."""
        pages = 64
        with jax.set_mesh(self.mesh):  # a topology's devices (jaxserve.aot) compile inside their mesh
            out = sum(
                self.zeros(pages, value).lower().compile().memory_analysis().output_size_in_bytes
                for value in (False, True)
            )
        return cdiv(out, pages)

    def pages_from_memory(self, cache_cfg: CacheConfig, sched_cfg: SchedulerConfig) -> int:
        """Pool size when ``num_pages`` is not given; logs the pages, tokens and bytes.

        ``cache_cfg.kv_cache_memory`` bytes (an int) or that fraction (a float) of the memory available now
        (device: its limit minus what is in use; CPU: MemAvailable). By default: on a device
        ``kv_cache_memory_fraction`` of its limit minus what is in use; on the CPU enough for every sequence
        at full length, but at most min(4 GiB, a quarter of the available host memory), since the host
        runs other processes (the pool is allocated, and touched, at startup).
        """
        device = self.mesh.local_devices[0]  # one this process owns: another host's device has no memory stats
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        on_device = bool(stats and "bytes_limit" in stats)
        available = stats["bytes_limit"] - stats.get("bytes_in_use", 0) if on_device else available_host_memory()
        # A device's memory holds its share of each page (the pool is split over KV heads); the CPU's simulated
        # devices all live in the same host memory.
        explicit = cache_cfg.kv_cache_memory
        page_bytes = self.device_page_bytes() if on_device else self.page_bytes()
        if isinstance(explicit, int):
            budget = explicit
        elif explicit is not None:
            budget = int(explicit * available)
        elif on_device:
            budget = int(stats["bytes_limit"] * cache_cfg.kv_cache_memory_fraction - stats.get("bytes_in_use", 0))
        else:
            budget = int(min(_CPU_KV_CAP_BYTES, available * _CPU_KV_AVAILABLE_SHARE))
        pages = budget // page_bytes
        if explicit is None and not on_device:
            # The host's available memory moves by megabytes from one second to the next, and the pool's page count
            # is a dimension of every compiled step: coarsened, a process started a moment later (a restarted
            # server, the next command) runs the same programs and loads them from the persistent cache.
            pages = min(coarse_floor(pages), sched_cfg.max_num_seqs * cdiv(sched_cfg.max_model_len, self.page_size) + 1)
        if pages < 2:
            raise ValueError(
                f"not enough memory for a KV cache: {budget} bytes hold {pages} pages of {page_bytes} "
                f"bytes ({available} bytes available); set num_pages or kv_cache_memory"
            )
        if budget > available:
            logger.warning(
                "kv_cache_memory=%r asks for %d bytes but only %d are available", explicit, budget, available
            )
        logger.info(
            "KV pool: %d pages of %d tokens = %d tokens, %.2f GiB (%.2f GiB available, kv_cache_memory=%r)",
            pages,
            self.page_size,
            pages * self.page_size,
            pages * page_bytes / 2**30,
            available / 2**30,
            explicit,
        )
        return pages


def _copy_pages(k_cache, v_cache, src, dst):
    """Copy-on-write: pages ``src`` -> ``dst`` in every layer (an int8 pool's scales with its values)."""
    copy = lambda x: x.at[:, dst].set(x[:, src])  # noqa: E731
    return jax.tree.map(copy, k_cache), jax.tree.map(copy, v_cache)
