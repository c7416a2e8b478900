"""The engine's steps compiled ahead of time for a TPU slice, on a machine without one, and a memory plan.

``libtpu`` (``pip install "jax[tpu]"``) compiles for TPUs without a TPU: ``jax.experimental.topologies`` describes
a slice ("v5e:2x4", "v6e:2x4", "v5p:2x2x1", multi-host ones such as "v5e:4x4"), and jitted functions lowered on
``jax.ShapeDtypeStruct`` arguments placed on its devices compile with XLA's and Mosaic's TPU compilers. That
checks everything but numerics: the Pallas kernels' lowering, the sharded step, and what each chip must hold
(``memory_analysis``), with FLOPs and bytes from ``cost_analysis``.

:func:`plan` builds the runner abstractly (``ModelRunner`` on ShapeDtypeStruct parameters: nothing allocated),
sizes the KV pool from the chip's HBM the way the runner does on a device, compiles the step variants, and
estimates decode throughput from bytes moved per step and the chip's published bandwidth. GPUs ("h100:8",
"h200:1") compile the same way with the CUDA plugin, which needs no GPU (:func:`gpu_devices`; the target
descriptions are in ``jaxserve/configs/gpus/``).

A mixture of experts holds every expert but computes, per token, only its ``num_experts_per_tok`` of them: the plan
counts its parameters in total and active per token (:func:`param_counts`), and a decode step of B sequences reads
the experts that B x k choices can touch, at most min(num_experts, B x k) per layer, not all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import jax
import numpy as np

from jaxserve.audit import StepAudit, audit
from jaxserve.config import EngineConfig, ModelConfig, kv_dtype
from jaxserve.utils import cdiv


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    tpu: bool = True
    fp8: bool = False  # fp8 arithmetic (quantization="fp8")


GiB = 1 << 30
# Published per-chip figures (Google Cloud TPU and NVIDIA data sheets).
CHIPS = {
    "v4": Chip("TPU v4", 32 * GiB, 1.2e12, 275e12),
    "v5e": Chip("TPU v5e", 16 * GiB, 819e9, 197e12),
    "v5p": Chip("TPU v5p", 95 * GiB, 2.765e12, 459e12),
    "v6e": Chip("TPU v6e", 32 * GiB, 1.64e12, 918e12, fp8=True),
    "a100": Chip("NVIDIA A100 80GB", 80 * 10**9, 2.039e12, 312e12, tpu=False),
    "h100": Chip("NVIDIA H100 SXM", 80 * 10**9, 3.35e12, 989e12, tpu=False, fp8=True),
    "h200": Chip("NVIDIA H200", 141 * 10**9, 4.8e12, 989e12, tpu=False, fp8=True),
}


def parse_topology(topology: str) -> tuple[Chip, int]:
    """ "v5e:2x4" -> (v5e, 8 chips); "h100:8" -> (h100, 8).

    Raises:
        ValueError: an unknown chip or a malformed shape, naming the known ones.
    """
    chip_name, _, shape = topology.partition(":")
    chip = CHIPS.get(chip_name.lower())
    try:
        dims = [int(d) for d in shape.split("x")] if shape else []
    except ValueError:
        dims = []
    if chip is None or not dims or min(dims) < 1:
        raise ValueError(
            f"unknown topology {topology!r}: expected CHIP:SHAPE with CHIP one of "
            f"{', '.join(CHIPS)} (e.g. v5e:2x4, v5p:2x2x1, v5e:4x4, h100:8)"
        )
    return chip, math.prod(dims)


def topology_devices(topology: str, num_slices: int = 1) -> list:
    """The devices of a TPU slice description, or of ``num_slices`` such slices joined over the data-center network,
    slice by slice (no TPU needed; libtpu is); or of a GPU topology ("h200:8": one host's GPUs; no GPU needed, the
    CUDA plugin is)."""
    import os

    from jax.experimental import topologies

    chip, count = parse_topology(topology)
    if not chip.tpu:
        if num_slices > 1:
            raise ValueError(f"num_slices is for TPU slices; a GPU topology counts its GPUs ({topology!r})")
        return gpu_devices(topology.partition(":")[0].lower(), count)

    # libtpu takes a machine-wide lock meant for real TPUs; describing a topology touches no TPU.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        extra = {"num_slices": num_slices} if num_slices > 1 else {}
        return list(topologies.get_topology_desc(topology, "tpu", **extra).devices)
    except Exception as e:  # noqa: BLE001 - libtpu missing, or a shape it does not know
        raise ValueError(
            f"cannot describe TPU topology {topology!r} (needs libtpu: pip install 'jax[tpu]'): {e}"
        ) from e


def gpu_targets() -> dict[str, str]:
    """The GPUs jaxserve can compile for without one: name -> the path of its target description (XLA's
    ``GpuTargetConfigProto`` in text form, in ``jaxserve/configs/gpus/``)."""
    from importlib import resources

    folder = resources.files("jaxserve.configs") / "gpus"
    return {
        f.name.removesuffix(".txtpb"): str(f) for f in sorted(folder.iterdir(), key=str) if f.name.endswith(".txtpb")
    }


def _cuda_plugin_pip() -> str:
    """How to install JAX's CUDA plugin at this jax's version (no NVIDIA libraries)."""
    return f"pip install jax-cuda13-plugin=={jax.__version__} jax-cuda13-pjrt=={jax.__version__}"


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is installed (whether it can compile for GPUs here: ``gpu_devices``)."""
    import importlib.util

    return (
        any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (13, 12))
        if importlib.util.find_spec("jax_plugins")
        else False
    )


