"""Shared fixtures. Tests run on the CPU, on JAXSERVE_TEST_DEVICES fake CPU devices (default 8); the tests that need
a mesh of several are marked ``multidevice`` and fail, named, on fewer than MULTIDEVICE_DEVICES."""

from __future__ import annotations

import os
import sys

# helpers.py, shared by the test modules, and each room's folder of tests (tests/<room>/ mirrors jaxserve/<room>/):
# a test module may import another's fixtures or references by name (pytest imports test modules by path).
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS] + sorted(
    entry.path for entry in os.scandir(_TESTS) if entry.is_dir() and not entry.name.startswith((".", "_"))
)

# Before jax is imported anywhere: JAXSERVE_TEST_DEVICES fake CPU devices (default 8, what the tests marked
# multidevice need: a mesh over several, tensor / data / expert / pipeline parallelism up to 8), float32 matmuls.
# XLA keeps a pool thread per fake device: on a worker's one core a decode step took ~20-25% longer with 8 devices
# than with 1, so ``make test`` runs the tests not marked multidevice with JAXSERVE_TEST_DEVICES=1 and the marked
# ones apart with 8. The processes the tests start (servers, docs blocks, notebooks) inherit XLA_FLAGS, so they see
# as many. A user's own XLA_FLAGS wins.
MULTIDEVICE_DEVICES = 8
TEST_DEVICES = int(os.environ.get("JAXSERVE_TEST_DEVICES") or MULTIDEVICE_DEVICES)
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={TEST_DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# NumPy asks for transparent huge pages for arrays of 4 MiB and more. On a VM whose host backs them slowly (the CI's
# kind: Firecracker with free-page reporting) the first touch of 512 MiB took 8.2 s that way and 0.5 s in 4 KiB pages,
# and loading the default model 9.5 s instead of 2.3. Tests, and every process they start, ask for small pages.
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")


def _pin_xdist_worker() -> None:
    """Each pytest-xdist worker on its own share of the CPUs (gw0 the first, gw1 the second, ...), and every process
    it starts too (affinity is inherited). Unpinned, two workers' XLA, C++ and torch threads contend for the same
    cores: two engines generating side by side on the 2-core VM took 29.7 s unpinned and 22.5 s pinned one core each.
    XLA's intra-op pool keeps a thread per fake device on that core: eight by default, one with
    JAXSERVE_TEST_DEVICES=1 (``make test``'s first phase).
    JAXSERVE_TEST_PIN=0 turns it off."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not (worker and count and hasattr(os, "sched_setaffinity")) or os.environ.get("JAXSERVE_TEST_PIN") == "0":
        return
    cpus, workers = sorted(os.sched_getaffinity(0)), int(count)
    if workers > 1 and len(cpus) >= workers:
        os.sched_setaffinity(0, cpus[int(worker.removeprefix("gw")) % workers :: workers])


_pin_xdist_worker()  # before jax (XLA sizes its pools from the affinity) and torch start threads

import gc  # noqa: E402

import pytest  # noqa: E402

# ``make test-fast`` (``-m fast``, on one device, under 5 minutes): host logic, kernels against their references,
# tokenizers and GGUF parsing, the server's contract on a fake engine (the tests of these files not marked slow), and
# one end-to-end generation on the default model against HF transformers.
FAST_FILES = {
    "test_scheduler.py",
    "test_block_manager.py",
    "test_kv_events.py",
    "test_layout.py",
    "test_server_fake_engine.py",
    "test_sampling.py",
    "test_tokenizer.py",
    "test_kernels.py",
    "test_attention_xla.py",
    "test_gguf.py",
    "test_deploy.py",
    "test_wire.py",
    "test_pipeline.py",
}
FAST_TESTS = {"test_default_model.py::test_greedy_matches_hf_token_for_token"}


# The heaviest files first (seconds of worker time in a whole run, heaviest first), so that two workers taking whole
# files (``--dist loadfile``) end together instead of one running a long file alone at the end; the rest follow
# in their own order.
HEAVY_FILES = [
    "test_notebooks.py",
    "test_quant.py",
    "test_docs.py",
    "test_multiprocess.py",
    "test_aot.py",
    "test_speculative.py",
    "test_moe_models.py",
    "test_tpu_kernels_aot.py",
    "test_sharding.py",
    "test_engine.py",
    "test_deepseek.py",
    "test_structured.py",
    "test_pipeline_engine.py",
    "test_kernels.py",
    "test_moe.py",
    "test_server_tools.py",
    "test_reliability.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
    for item in items:
        name = item.path.name
        fast_file = name in FAST_FILES and item.get_closest_marker("slow") is None
        if fast_file or f"{name}::{item.originalname}" in FAST_TESTS:
            item.add_marker(pytest.mark.fast)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test marked ``multidevice`` on fewer than MULTIDEVICE_DEVICES devices fails here, before its fixtures build
    anything, naming what it needs (a skip would hide it: ``make test``'s first phase runs on one device)."""
    if item.get_closest_marker("multidevice") is None:
        return
    import jax  # after the environment above: XLA_FLAGS is read when jax starts its CPU client

    if (count := jax.device_count()) < MULTIDEVICE_DEVICES:
        pytest.fail(
            f"{item.nodeid} is marked multidevice: it needs {MULTIDEVICE_DEVICES} fake CPU devices and this process "
            f"has {count} (JAXSERVE_TEST_DEVICES={os.environ.get('JAXSERVE_TEST_DEVICES', '')!r}, "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}). Run it with JAXSERVE_TEST_DEVICES unset or "
            f"{MULTIDEVICE_DEVICES} (make test's second phase), or deselect it with -m 'not multidevice'.",
            pytrace=False,
        )


