"""The README's first command runs examples/quickstart.py: on any machine it
compiles the softmax and prints its tk IR (short form), one Python line
followed down to PTX, and the kernel summary, then runs the kernel and checks
it against torch: on a GPU, or without one in the CPU interpreter, saying
which."""
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_quickstart_prints_the_stages_it_promises():
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "16 │   %4 = tk.exp %3 : rt<f32, 4x512>" in out            # short tk IR, gutter
    assert "quickstart.py:16: e = x.sub_row(x.row_max()).exp()" in out  # a line followed
    assert "--- summary ---\n" in out
    last = out.rstrip().splitlines()[-1]
    import torch
    where = "ran on .*" if torch.cuda.is_available() else \
        re.escape("No CUDA GPU here: ran in the CPU interpreter (softmax.interpret)")
    assert re.fullmatch(where + r": relative error vs torch.softmax = \d\.\d\de-\d\d", last), last
