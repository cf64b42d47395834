"""examples/notebook_fashion_mnist.ipynb executed headless (nbclient, a real ipykernel), as a
short version: 1 epoch on a subset of FashionMNIST, set through the notebook's parameter
variables. The full run (4 epochs, >= 89 % test accuracy, checked by the notebook's last cell)
is run by hand: see docs/python.md. Skipped when torch or nbclient is not installed;
LOCKSTEP_REQUIRE_TORCH=1 makes that a failure."""

import os
import re

import pytest

from conftest import require_or_skip

try:
    import torch  # noqa: F401
except ImportError:
    require_or_skip("torch", "pip install torch")
try:
    import nbclient
    import nbformat
except ImportError:
    require_or_skip("nbclient", "pip install nbclient nbformat ipykernel")

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "notebook_fashion_mnist.ipynb")
DATA = os.environ.get("LOCKSTEP_NB_DATA", "/usr/share/datasets/fashion-mnist")


def test_notebook_runs_headless(monkeypatch, tmp_path):
    if not os.path.exists(os.path.join(DATA, "t10k-labels-idx1-ubyte.gz")):
        pytest.skip(f"skipped: FashionMNIST not found in {DATA} (apt-get install dataset-fashion-mnist)")
    # The kernel inherits this environment: 10 steps of 2 ranks x 64 images, 1000 test images.
    monkeypatch.setenv("LOCKSTEP_NB_EPOCHS", "1")
    monkeypatch.setenv("LOCKSTEP_NB_TRAIN_SAMPLES", "1280")
    monkeypatch.setenv("LOCKSTEP_NB_TEST_SAMPLES", "1000")
    monkeypatch.setenv("LOCKSTEP_NB_DATA", DATA)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Raises CellExecutionError (with the cell's traceback) when any cell fails, the notebook's
    # own checks included.
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    def text(cell):
        return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")

    launch = next(c for c in nb.cells if c.cell_type == "code" and "notebook_launcher(" in c.source)
    out = text(launch)
    # Per-step loss lines from both ranks, prefixed, and the accuracy of the gathered counts.
    for r in (0, 1):
        assert re.search(rf"\[rank {r}\] cpu:{r} Train\.\.\. \[epoch 1/1, step 10/10\]\s+\[loss \d+\.\d+\]", out), out
    m = re.search(r"\[rank 0\] epoch 1/1, accuracy = (\d+\.\d+) % \((\d+)/1000 test images\)", out)
    assert m, out
    # Well above chance (10 %) after 10 steps; the counts cover each test image exactly once.
    assert float(m.group(1)) > 25.0, out
    assert re.search(r"final test accuracy \d+\.\d+ % after 1 epochs", out), out
