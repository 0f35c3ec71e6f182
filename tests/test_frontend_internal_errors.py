"""The user's errors and tk_mlir's own bugs, told apart.

An exception from the user's Python run at compile time (a helper they wrote,
an operator on their constexprs, a builtin called with the wrong arguments)
is a CompilationError at their line. One raised inside tk_mlir (a builtin, a
pass, the lowering) is an InternalCompilerError naming the kernel and the
stage, chained to the original; a failing pass saves the IR before it and
says how to replay the pass. TK_MLIR_DEBUG=1 keeps the user's original
traceback too.
"""
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import test_errors
import tk_mlir as tk
from tk_mlir import compiler, f32
from tk_mlir.dialects import types as T
from tk_mlir.errors import InternalCompilerError, raised_in_tk_mlir
from tk_mlir.lowering import pipeline
from test_errors import compile_error

HERE = Path(__file__).resolve()
F32 = tk.spec((64, 64), "f32")
REPO = Path(tk.__file__).resolve().parent.parent


def rows_for(n):
    if n % 16:
        raise ValueError(f"n={n} is not a multiple of 16")
    return n


def outer_helper(n):
    return rows_for(n)


@tk.kernel
def k_helper_raises(X: tk.gl[f32], N: tk.constexpr):
    x = tk.load(X, (0, 0), (rows_for(N), 64))  # E:helper
    tk.store(X, x, (0, 0))


@tk.kernel
def k_nested_helper_raises(X: tk.gl[f32], N: tk.constexpr):
    r = outer_helper(N)  # E:nested-helper


@tk.kernel
def k_constexpr_type_error(X: tk.gl[f32], N: tk.constexpr):
    r = N + "rows"  # E:constexpr-op


@tk.kernel
def k_builtin_arity(X: tk.gl[f32]):
    x = tk.zeros()  # E:arity


@tk.kernel
def k_builtin_extra_arg(X: tk.gl[f32]):
    x = tk.load(X, (0, 0), (16, 64), 1, 2, 3)  # E:extra


@tk.kernel
def k_zeros(X: tk.gl[tk.bf16]):
    x = tk.zeros((16, 64))  # E:zeros
    tk.store(X, x.to(tk.bf16), (0, 0))


def check_error(e, marker, at, message):
    test_errors.check_error(e, marker, at, message, HERE)


