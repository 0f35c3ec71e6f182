"""A user's helper module, called from kernels in other test files (its ops
keep this file's lines: tests/test_short_form.py)."""
import tk_mlir as tk


@tk.func
def scaled_exp(x, s):
    return (x * s).exp()
