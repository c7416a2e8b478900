"""The C++ CPU kernels build on every ISA level users have, and a failed build is reported once, in one line.

Any VM catches an ISA break: each x86-64 level (v2: SSE4.2; v3: AVX2 and F16C, AMD Zen 1-3 and most desktops; v4:
AVX-512) and aarch64 (Debian's ``g++-aarch64-linux-gnu``, which ``.ci/run`` installs) is compiled here with
``-fsyntax-only``: every source as its own translation unit, as the real build compiles them (a symbol one source
defines and another's header uses, the break of a non-AVX-512 build once, fails here whatever the host's CPU).
``common.h`` (the standard headers, the intrinsics and XLA's FFI header: most of each source's parse) is precompiled
once per level and each source checked against it, as g++ does when ``common.h.gch`` lies beside the header:
about 8 s of g++ a level instead of 12.
That the library built for this CPU computes what the jnp references compute is the kernel tests' job
(``test_attention_xla.py``, ``test_quant.py``, ...).
"""

from __future__ import annotations

import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from jaxserve.kernels.cpu import ffi

X86_LEVELS = ["x86-64-v2", "x86-64-v3", "x86-64-v4"]


def _syntax_check(cxx: str, march: str | None, folder: Path) -> None:
    cmd = ffi.compile_command(cxx, None, march=march, syntax_only=True)
    if march == "x86-64-v4":  # and VNNI (Ice Lake and later, Zen 4): w8a8.cc's int8 products, not in v4 itself
        cmd.insert(1, "-mavx512vnni")
    # Copies of the sources and headers in ``folder``, beside common.h.gch: common.h precompiled with the very flags
    # of the check (a precompiled header serves only the flags it was made with; -Winvalid-pch says so otherwise).
    sources = [Path(arg) for arg in cmd if arg.endswith(".cc")]
    flags = [arg for arg in cmd[1:] if not arg.endswith(".cc")]
    for path in [*sources, *Path(sources[0]).parent.glob("*.h")]:
        shutil.copy(path, folder)
    pch = folder / "common.h.gch"
    header = [cmd[0], *(f for f in flags if f != "-fsyntax-only"), "-x", "c++-header", str(folder / "common.h")]
    check = [cmd[0], *flags, "-Winvalid-pch", *(str(folder / path.name) for path in sources)]
    try:
        for argv in (header + ["-o", str(pch)], check):
            result = subprocess.run(argv, capture_output=True, text=True, check=False)
            assert result.returncode == 0, (
                f"{' '.join(argv)}:\n{ffi.first_error(result.stderr)}\n{result.stderr[-4000:]}"
            )
        assert "Winvalid-pch" not in result.stderr, result.stderr[-4000:]  # the precompiled header was used
    finally:
        pch.unlink(missing_ok=True)  # ~100 MB a level


@pytest.mark.parametrize("march", X86_LEVELS)
def test_the_kernels_compile_for_each_x86_64_level(march, tmp_path):
    cxx = "g++" if platform.machine() in ("x86_64", "AMD64") else "x86_64-linux-gnu-g++"
    if shutil.which(cxx) is None:
        pytest.skip(f"{cxx} is not installed (an x86-64 cross compiler on this {platform.machine()} host)")
    _syntax_check(cxx, march, tmp_path)


def test_the_kernels_compile_for_aarch64(tmp_path):
    cxx = "g++" if platform.machine() in ("aarch64", "arm64") else "aarch64-linux-gnu-g++"
    if shutil.which(cxx) is None:
        pytest.skip(f"{cxx} is not installed (Debian: apt-get install g++-aarch64-linux-gnu; .ci/run installs it)")
    _syntax_check(cxx, None, tmp_path)  # the compiler's default armv8-a: NEON, no x86 intrinsics


# ------------------------------------------------------------------------------------------ a failed build
FAKE_CXX = """#!/bin/sh
echo run >> "{count}"
for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
  echo "common.h:39:33: warning: AVX512F vector return without AVX512F enabled changes the ABI [-Wpsabi]" >&2
done
echo "quantized.h:33:18: error: no matching function for call to 'LoadKV16(const int8_t*&)'" >&2
for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40; do
  echo "attention.cc:372:18: warning: ignoring attributes on template argument 'I16' [-Wignored-attributes]" >&2
done
exit 1
"""


def test_a_failed_build_is_reported_in_one_line_with_the_first_error_and_not_rerun(tmp_path, monkeypatch):
    count = tmp_path / "runs"
    cxx = tmp_path / "fake-g++"
    cxx.write_text(FAKE_CXX.format(count=count))
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    messages = []
    for _ in range(3):  # three processes' first use: one compiler run, the same report each time
        with pytest.raises(ffi.BuildError) as err:
            ffi._build()
        messages.append(str(err.value))
    assert count.read_text().splitlines() == ["run"], "a failed build must not be run again"
    message = messages[0]
    assert messages == [message] * 3
    assert "\n" not in message
    assert "quantized.h:33:18: error: no matching function for call to 'LoadKV16(const int8_t*&)'" in message
    assert "-march=native" in message and "JAXSERVE_FFI_MARCH" in message
    log = err.value.log
    assert log.is_file() and "error: no matching function" in log.read_text()  # the whole output kept
    assert str(log) in message
    os.remove(log)  # deleting the log retries the build
    with pytest.raises(ffi.BuildError):
        ffi._build()
    assert count.read_text().splitlines() == ["run", "run"]


def test_the_kernels_can_be_turned_off(tmp_path):
    """JAXSERVE_CPU_KERNELS=0: the XLA path, said once, with nothing built."""
    env = dict(os.environ, JAXSERVE_CPU_KERNELS="0", JAXSERVE_CACHE_DIR=str(tmp_path))
    code = "from jaxserve.kernels.cpu import ffi; print(ffi.available(), ffi.unavailable_reason())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "False disabled by JAXSERVE_CPU_KERNELS=0"
    assert not Path(tmp_path, "ffi").exists()
