"""The host side (scheduler, block manager, requests, sampling parameters) must not import jax."""

import subprocess
import sys


def test_host_modules_import_no_jax():
    code = (
        "import sys, jaxserve.scheduler, jaxserve.block_manager, jaxserve.request, jaxserve.sampling_params; "
        "from jaxserve import SamplingParams; "
        "bad = [m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
