"""Replicas: where each one runs, and building one from the engine's settings.

``Placement.plan`` turns the parallel settings into one mesh per data-parallel replica and, under several processes,
the groups of processes that run each; ``load_target`` / ``load_draft`` read the weights checked against that layout;
``ReplicaBuilder`` is where the engine's settings walk down, once, into what each part of a replica takes: the runner
its model, pool and kernels, the block manager its pages, the scheduler its budgets, the drafter its own runner.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
from jax.sharding import Mesh

from jaxserve import quant
from jaxserve.config import EngineConfig, SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.sched.async_scheduler import make_scheduler
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.engine.remote_replica import GroupLink, RemoteRunner
from jaxserve.loading import LoadedModel, load_model
from jaxserve.loading.weights import cast_params
from jaxserve.parallel.distributed import multi_process, replica_groups
from jaxserve.parallel.pipeline import check_pipeline
from jaxserve.parallel.sharding import check_parallelism, checkpoint_shardings, kv_heads_for, make_mesh
from jaxserve.runner.model_runner import ModelRunner, default_dtype
from jaxserve.spec_decode.draft_model import DraftProposer


@dataclasses.dataclass
class Replica:
    """One data-parallel replica: its own devices (a mesh of ``tensor_parallel_size``), weights, KV pool,
    compiled steps and scheduler. Requests go to the least loaded one and stay there."""

    runner: ModelRunner | RemoteRunner
    scheduler: Scheduler
    drafter: DraftProposer | None = None  # speculative decoding with a draft model
    in_flight: tuple | None = None  # async scheduling: (SchedulerOutput, runner InFlight) of the step running now
    # Pipeline stages: the steps in flight, oldest first, up to one per stage (``LLMEngine._step_pipeline``).
    pipeline: collections.deque = dataclasses.field(default_factory=collections.deque)

    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the replicas run.

    Attributes:
        meshes: one per data-parallel replica, disjoint: ``tensor_parallel_size`` devices a stage, stage by stage.
        groups: under several processes, (the processes, the replica indices) of each group of processes that runs
            replicas together; one group (process 0, every replica) otherwise.
        home: the index in ``groups`` of this process' group.
    """

    meshes: list[Mesh]
    groups: list[tuple[tuple[int, ...], list[int]]]
    home: int

    @property
    def local(self) -> list[int]:
        """The replicas this process runs (its group's); process 0 stands in for the other groups'."""
        return self.groups[self.home][1]

    @classmethod
    def plan(cls, config: EngineConfig) -> Placement:
        """The meshes and process groups of ``config``'s parallel settings.

        Raises:
            ValueError: a layout the devices cannot take, or one the engine does not run.
        """
        tp, dp, pp = config.tensor_parallel_size, config.data_parallel_size, config.pipeline_parallel_size
        check_parallelism(tp, dp, pipeline_parallel_size=pp)
        if pp > 1 and config.speculative_config is not None:
            raise ValueError("pipeline_parallel_size > 1 does not run speculative decoding")
        if multi_process() and tp * dp * pp != jax.device_count():
            names, got = ("", "") if pp == 1 else (" x pipeline_parallel_size", f" x {pp}")
            raise ValueError(
                f"under {jax.process_count()} processes, the replicas use every device: tensor_parallel_size x "
                f"data_parallel_size{names} must be {jax.device_count()} (got {tp} x {dp}{got})"
            )
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        n = tp * pp  # each replica's devices, stage by stage
        meshes = [make_mesh(tp, devices[i * n : (i + 1) * n], pp) for i in range(dp)]
        groups = replica_groups(meshes) if multi_process() else [((0,), list(range(dp)))]
        me = jax.process_index()
        home = next(g for g, (procs, _) in enumerate(groups) if me in procs)
        return cls(meshes, groups, home)


def weights_dtype(config: EngineConfig) -> str:
    """The float weights' dtype (``config.dtype``, or the platform's default), checked against ``matmul_dtype`` and
    ``quantization``.

    Raises:
        ValueError: a combination the products cannot run; a quantization this backend cannot run.
    """
    dtype = config.dtype or default_dtype()
    if config.matmul_dtype not in (None, dtype, "bfloat16"):
        raise ValueError(
            f"matmul_dtype must be None, the weights' dtype ({dtype}) or 'bfloat16', got {config.matmul_dtype!r}"
        )
    if config.quantization is not None:
        if config.matmul_dtype not in (None, dtype) and config.quantization == "w8a8":
            raise ValueError(
                f"matmul_dtype={config.matmul_dtype!r} cannot be combined with quantization='w8a8', "
                "whose products multiply int8 activations by int8 weights"
            )
        quant.check_backend(config.quantization)
    return dtype


