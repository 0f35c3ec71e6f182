"""`pytest -q` ends with one line saying why tests skipped, reasons grouped
and counted, most common first (tests/conftest.py's pytest_terminal_summary).
Checked on a small test file run by a child pytest with this conftest."""
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parent / "conftest.py"
SAMPLE = '''
import pytest

@pytest.mark.gpu
def test_gpu_a(): pass

@pytest.mark.gpu
def test_gpu_b(): pass

@pytest.mark.gpu
def test_gpu_c(): pass

@pytest.mark.parametrize("i", [1, 2])
def test_browser(i):
    pytest.skip("need chromium")

def test_module():
    pytest.importorskip("tk_mlir_no_such_module")

def test_runs(): pass
'''


def run(tmp_path: Path, sample: str) -> str:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(sample)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers = gpu: needs a GPU\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "test_sample.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_skips_are_summed_up_by_reason(tmp_path):
    from tk_mlir.runtime.driver import has_gpu
    lines = run(tmp_path, SAMPLE).splitlines()
    summary = [l for l in lines if l.startswith("skipped: ")]
    gpu = [] if has_gpu() else ["3 need a CUDA GPU (gpu marker)"]
    assert summary == ["skipped: " + ", ".join(
        gpu + ["2 need chromium", "1 could not import 'tk_mlir_no_such_module': "
                                  "No module named 'tk_mlir_no_such_module'"])]


def test_many_reasons_end_in_a_count(tmp_path):
    sample = "import pytest\n" + "".join(
        f"def test_{i}():\n    pytest.skip('reason {i}')\n" for i in range(8))
    (summary,) = [l for l in run(tmp_path, sample).splitlines() if l.startswith("skipped: ")]
    assert summary.startswith("skipped: 1 reason 0, 1 reason 1, ")
    assert summary.endswith(", 1 reason 5, 2 for 2 other reasons (-rs lists them)")


def test_no_skips_no_line(tmp_path):
    out = run(tmp_path, "def test_ok(): pass\n")
    assert "skipped" not in out
