"""The host side (scheduler, block manager, requests, sampling parameters, the pipeline split) must not import jax."""

import subprocess
import sys


def test_host_modules_import_no_jax():
    code = (
        "import sys, jaxserve.core.sched.async_scheduler, jaxserve.core.block_manager, jaxserve.core.request, jaxserve.core.sampling_params, "
        "jaxserve.parallel.pipeline; "
        "from jaxserve import SamplingParams; "
        "bad = [m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_kernels_import_no_engine_module():
    """``jaxserve.kernels`` (the top-level ``kernels/`` folder) stands alone: no module of it imports a ``jaxserve``
    module outside ``jaxserve.kernels`` (the engine imports the kernels, never the other way)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "kernels"
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"jaxserve.{a.name}" for a in node.names] if node.module == "jaxserve" else [node.module]
            else:
                continue
            for name in names:
                if (name == "jaxserve" or name.startswith("jaxserve.")) and not (
                    name == "jaxserve.kernels" or name.startswith("jaxserve.kernels.")
                ):
                    bad.append(f"{path.relative_to(root.parent)}:{node.lineno}: {name}")
    assert len(list(root.rglob("*.py"))) > 5
    assert not bad, bad


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages by hand (kernels/ installs as jaxserve.kernels): a new subpackage left out
    would import from a checkout (editable install) and be missing from a wheel."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("jaxserve", "jaxserve"), ("kernels", "jaxserve.kernels")):
        for init in (root / top).rglob("__init__.py"):
            rel = init.parent.relative_to(root / top)
            found.add(".".join((name, *rel.parts)))
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