def load_target(model, config: EngineConfig, placement: Placement, dtype: str) -> LoadedModel:
    """The model to serve, in host memory (or, for a sharded checkpoint, on the first local replica's devices),
    checked against the parallel layout before its weights are read. ``model``: what ``LLMEngine`` takes."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size

    def check(cfg):
        kv_heads_for(cfg, tp)
        check_pipeline(cfg, pp, dtype)

    if isinstance(model, LoadedModel):  # already in host memory: several engines can share one load
        check(model.config)
        if config.quantization == "gguf" and not any(quant.is_quantized(v) for v in model.params.values()):
            raise ValueError(
                "quantization='gguf' serves the quantized weights of a GGUF file: load it with "
                "load_model(path, keep_quantized=True), or pass the path"
            )
        return dataclasses.replace(model, params=cast_params(model.params, dtype))
    mesh = placement.meshes[placement.local[0]]
    return load_model(
        model,
        dtype,
        check_config=check,
        shardings=lambda cfg: checkpoint_shardings(cfg, mesh, config.enable_expert_parallel),
        keep_quantized=config.quantization == "gguf",
    )


def load_draft(spec, target: LoadedModel, dtype: str, tp: int) -> LoadedModel | None:
    """The draft model of ``speculative_config`` (method draft_model), loaded; None otherwise.

    Raises:
        ValueError: its vocabulary differs from the target's, or several processes serve (not supported).
    """
    if spec is None or spec.method != "draft_model":
        return None
    if multi_process():
        raise ValueError("speculative_config method 'draft_model' is not supported across several processes")
    draft = spec.model
    if isinstance(draft, LoadedModel):
        draft = dataclasses.replace(draft, params=cast_params(draft.params, dtype))
    else:
        draft = load_model(draft, dtype, check_config=lambda cfg: kv_heads_for(cfg, tp))
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative_config.model has a vocabulary of {draft.config.vocab_size} tokens; the "
            f"target's has {target.config.vocab_size}: a draft model must share it"
        )
    return draft


class ReplicaBuilder:
    """Builds the replicas of one engine: each part gets its own settings, taken from the engine's here.

    Args:
        config: the engine's settings.
        scheduler_config: the budgets every replica's scheduler (and its runner's buckets) share.
        model: the loaded target model; ``draft``: the loaded draft model, or None.
    """

    def __init__(
        self,
        config: EngineConfig,
        scheduler_config: SchedulerConfig,
        model: LoadedModel,
        draft: LoadedModel | None = None,
    ):
        self.config, self.scheduler_config, self.model, self.draft = config, scheduler_config, model, draft

    def _scheduler(self, num_pages: int) -> Scheduler:
        c = self.config
        return make_scheduler(self.scheduler_config, BlockManager(num_pages, c.page_size, c.enable_prefix_caching))

    def local(self, mesh: Mesh) -> Replica:
        """A replica on ``mesh``, this process' devices: its runner (weights placed, pool allocated), scheduler and
        drafter."""
        c = self.config
        runner = ModelRunner(
            self.model.config,
            self.model.params,
            c.cache_config(),
            self.scheduler_config,
            c.attention_impl,
            c.matmul_dtype,
            mesh,
            quantization=c.quantization,
            one_token_buckets=False if c.data_parallel_size > 1 else None,
            expert_parallel=c.enable_expert_parallel,
        )
        drafter = self.draft and DraftProposer(
            ModelRunner, self.draft, runner.num_pages, c.page_size, self.scheduler_config, mesh, c.attention_impl
        )
        return Replica(runner, self._scheduler(runner.num_pages), drafter)

    def remote(self, link: GroupLink, index: int, num_pages: int) -> Replica:
        """Process 0's stand-in for replica ``index`` of the group behind ``link``: its scheduler runs here, its
        steps there. ``num_pages``: every pool is the smallest any replica holds."""
        runner = RemoteRunner(link, index, num_pages)
        return Replica(runner, self._scheduler(runner.num_pages))
