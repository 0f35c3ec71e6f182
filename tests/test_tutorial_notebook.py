"""notebooks/tutorial.ipynb runs top to bottom (CI: without a GPU, its run
cell uses the CPU interpreter and its benchmark cells say so and skip), every
cell has an id, and what it stores stays small enough to commit."""
import json
import re
import warnings
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("torch")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "tutorial.ipynb"


@pytest.fixture(scope="module")
def executed():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    return nb


def _outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def test_runs_without_errors(executed):
    errors = [f"{o.ename}: {o.evalue}" for o in _outputs(executed) if o.output_type == "error"]
    assert errors == []


def test_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.outputs for c in nb.cells if c.cell_type == "code")


def test_every_cell_has_an_id():
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # nbformat's MissingIDFieldWarning
        nb = nbformat.read(NOTEBOOK, as_version=4)
        nbformat.validate(nb)
    ids = [c.get("id") for c in nb.cells]
    assert all(ids) and len(set(ids)) == len(ids)
    assert json.loads(NOTEBOOK.read_text())["nbformat_minor"] >= 5     # ids need 4.5


def test_the_kernel_runs_on_the_gpu_or_in_the_interpreter(executed):
    import torch
    text = "".join(o.get("text", "") for o in _outputs(executed) if o.output_type == "stream")
    where = "on .*" if torch.cuda.is_available() else "in the CPU interpreter"
    run = re.search(rf"^ran ({where}): max error vs torch.softmax (\S+)$", text, re.M)
    assert run and float(run.group(2)) < 1e-5


def test_display_and_whole_notebook_stay_small(executed):
    pages = [o.data["text/html"] for o in _outputs(executed)
             if "data" in o and "text/html" in o.data and "tk-mlir-stages" in o.data["text/html"]]
    assert pages and len(pages[0].encode()) <= 200_000           # the kernel's display
    assert len(json.dumps(nbformat.from_dict(executed)).encode()) <= 1_000_000


def test_tile_size_changes_the_summary(executed):
    text = "".join(o.get("text", "") for o in _outputs(executed) if o.output_type == "stream")
    lines = [l for l in text.splitlines() if l.startswith("ROWS=")]
    registers = [int(l.split(":")[1].split()[0]) for l in lines]
    assert len(registers) == 4 and registers == sorted(registers) and registers[0] < registers[-1]


def test_benchmark_cells_say_they_skip_without_a_gpu(executed):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the cells ran")
    text = "".join(o.get("text", "") for o in _outputs(executed) if o.output_type == "stream")
    assert text.count("No CUDA GPU here: skipped") == 2


def test_a_python_line_is_followed_to_ptx_and_sass(executed):
    text = "".join(o.get("text", "") for o in _outputs(executed) if o.output_type == "stream")
    assert ".exp()" in text and "ex2.approx" in text
    from tk_mlir.toolchain import find_tool
    if find_tool("nvdisasm"):                     # SASS needs nvdisasm (the CUDA tools from PyPI)
        assert "MUFU.EX2" in text