def _worker_load() -> tuple[int, int]:
    """(resident bytes, memory mappings) of this process; (0, 0) where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
    except (OSError, ValueError):
        return 0, 0
    return rss, maps


# Past either, a module's end drops JAX's compiled programs (see _free_dropped_engines).
CLEAR_CACHES_RSS = 6 << 30
CLEAR_CACHES_MAPS = 30_000


@pytest.fixture(autouse=True, scope="module")
def _free_dropped_engines():
    """After each module the cycle collector frees the engines the tests dropped (they hold reference cycles) and
    glibc hands the freed heap back to the system. JAX's caches (every compiled step, the shared engines' too) are
    dropped only once this worker holds more than CLEAR_CACHES_RSS bytes or CLEAR_CACHES_MAPS memory mappings: each
    compiled step keeps ~350 mappings on XLA:CPU and a process may have 65,530, and ``make test``'s two workers
    peaked at ~21-22 of 24 GiB when no module dropped them. Dropping them after every module cost ~7 minutes of
    recompiles (from the persistent cache) a run."""
    yield
    _collect()
    rss, maps = _worker_load()
    if "jax" in sys.modules and (rss > CLEAR_CACHES_RSS or maps > CLEAR_CACHES_MAPS):
        sys.modules["jax"].clear_caches()
        _collect()


def _collect():
    gc.collect()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


@pytest.fixture(scope="session")
def default_model_path():
    from jaxserve.defaults import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_llm(default_loaded):
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in float32, shared by the session."""
    from helpers import DEFAULT_ENGINE

    from jaxserve import LLM

    return LLM(default_loaded, **DEFAULT_ENGINE)


@pytest.fixture(scope="session")
def hf_default(default_model_path, tmp_path_factory):
    """HF transformers' implementation loading the same GGUF file: our reference.

    Reading and dequantizing the GGUF takes transformers ~28 s, so the first worker of a run to need it saves what it
    loaded (its config and float32 state dict: transformers will not ``save_pretrained`` a model read from a GGUF)
    in the run's shared temporary folder, and the other workers build the same model from that copy."""
    import fcntl

    torch = pytest.importorskip("torch", reason="HF reference needs torch (pip install torch==2.13.0)")
    transformers = pytest.importorskip("transformers", reason="the reference implementation is HF transformers")
    # As many threads as this process may use: one on a pinned xdist worker (see _pin_xdist_worker).
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
    base = tmp_path_factory.getbasetemp()  # under xdist, each worker's; their parent is this run's (pytest-N)
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "hf-default"
    with open(str(shared) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (shared / "weights.pt").exists():
            config = transformers.AutoConfig.from_pretrained(str(shared))
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(torch.load(shared / "weights.pt", weights_only=True))
            return model.eval()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
        ).eval()
        model.config.save_pretrained(str(shared))
        torch.save(model.state_dict(), shared / "weights.pt")
    return model


@pytest.fixture(scope="session")
def default_loaded(default_model_path):
    """The default model's weights in host memory, loaded once; engines built from it skip reloading."""
    from jaxserve.loading import load_model

    return load_model(default_model_path, "float32")