def gpu_devices(name: str, count: int = 1) -> list:
    """``count`` compile-only devices of the GPU ``name`` ("h100", "h200", "a100"): jitted functions lowered on
    arguments placed on them compile with XLA's GPU compiler and Triton, on any machine. Needs the CUDA plugin
    (``pip install jax-cuda13-plugin jax-cuda13-pjrt``, jax's version; no driver, no GPU) and JAX_PLATFORMS not
    asking for CUDA (the plugin checks the CUDA libraries only for a platform asked for; unset, it is set to cpu
    here, before JAX picks its backends).

    Raises:
        ValueError: a GPU with no target description (naming those there are), or no CUDA plugin.
    """
    import os

    from jax._src import xla_bridge
    from jax.experimental import topologies

    targets = gpu_targets()
    if name not in targets:
        raise ValueError(f"no GPU target description for {name!r}: jaxserve compiles for {', '.join(targets)}")
    if not xla_bridge._backends and not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    try:
        with open(targets[name]) as f:
            desc = topologies.get_topology_desc("", "cuda", target_config=f.read(), topology=f"1x1x{count}")
    except Exception as e:  # noqa: BLE001 - no plugin, or one that did not register
        raise ValueError(
            f"cannot compile for {name!r} without a GPU: needs the CUDA plugin at jax's version ({_cuda_plugin_pip()}), "
            f"registered (JAX_PLATFORMS unset or cpu): {e}"
        ) from e
    return list(desc.devices)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled step variant: its bucket, compile time, and what XLA says a chip needs and does."""

    tokens: int
    pages: int
    decode_only: bool
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    sampler: str = "full"  # the sampler's variant it was compiled with (jaxserve.sampling.sampler.VARIANTS)
    hlo: str = ""  # the optimized HLO, where ``plan(keep_hlo=True)`` asked for it
    audit: StepAudit | None = None  # what the step does on the chip, from its optimized HLO (jaxserve.audit)

    @property
    def peak_bytes(self) -> int:
        """Arguments + temporaries + outputs not aliased to a donated argument (the KV pool is)."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    topology: str
    chip: Chip
    tensor_parallel_size: int
    dtype: str
    weight_bytes_per_chip: int
    page_bytes_per_chip: int
    num_pages: int
    page_size: int
    activation_bytes_per_chip: int  # the largest variant's temporaries (0 when planned by arithmetic)
    seq_len: int
    batch: int
    variants: tuple[Variant, ...]
    kv_cache_memory_fraction: float
    total_params: int = 0
    active_params: int = 0  # per token: a mixture of experts' top-k experts, not all (param_counts)
    expert_bytes_per_chip: int = 0  # the experts' share of weight_bytes_per_chip (0: a dense model)
    num_experts: int = 0
    experts_per_tok: int = 0
    expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    stage_layer_counts: tuple[int, ...] = ()  # layers of each stage (pipeline parallel)
    not_compiled: str = "arithmetic only"  # why no variant was compiled, where none was
    gathered_bytes_per_chip: int = 0  # the embedding table when the model has its own output head: rows looked up

    def kv_bytes_read(self, tokens: int) -> float:
        """KV bytes a chip reads in a decode step of ``tokens`` sequences of ``seq_len`` tokens of context."""
        return tokens * self.seq_len * self.page_bytes_per_chip / self.page_size

    def floor_bytes(self, variant: Variant) -> float:
        """The least a chip must read in a decode step: its weights once (a MoE: the experts its tokens can pick;
        the embedding table only by rows) and its share of every sequence's KV."""
        weights = self.weight_bytes_read(variant.tokens) - self.gathered_bytes_per_chip
        return weights + self.kv_bytes_read(variant.tokens)

    def audited_bytes(self, variant: Variant) -> float:
        """What the compiled decode step moves per chip (``Variant.audit``), its KV read priced as in the floor."""
        return variant.audit.bytes + self.kv_bytes_read(variant.tokens)

    @property
    def kv_bytes_per_chip(self) -> int:
        return self.num_pages * self.page_bytes_per_chip

    @property
    def max_sequences(self) -> int:
        """Sequences of ``seq_len`` tokens the pool holds at once."""
        return self.num_pages // cdiv(self.seq_len, self.page_size)

    @property
    def fits(self) -> bool:
        return self.num_pages >= cdiv(self.seq_len, self.page_size)

    def decode_batch(self, batch: int | None = None) -> int:
        """The roofline's batch: ``batch`` (default: max_num_seqs), at most the sequences the pool holds."""
        return min(batch or self.batch, max(self.max_sequences, 1))

    def experts_read(self, batch: int) -> int:
        """Experts a decode step of ``batch`` sequences reads per MoE layer, at most: each token picks k."""
        return min(self.num_experts, batch * self.experts_per_tok)

    def weight_bytes_read(self, batch: int) -> float:
        """Weight bytes a chip reads in a decode step of ``batch`` sequences: all but the experts, and of those the
        share that ``experts_read`` can touch (the whole weights for a dense model)."""
        if not self.num_experts:
            return self.weight_bytes_per_chip
        dense = self.weight_bytes_per_chip - self.expert_bytes_per_chip
        return dense + self.expert_bytes_per_chip * self.experts_read(batch) / self.num_experts

    def decode_tokens_per_s(self, batch: int | None = None, in_flight: int | None = None) -> float:
        """Roofline of a decode step of ``batch`` sequences (default: max_num_seqs) at ``seq_len``: each chip reads
        its weights once (a MoE's: see ``weight_bytes_read``) and its share of every sequence's KV, at its published
        bandwidth, or computes each token's active weights, if that takes longer.

        Pipeline parallel: a tick is that step on the largest stage's chips; with ``in_flight`` batches (default:
        one per stage) sharing the pool, a tick yields ``in_flight / stages`` batches' tokens: with one batch in
        flight the other stages idle (the bubble)."""
        stages = self.pipeline_parallel_size
        in_flight = stages if in_flight is None else in_flight
        if not 1 <= in_flight <= stages:
            raise ValueError(f"in_flight must be in [1, {stages}], got {in_flight}")
        batch = min(self.decode_batch(batch), max(self.max_sequences // in_flight, 1))
        kv_token_bytes = self.page_bytes_per_chip / self.page_size
        read = self.weight_bytes_read(batch) + batch * self.seq_len * kv_token_bytes
        active = self.weight_bytes_per_chip
        if self.num_experts:
            active -= self.expert_bytes_per_chip * (1 - self.experts_per_tok / self.num_experts)
        flops = 2 * batch * active / np.dtype(_np_dtype(self.dtype)).itemsize
        step_s = max(read / self.chip.hbm_bytes_per_s, flops / self.chip.bf16_flops)
        return batch * in_flight / (stages * step_s)

    def summary(self) -> str:
        hbm = self.chip.hbm_bytes
        ep = ", experts: expert parallel" if self.expert_parallel and self.num_experts else ""
        pp = self.pipeline_parallel_size
        stages = f"{pp} pipeline stages x " if pp > 1 else ""
        lines = [
            f"{self.model} on {self.topology} ({self.chip.name}, {stages}{self.tensor_parallel_size}-way tensor "
            f"parallel{ep}, {self.dtype})",
        ]
        if pp > 1:
            counts = self.stage_layer_counts
            lines.append(
                f"  stages                {pp} of {'/'.join(map(str, counts))} layers (the embedding and output "
                "head on each); per chip: the largest stage's"
            )
        if self.total_params:
            lines.append(
                f"  parameters            {self.total_params / 1e9:8.2f} B"
                + (
                    f", {self.active_params / 1e9:.2f} B active per token ({self.experts_per_tok} of "
                    f"{self.num_experts} experts)"
                    if self.num_experts
                    else ""
                )
            )
        lines += [
            f"  weights per chip      {self.weight_bytes_per_chip / GiB:8.2f} GiB"
            + (f" (experts {self.expert_bytes_per_chip / GiB:.2f} GiB)" if self.num_experts else ""),
            f"  activations per chip  {self.activation_bytes_per_chip / GiB:8.2f} GiB"
            + ("" if self.variants else f"  (not compiled: {self.not_compiled})"),
            f"  KV pool per chip      {self.kv_bytes_per_chip / GiB:8.2f} GiB: {self.num_pages} pages of "
            f"{self.page_size} tokens ({self.page_bytes_per_chip / 1024:.0f} KiB per chip per page)",
            f"  HBM per chip          {hbm / GiB:8.2f} GiB (pool sized to {self.kv_cache_memory_fraction:.0%} of it)",
            f"  fits: {'yes' if self.fits else 'NO'}; {self.max_sequences} sequences of {self.seq_len} tokens at once",
        ]
        if pp > 1:
            b = min(self.decode_batch(), max(self.max_sequences // pp, 1))
            lines.append(
                f"  decode roofline, {pp} batches of {b} in flight, {self.seq_len} tokens of context: "
                f"{self.decode_tokens_per_s(b):,.0f} tokens/s; one batch of {b} in flight: "
                f"{self.decode_tokens_per_s(b, in_flight=1):,.0f} tokens/s (the bubble: {pp - 1} of {pp} stages idle)"
            )
        batches = sorted({1, self.decode_batch()}) if self.num_experts else [self.decode_batch()]
        for b in batches if pp == 1 else ():
            line = f"  decode roofline at batch {b}, {self.seq_len} tokens of context: {self.decode_tokens_per_s(b):,.0f} tokens/s"
            if self.num_experts:
                line += (
                    f" (reads {self.weight_bytes_read(b) / GiB:.2f} GiB of weights per chip: experts "
                    f"min({self.num_experts}, {b}x{self.experts_per_tok}) = {self.experts_read(b)} per layer)"
                )
            lines.append(line)
        if self.variants:
            lines.append(
                f"  compiled {len(self.variants)} step variant(s) in {sum(v.compile_s for v in self.variants):.1f}s:"
            )
            for v in self.variants:
                lines.append(
                    f"    tokens {v.tokens:5d} pages {v.pages:4d} {'decode' if v.decode_only else 'mixed '}: "
                    f"peak {v.peak_bytes / GiB:6.2f} GiB/chip (temp {v.temp_bytes / GiB:.2f}), {v.sampler} sampler, "
                    f"{v.compile_s:.1f}s"
                )
                if v.audit is not None:
                    floor = self.floor_bytes(v) if v.decode_only else None
                    kv = self.kv_bytes_read(v.tokens) if v.decode_only else 0.0
                    lines.append(f"      {v.audit.summary(floor, kv)}")
        return "\n".join(lines)


def _np_dtype(dtype: str):
    import ml_dtypes

    return {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[dtype]


def _model_config(model: str | ModelConfig) -> tuple[str, ModelConfig]:
    """A preset name, an HF ``config.json`` (or its directory), or a ModelConfig."""
    if isinstance(model, ModelConfig):
        return model.architecture, model
    import json
    from pathlib import Path

    from jaxserve.config import list_presets, load_preset

    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path.parent.name, ModelConfig.from_hf(json.loads(path.read_text()))
    if model in list_presets():
        return model, load_preset(model)
    raise ValueError(f"model {model!r} is not a preset ({', '.join(list_presets())}) or an HF config.json")


def _abstract_params(cfg: ModelConfig, dtype: str) -> dict:
    from jaxserve.models.schema import param_schema

    return {n: jax.ShapeDtypeStruct(s.shape, _np_dtype(dtype)) for n, s in param_schema(cfg).items()}


def _nbytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def _per_chip_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _is_expert(spec) -> bool:
    """One of the experts' stacked parameters (matrices and gpt-oss's biases); the router is not."""
    return "experts" in spec.axes


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, parameters active per token): for a mixture of experts, the second counts the attention, the
    router, ``num_experts_per_tok`` of each MoE layer's experts, the dense layers, the norms and the embedding and
    output matrices (as the decode roofline reads them); for a dense model both are the total."""
    from jaxserve.models.schema import param_schema

    schema = param_schema(cfg)
    total = sum(math.prod(s.shape) for s in schema.values())
    experts = sum(math.prod(s.shape) for s in schema.values() if _is_expert(s))
    if not cfg.is_moe:
        return total, total
    return total, total - experts + experts // cfg.num_experts * cfg.num_experts_per_tok


def plan(
    model: str | ModelConfig,
    topology: str,
    tensor_parallel_size: int | None = None,
    config: EngineConfig | None = None,
    *,
    seq_len: int | None = None,
    variants: str = "corners",
    compile: bool | None = None,
    num_slices: int = 1,
    sampler: str = "full",
    keep_hlo: bool = False,
    **settings,
) -> Plan:
    """Plans (and compiles, for a TPU, or a GPU where the CUDA plugin is installed) one engine replica over
    ``tensor_parallel_size`` chips.

    Args:
        model: a preset name, an HF config.json (or its directory), or a ModelConfig; no weights are read.
        topology: "v5e:2x4", "v6e:2x4", "v5p:2x2x1", "v5e:4x4", ... or GPUs "h100:8", "h200:1" (compiled with the
            CUDA plugin where it is installed: ``gpu_devices``).
        tensor_parallel_size: chips per replica (default: all of the topology's).
        config / settings: the engine's settings (``EngineConfig``; ``pipeline_parallel_size`` splits the layers
            over stages of ``tensor_parallel_size`` chips, compiled where the engine serves the split, by arithmetic
            where it does not: uneven stages); dtype defaults to bfloat16,
            ``max_model_len`` to the model's (at most 2048).
        seq_len: context length for "how many sequences fit" and the roofline (default: max_model_len).
        variants: "corners" (the largest mixed and decode-only buckets), "decode" (the largest decode-only one),
            "mixed" (the largest mixed one) or "all" (every bucket the runner compiles at warm-up).
        compile: False plans by arithmetic only; True compiles (or raises where no compiler for the topology is
            installed); None (default): a TPU's always, a GPU's where the CUDA plugin is installed.
        num_slices: copies of ``topology`` joined over the data-center network (TPU multislice), e.g. two v5e-8
            slices for 2 stages of 8 chips.
        sampler: the sampler's variant the steps compile with: "full" (every sampling option), "prompt" (full and
            the step's prompt logprobs: the one whose memory bounds the others'; on the CPU, whose runner has no
            "prompt" variant, full computes them), "greedy" (the step of batches that are all greedy and ask for
            nothing else) or "sampled" (temperature, min-p, top-k up to 256 and seeds, nothing else).
        keep_hlo: keep each compiled step's optimized HLO (``Variant.hlo``), to audit what the chip will run.

    Raises:
        ValueError: an unknown topology or model, a degree the model or the topology cannot take, or a model
            whose weights and activations leave no room for one sequence's KV.
    """
    from jax.sharding import AbstractMesh

    from jaxserve.engine.llm_engine import DEFAULT_MAX_MODEL_LEN
    from jaxserve.models.schema import param_schema
    from jaxserve.parallel.pipeline import check_pipeline, stage_layers
    from jaxserve.parallel.sharding import MESH_AXES, kv_heads_for, make_mesh, rules_for
    from jaxserve.runner.kv_pool import page_bytes as pool_page_bytes
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.sampling.sampler import VARIANTS

    if sampler not in VARIANTS:
        raise ValueError(f"sampler must be one of {', '.join(map(repr, VARIANTS))}, got {sampler!r}")
    name, cfg = _model_config(model)
    chip, num_chips = parse_topology(topology)
    if not isinstance(num_slices, int) or num_slices < 1:
        raise ValueError(f"num_slices must be a positive int, got {num_slices!r}")
    num_chips *= num_slices
    slice_topology = topology
    if num_slices > 1:
        topology = f"{num_slices} x {topology}"
    config = EngineConfig.from_settings(config, **settings)
    pp = config.pipeline_parallel_size
    stages = stage_layers(cfg.num_layers, pp)
    tp = tensor_parallel_size or num_chips // pp
    layout = f"tensor_parallel_size={tp}" + (f" x pipeline_parallel_size={pp}" if pp > 1 else "")
    if tp * pp > num_chips or tp < 1:
        raise ValueError(f"{layout} needs {tp * pp} chips, but {topology} has {num_chips}")
    kv_heads = kv_heads_for(cfg, tp)  # the degree must suit the heads
    if config.quantization == "gguf":
        raise ValueError("quantization='gguf' serves a GGUF file's weights; plan reads no weights: use int8 or int4")
    if config.quantization == "fp8" and not chip.fp8:
        raise ValueError(f"quantization='fp8' needs fp8 arithmetic, which a {chip.name} does not have")
    dtype = config.dtype or "bfloat16"
    max_model_len = config.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    sched_cfg = config.scheduler_config(max_model_len, "tpu" if chip.tpu else "gpu", chip.hbm_bytes)
    seq_len = seq_len or max_model_len
    not_compiled = "arithmetic only"
    if compile is None:
        compile = chip.tpu or cuda_plugin_installed()
        if not compile:
            not_compiled = f"no CUDA plugin: {_cuda_plugin_pip()}"
    if compile and pp > 1:
        try:
            check_pipeline(cfg, pp)
        except ValueError:  # a split the engine does not serve yet (uneven stages): planned by arithmetic
            compile, not_compiled = False, f"the engine does not serve {cfg.num_layers} layers over {pp} stages"
    mesh = make_mesh(tp, topology_devices(slice_topology, num_slices)[: tp * pp], pp) if compile else None
    # the expert-parallel degree must divide the experts (checked on an abstract mesh when nothing compiles)
    rules_for(cfg, mesh or AbstractMesh((pp, 1, tp), MESH_AXES), config.enable_expert_parallel)

    def runner(num_pages: int):
        cache = dataclasses.replace(config.cache_config(), num_pages=num_pages)
        return ModelRunner(
            cfg,
            _abstract_params(cfg, dtype),
            cache,
            sched_cfg,
            "pallas",
            config.matmul_dtype,
            mesh,
            platform="tpu" if chip.tpu else "gpu",
            quantization=config.quantization,
            expert_parallel=config.enable_expert_parallel,
        )

    kv = kv_dtype(config.kv_cache_dtype, _np_dtype(dtype))
    heads_per_chip = 1 if cfg.is_mla else kv_heads // tp  # MLA: the latent pool, whole on every chip
    # a chip's share of the largest stage's page (the pool's own arithmetic; compiled, the TPU's padding replaces it)
    page_bytes = pool_page_bytes(cfg, config.page_size, kv, layers=max(map(len, stages)), kv_heads=heads_per_chip)
    compiled: list[Variant] = []
    gathered = 0  # the floor's: known where the step compiles (Plan.floor_bytes)
    if compile:
        probe = runner(num_pages=config.num_pages or 2 * cdiv(max_model_len, config.page_size))
        page_bytes = probe.pool.device_page_bytes()  # with the TPU's tile padding
        weights = _per_chip_bytes((probe.state, probe.matmul_weights))
        experts = [n for n, s in param_schema(probe.cfg).items() if _is_expert(s) and n in probe.state]
        expert_bytes = _per_chip_bytes([probe.state[n].get_value() for n in experts])  # quantized: values + scales
        if "lm_head" in probe.state:
            gathered = _per_chip_bytes([probe.state["embed"].get_value()])
    else:
        params = _abstract_params(cfg, dtype)
        if config.quantization:
            from jaxserve import quant
            from jaxserve.models.schema import param_schema, quantizable_names

            quantizable = quantizable_names(param_schema(cfg))
            params = {
                n: jax.eval_shape(lambda x, n=n: quant.quantize_param(n, x, config.quantization), p)
                if n in quantizable
                else p
                for n, p in params.items()
            }
        schema = param_schema(cfg)

        def stage_bytes(n: str, layers: range) -> int:
            """Parameter n's bytes on the stage holding ``layers`` (the whole of it without pipeline stages)."""
            spec, nbytes = schema[n], sum(_nbytes(x) for x in jax.tree.leaves(params[n]))
            if not spec.per_layer:  # the embedding, final norm and head: on every stage
                return nbytes
            held = sum(1 for layer in (spec.layers or range(cfg.num_layers)) if layer in layers)
            return nbytes * held // spec.num_stacked

        # the experts are split over the chips either way: each expert's hidden (TP) or whole experts (EP)
        experts = [n for n, s in schema.items() if _is_expert(s) and n in params]
        weights, expert_bytes = max(
            (sum(stage_bytes(n, layers) for n in params) // tp, sum(stage_bytes(n, layers) for n in experts) // tp)
            for layers in stages
        )
    if weights > chip.hbm_bytes * config.kv_cache_memory_fraction:
        raise ValueError(
            f"{name} does not fit {topology} at {layout}: its weights alone take {weights / GiB:.2f} GiB per chip of {chip.hbm_bytes / GiB:.0f} GiB; use more chips or a "
            f"larger chip"
        )
    activations = 0
    if compile and not config.num_pages:  # the largest step's temporaries, to size the pool from what is left
        largest = max((s for s in probe.compiler.buckets.shapes() if not s[2]), key=lambda s: s[:2])
        # with the sampler's "prompt" variant: prompt logprobs' [rows, V] blocks are the largest temporaries
        activations = _compile(probe, [largest], "prompt")[0].temp_bytes
    budget = int(chip.hbm_bytes * config.kv_cache_memory_fraction) - weights - activations
    num_pages = config.num_pages or max(budget // page_bytes, 0)
    result = Plan(
        name,
        topology,
        chip,
        tp,
        dtype,
        weights,
        page_bytes,
        num_pages,
        config.page_size,
        activations,
        seq_len,
        sched_cfg.max_num_seqs,
        (),
        config.kv_cache_memory_fraction,
        *param_counts(cfg),
        expert_bytes,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        config.enable_expert_parallel and cfg.is_moe,
        pp,
        tuple(map(len, stages)) if pp > 1 else (),
        not_compiled,
        gathered,
    )
    if not result.fits:
        raise ValueError(
            f"{name} does not fit {topology} at {layout}: per chip {weights / GiB:.2f} GiB of "
            f"weights and {activations / GiB:.2f} GiB of activations leave {max(budget, 0) / GiB:.2f} GiB of "
            f"{chip.hbm_bytes / GiB:.0f} GiB ({config.kv_cache_memory_fraction:.0%}) for the KV cache, less than "
            f"one {seq_len}-token sequence ({cdiv(seq_len, config.page_size) * page_bytes / GiB:.2f} GiB); "
            f"use more chips, a larger chip or a shorter max_model_len"
        )
    if compile:
        final = runner(num_pages)
        shapes = final.compiler.buckets.shapes()
        kinds = {"corners": (False, True), "decode": (True,), "mixed": (False,)}.get(variants)
        if kinds is not None:  # every runner has both kinds of shape (StepBuckets.shapes)
            shapes = [max((s for s in shapes if s[2] == d), key=lambda s: s[:2]) for d in kinds]
        elif variants != "all":
            raise ValueError(f"variants must be 'corners', 'decode', 'mixed' or 'all', got {variants!r}")
        compiled = _compile(final, shapes, sampler, keep_hlo)
        activations = max([activations, *(v.temp_bytes for v in compiled)])
        peak = max(v.peak_bytes for v in compiled)
        if peak > chip.hbm_bytes:
            raise ValueError(
                f"the compiled step needs {peak / GiB:.2f} GiB per chip, more than the "
                f"{chip.hbm_bytes / GiB:.0f} GiB of a {chip.name}"
            )
    return dataclasses.replace(result, variants=tuple(compiled), activation_bytes_per_chip=activations)


@contextlib.contextmanager
def no_persistent_cache():
    """Compiles for a topology without touching JAX's persistent cache: this process has no client for that
    device, so it could not read such executables back (a warning and a recompile each time)."""
    from jax._src import compilation_cache  # JAX memoizes whether the cache is on: reset it around the switch

    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
        compilation_cache.reset_cache()


def _compile(runner, shapes, sampler: str = "full", keep_hlo: bool = False) -> list[Variant]:
    """Compiles the runner's step for each (tokens, pages, decode_only) on abstract arguments, for its mesh, with
    the sampler's ``sampler`` variant."""
    out = []
    with no_persistent_cache(), jax.set_mesh(runner.mesh):
        for tokens, pages, decode_only in shapes:
            t0 = time.perf_counter()
            try:
                exe = runner.compiler.lower_step(tokens, pages, decode_only, sampler).compile()
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                raise ValueError(f"the step for {tokens} tokens over {pages} pages does not fit a chip: {e}") from e
            dt = time.perf_counter() - t0
            mem, text = exe.memory_analysis(), exe.as_text()
            cost = exe.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost or {}
            out.append(
                Variant(
                    tokens,
                    pages,
                    decode_only,
                    dt,
                    mem.argument_size_in_bytes,
                    mem.output_size_in_bytes,
                    mem.alias_size_in_bytes,
                    mem.temp_size_in_bytes,
                    mem.generated_code_size_in_bytes,
                    float(cost.get("flops", 0.0)),
                    float(cost.get("bytes accessed", 0.0)),
                    sampler,
                    text if keep_hlo else "",
                    audit(text),
                )
            )
    return out
