"""Every notebook in notebooks/ runs top to bottom (their cells assert what they show)."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="executing notebooks needs nbformat (dev extra)")
nbclient = pytest.importorskip("nbclient", reason="executing notebooks needs nbclient + ipykernel (dev extra)")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
                            ).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
