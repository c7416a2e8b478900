"""The C++ kernels for the CPU (this folder's ``.cc`` files), built on first use into one shared library and
registered with XLA as FFI targets; each kernel family wraps its own targets (``attention/cpu.py``,
``kv_write/cpu.py``, ``matmul/cpu.py``).

The library is compiled with the system C++ compiler (``$CXX``, else ``g++``/``c++``) against the FFI headers that
ship with jaxlib, for ``-march=$JAXSERVE_FFI_MARCH`` (``native`` by default: the fast paths are chosen per ISA at
compile time, AVX-512 where the CPU has it, AVX2 / generic vectors elsewhere, NEON on aarch64), once per
source/jaxlib/compiler/CPU combination, into ``$JAXSERVE_CACHE_DIR/ffi`` (default ``~/.cache/jaxserve/ffi``). A
failed build is remembered there too and reported in one line, with the compiler's first error, by every later
process (no rebuild per process). ``JAXSERVE_CPU_KERNELS=0`` turns the library off.

``available()`` says whether it could be built and loaded, and ``unavailable_reason()`` says why not. Without it the
public ``ragged_paged_attention(impl="auto" | "xla")`` keeps the jnp/lax blocks (and ``write_kv`` the reference
scatter); only a direct call of the lower-level ``ragged_paged_attention_xla(..., impl="ffi")`` (tests,
``bench/attention_cpu.py``) insists on the C++ kernel and raises with that reason.
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

TARGET = "jaxserve_paged_attention"
INT8_TARGET = "jaxserve_paged_attention_int8"
WRITE_TARGET = "jaxserve_write_kv"
MATMUL_TARGET = "jaxserve_matmul_rows"
QUANT_TARGET = "jaxserve_matmul_quant_rows"
DEQUANT_TARGET = "jaxserve_dequantize"
W8A8_TARGET = "jaxserve_matmul_w8a8_rows"
_FOLDER = Path(__file__).parent
# One translation unit per kernel family, compiled and linked in one invocation of the compiler; their headers.
_SOURCES = sorted(_FOLDER.glob("*.cc"))
_HEADERS = sorted(_FOLDER.glob("*.h"))
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


def target_march() -> str:
    """The ``-march`` the library is built for: ``$JAXSERVE_FFI_MARCH`` (``native`` by default; ``x86-64-v3`` for
    AVX2 machines, ``armv8.2-a``, ...; empty: the compiler's default)."""
    return os.environ.get("JAXSERVE_FFI_MARCH", "native")


def compile_command(cxx: str, out: str | None, *, march: str | None = "native", syntax_only: bool = False) -> list[str]:
    """The compiler's command line for the library (``syntax_only``: every source checked, nothing written, about
    3 s a source instead of 20: what tests/kernels/test_cpu_kernels_build.py runs for each ISA level)."""
    flags = [f for f in _FLAGS if not (syntax_only and f in ("-shared", "-O3"))]
    flags += [f"-march={march}"] if march else []
    flags += ["-fsyntax-only"] if syntax_only else []
    return [cxx, *flags, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), *(["-o", out] if out else [])]


def first_error(log: str) -> str:
    """The compiler's first ``error:`` line (its file and line included), else the log's last non-empty line: what
    the one-line report quotes (the log's tail is warnings more often than not)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in lines:
        if "error:" in ln or "undefined reference" in ln:
            return ln
    return lines[-1] if lines else "no output"


def _build() -> Path:
    """The library's path, built first if this source / compiler / flags / CPU combination was never built. A build
    that failed is remembered beside where the library would be (``<name>.failed``, the compiler's whole output):
    later processes report it at once instead of running the compiler again (delete the file to retry)."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    arch = target_march()
    key = hashlib.sha256(
        b"\0".join(
            [
                *(f"{path.name}\0".encode() + path.read_bytes() for path in _SOURCES + _HEADERS),
                jax.ffi.include_dir().encode(),
                cxx.encode(),
                " ".join(_FLAGS + [arch]).encode(),
                jax.__version__.encode(),
                _cpu_id(),
            ]
        )
    ).hexdigest()[:16]
    name = f"jaxserve_cpu_kernels-{key}.so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "jaxserve-ffi"):  # a read-only home: /tmp
        if (folder / name).is_file():
            return folder / name
        _raise_if_failed(folder / f"{name}.failed")
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
    # a notebook's kernel, ``make``'s early build) waits for that build and loads its library (or its failure).
    with open(folder / f"{name}.lock", "w") as lock:
        _flock(lock)
        if out.is_file():
            return out
        _raise_if_failed(out.with_name(f"{name}.failed"))
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = compile_command(cxx, str(tmp_out), march=arch)
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                failed = out.with_name(f"{name}.failed")
                failed.write_text(f"{' '.join(cmd)}\n{result.stderr}")
                _raise_if_failed(failed)
            os.replace(tmp_out, out)  # atomic: a reader never sees a partial file
    return out


class BuildError(RuntimeError):
    """The library did not build (now or in an earlier process: ``log`` keeps the compiler's output)."""

    def __init__(self, log: Path):
        self.log = log
        cmd, _, output = log.read_text().partition("\n")
        compiler, arch = cmd.split(" ", 1)[0], next((f for f in cmd.split() if f.startswith("-march=")), "")
        super().__init__(
            f"{Path(compiler).name} {arch} failed: {first_error(output)} (the whole log: {log}; delete it to build "
            "again, or set JAXSERVE_FFI_MARCH to another -march)"
        )


def _raise_if_failed(log: Path) -> None:
    if log.is_file():
        raise BuildError(log)


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
        _error = "the C++ CPU kernels are built for Linux/macOS only"
        return False
    if os.environ.get("JAXSERVE_CPU_KERNELS", "1") == "0":
        _error = "disabled by JAXSERVE_CPU_KERNELS=0"
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
            f"jaxserve: the C++ CPU kernels are unavailable ({_error}); the CPU runs the XLA path instead (the same "
            "results, slower steps)",
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


def require(what: str) -> None:
    """Raises RuntimeError naming ``what`` and why the library is unavailable, unless it is available."""
    if not _load():
        raise RuntimeError(f"{what} is unavailable: {_error}")
