"""The C++ kernels for the CPU (this folder's ``.cc`` files), built on first use into one shared library and
registered with XLA as FFI targets; each kernel family wraps its own targets (``attention/cpu.py``,
``kv_write/cpu.py``, ``matmul/cpu.py``).

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


def _build() -> Path:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    flags = _FLAGS + (["-march=native"] if os.environ.get("JAXSERVE_FFI_NATIVE", "1") == "1" else [])
    key = hashlib.sha256(
        b"\0".join(
            [
                *(f"{path.name}\0".encode() + path.read_bytes() for path in _SOURCES + _HEADERS),
                jax.ffi.include_dir().encode(),
                cxx.encode(),
                " ".join(flags).encode(),
                jax.__version__.encode(),
                _cpu_id(),
            ]
        )
    ).hexdigest()[:16]
    name = f"jaxserve_cpu_kernels-{key}.so"
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
            cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(tmp_out)]
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
        _error = "the C++ CPU kernels are built for Linux/macOS only"
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
            f"jaxserve: the C++ CPU kernels are unavailable, using the XLA path ({_error})",
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