@pytest.fixture
def raised(monkeypatch):
    """What compile_specialization raised, before kernel.py's public entry
    shapes it for the user (its traceback policy is kernel.py's)."""
    seen = []
    real = compiler.compile_specialization

    def spy(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except Exception as e:
            seen.append(e)
            raise
    monkeypatch.setattr(compiler, "compile_specialization", spy)
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    monkeypatch.delenv("TK_MLIR_DEBUG", raising=False)
    return seen


# ------------------------------------------------------------ the user's

def test_user_helper_raising_is_a_compile_error_at_the_call(raised):
    check_error(compile_error(k_helper_raises, F32, N=24), "helper", "rows_for(N)",
                "ValueError: n=24 is not a multiple of 16")
    (inner,) = raised
    assert isinstance(inner, tk.CompilationError) and inner.__cause__ is None


def test_user_helper_raising_deeper_is_at_the_kernel_line():
    check_error(compile_error(k_nested_helper_raises, F32, N=8), "nested-helper",
                "outer_helper(N)", "ValueError: n=8 is not a multiple of 16")


def test_constexpr_arithmetic_error_is_the_users():
    check_error(compile_error(k_constexpr_type_error, F32, N=8), "constexpr-op", 'N + "rows"',
                "TypeError: unsupported operand type(s) for +: 'int' and 'str'")


def test_builtin_called_with_missing_arguments():
    check_error(compile_error(k_builtin_arity, F32), "arity", "tk.zeros()",
                "TypeError: zeros() missing 1 required positional argument: 'shape'")


def test_builtin_called_with_too_many_arguments():
    e = compile_error(k_builtin_extra_arg, F32)
    check_error(e, "extra", "tk.load", "TypeError: load() takes")


def test_debug_keeps_the_users_traceback(raised, monkeypatch):
    monkeypatch.setenv("TK_MLIR_DEBUG", "1")
    with pytest.raises(tk.CompilationError):
        k_helper_raises.compile(F32, N=24)
    (inner,) = raised
    assert isinstance(inner.__cause__, ValueError)
    frames = [f.name for f in traceback.extract_tb(inner.__cause__.__traceback__)]
    assert frames[-1] == "rows_for", frames


# ------------------------------------------------------------ tk_mlir's

def test_bug_in_a_builtin_is_an_internal_error(raised, monkeypatch):
    # Simulated: the dtype table loses an entry, so tk.zeros' own code raises
    # KeyError inside dialects/types.py (as `tk.spec(..., "f64")` once did).
    # (A copy without it: deleting and restoring the entry would reorder the table.)
    monkeypatch.setattr(T, "TILE_DTYPES", {k: v for k, v in T.TILE_DTYPES.items() if k != "f32"})
    with pytest.raises(InternalCompilerError) as info:
        k_zeros.compile(tk.spec((64, 64), "bf16"))
    e = info.value
    assert not isinstance(e, tk.CompilationError)
    assert (e.kernel, e.stage) == ("k_zeros", "frontend")
    line, text = test_errors.marked("zeros", HERE)
    assert f"KeyError: 'f32' (compiling {HERE}:{line}:{text.index('tk.zeros') + 1})" in str(e)
    assert str(e).startswith("internal compiler error in kernel k_zeros during frontend")
    assert isinstance(e.__cause__, KeyError)
    innermost = traceback.extract_tb(e.__cause__.__traceback__)[-1]
    assert Path(innermost.filename).name == "types.py"


def test_bug_in_a_pass_is_an_internal_error_that_says_how_to_replay(raised, monkeypatch,
                                                                    tmp_path):
    def broken(module):
        raise KeyError("scratch_offset")
    passes = tuple((n, broken if n == "tk-allocate-smem" else f) for n, f in pipeline.TK_PASSES)
    monkeypatch.setattr(pipeline, "TK_PASSES", passes)
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(tmp_path))
    with pytest.raises(InternalCompilerError) as info:
        k_zeros.compile(tk.spec((64, 64), "bf16"))
    e = info.value
    assert (e.kernel, e.stage) == ("k_zeros", "tk-allocate-smem")
    assert isinstance(e.__cause__, KeyError)
    saved = tmp_path / "before-tk-allocate-smem.mlir"
    assert f"the IR before tk-allocate-smem is in {saved}" in str(e)
    command = f"python -m tk_mlir.lowering.pipeline 'tk-allocate-smem' {saved}"
    assert command in str(e)
    # The saved IR is the stage before, and the command replays the (real) pass on it.
    proc = subprocess.run([sys.executable, "-m", "tk_mlir.lowering.pipeline",
                           "tk-allocate-smem", str(saved)], capture_output=True, text=True,
                          cwd=REPO, env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tk.smem_bytes" in proc.stdout and "tk.smem_bytes" not in saved.read_text()


def test_bug_in_an_upstream_pass_is_an_internal_error(raised, monkeypatch):
    monkeypatch.setattr(pipeline, "GPU_STAGE_NAMES",
                        pipeline.GPU_STAGE_NAMES[:2] + ("no-such-pass",))
    with pytest.raises(InternalCompilerError) as info:
        k_zeros.compile(tk.spec((64, 64), "bf16"))
    assert info.value.stage == "no-such-pass"
    assert "reproduce with" in str(info.value)


def test_ptxas_rejecting_our_ptx_is_an_internal_error(raised, monkeypatch):
    real = pipeline._extract_ptx
    monkeypatch.setattr(pipeline, "_extract_ptx", lambda text: real(text) + "\nnot ptx;\n")
    with pytest.raises(InternalCompilerError) as info:
        k_zeros.compile(tk.spec((64, 64), "bf16"))
    assert info.value.stage == "ptxas"
    assert "reproduce with: ptxas -arch=sm_90a" in str(info.value)


def test_who_raised():
    """The rule itself: the innermost frame that is tk_mlir's or the user's
    decides, looking through the standard library and MLIR."""
    def user():
        import json
        json.loads("{")                 # raises inside the standard library
    with pytest.raises(ValueError) as info:
        user()
    assert not raised_in_tk_mlir(info.value.__traceback__)
    with pytest.raises(KeyError) as info:
        T.itemsize("f64")               # raises in tk_mlir's own code
    assert raised_in_tk_mlir(info.value.__traceback__)
