"""example_modules/notebook.ipynb runs top to bottom in a real Jupyter kernel: ZeRO stage 3 on 2 CPU processes forked
from the kernel, with the trained weights back in the notebook's model afterwards."""

from __future__ import annotations

import math
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.launch import RENDEZVOUS

pytestmark = pytest.mark.slow  # every test here launches processes

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "example_modules" / "notebook.ipynb"


def test_notebook_trains_under_zero3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A process group set up earlier in this pytest process leaves its rendezvous variables behind; the kernel
    # inherits the environment, and Lightning would take them for an external launcher's.
    for name in RENDEZVOUS:
        monkeypatch.delenv(name, raising=False)
    # The kernel computes on 2 threads before forking (the notebook scores the untrained model), as Lightning's
    # `OMP_NUM_THREADS` left behind by earlier tests would make it: forked ranks must still not hang in GNU OpenMP.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    resources = {"metadata": {"path": str(tmp_path)}}  # the kernel's working directory
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources=resources).execute()

    printed = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    losses = re.search(r"^val_loss before=(\S+) after=(\S+)$", printed, re.MULTILINE)
    assert losses is not None, printed[-3000:]
    before, after = float(losses[1]), float(losses[2])
    assert abs(before - math.log(256)) < 0.3, f"an untrained model should score near chance, ln(256): {before}"
    assert after < 3.0, f"val_loss fell only from {before} to {after}: the trained weights did not come back"
    table = notebook.cells[-1].outputs[0]["data"]["text/markdown"]
    assert table.splitlines()[2].startswith("| `ddp` |"), table
