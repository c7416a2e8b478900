"""Every notebook in notebooks/ runs top to bottom and draws its pictures (their cells assert what they show), and
is committed without outputs."""

import re
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="executing notebooks needs nbformat (dev extra)")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_committed_clean(path):
    """Outputs are stripped from git: no outputs, no execution counts, valid nbformat."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(_code_cells(nb)) if c.get("outputs") or c.get("execution_count") is not None]
    assert not dirty, f"{path.name}: code cells {dirty} have outputs or execution counts; clear them before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs(path):
    nbclient = pytest.importorskip("nbclient", reason="executing notebooks needs nbclient + ipykernel (dev extra)")
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    try:
        nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        ).execute()
    except nbclient.exceptions.CellExecutionError as e:  # the failing cell's source and traceback
        message = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # IPython's coloured traceback, uncoloured
        pytest.fail(f"{path.name} failed after {time.perf_counter() - t0:.0f}s:\n{message}", pytrace=False)
    print(f"{path.name}: {time.perf_counter() - t0:.1f}s")
    outputs = [o for c in _code_cells(nb) for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    images = [
        o for o in outputs if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {})
    ]
    assert images, f"{path.name} drew no picture (no image/png output)"
