"""Recursion in a kernel is unrolled at compile time: it works when it ends on
compile-time values and is refused at the recursive call's line, naming the
function, when it cannot end (a run-time count) or nests too deep."""
from pathlib import Path

import pytest

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.frontend import MAX_INLINE_DEPTH
import test_errors
from test_errors import compile_error

HERE = Path(__file__).resolve()
F32 = tk.spec((64, 64), "f32")


@tk.kernel
def k_runtime_count(X: tk.gl[f32]):
    def f(t, n):
        return t if n == 0 else f(t * 2.0, n - 1)  # E:rt-rec
    n = tk.block_id(0)
    tk.store(X, f(tk.load(X, (0, 0), (16, 64)), n), (0, 0))


@tk.kernel
def k_compile_time_count(X: tk.gl[f32], D: tk.constexpr):
    def f(t, n):
        return t if n == 0 else f(t * 2.0, n - 1)  # E:ct-rec
    tk.store(X, f(tk.load(X, (0, 0), (16, 64)), D), (0, 0))


@tk.func
def doubled(t, n):
    return t if n == 0 else doubled(t * 2.0, n - 1)  # E:func-rec


@tk.kernel
def k_func_runtime_count(X: tk.gl[f32], n: int):
    tk.store(X, doubled(tk.load(X, (0, 0), (16, 64)), n), (0, 0))


@tk.kernel
def k_func_compile_time_count(X: tk.gl[f32], D: tk.constexpr):
    tk.store(X, doubled(tk.load(X, (0, 0), (16, 64)), D), (0, 0))


@tk.kernel
def k_no_progress(X: tk.gl[f32], D: tk.constexpr):
    def g(n):
        return g(n)  # E:same-args
    g(D)


@tk.kernel
def k_mutual(X: tk.gl[f32]):
    def even(n):
        return True if n == 0 else odd(n - 1)
    def odd(n):
        return False if n == 0 else even(n - 1)  # E:mutual
    b = even(tk.block_id(0))


def check_error(e, marker, at, message):
    test_errors.check_error(e, marker, at, message, HERE)


def test_runtime_recursion_is_refused_at_the_call():
    check_error(compile_error(k_runtime_count, F32), "rt-rec", "f(t * 2.0",
                "f calls itself with a run-time argument (n) and otherwise the same "
                "arguments; recursion is unrolled at compile time only when it ends on "
                "compile-time values")


def test_runtime_recursion_in_a_tk_func():
    # A run-time conditional builds both sides, so the recursive call is reached.
    check_error(compile_error(k_func_runtime_count, F32, 3), "func-rec", "doubled(t",
                "doubled calls itself with a run-time argument (n)")


def test_mutual_runtime_recursion():
    check_error(compile_error(k_mutual, F32), "mutual", "even(n - 1)",
                "even calls itself with a run-time argument (n)")


def test_recursion_without_progress():
    check_error(compile_error(k_no_progress, F32, D=2), "same-args", "g(n)",
                "g calls itself with the same arguments, so the recursion never ends")


def _multiplies(compiled) -> int:
    return compiled.asm["tk"].count('"tk.mul"(')


@pytest.mark.parametrize("kernel", [k_compile_time_count, k_func_compile_time_count])
def test_compile_time_recursion_is_unrolled(kernel):
    muls = [_multiplies(kernel.compile(F32, D=d)) for d in (0, 3, 7)]
    assert muls == [0, 3, 7], muls


def test_recursion_nesting_too_deep():
    kernel_ok = k_compile_time_count.compile(F32, D=MAX_INLINE_DEPTH - 1)
    assert kernel_ok.asm["ptx"]
    e = compile_error(k_compile_time_count, F32, D=MAX_INLINE_DEPTH)
    check_error(e, "ct-rec", "f(t * 2.0", f"calling f here nests inlined calls more than "
                                          f"{MAX_INLINE_DEPTH} deep (... -> f -> f -> f -> f "
                                          f"-> f); recursion is unrolled at compile time")


def test_python_stack_running_out_is_a_compile_error(monkeypatch):
    """Below MAX_INLINE_DEPTH calls, Python's own stack can still run out (here
    made small): a CompilationError at a recursive call, not a RecursionError."""
    import inspect
    import sys
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")      # compile, not a cache hit
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 200)
    try:
        e = compile_error(k_compile_time_count, F32, D=MAX_INLINE_DEPTH - 1)
    finally:
        sys.setrecursionlimit(limit)
    check_error(e, "ct-rec", "f(t * 2.0", "calling f here nests inlined calls deeper than "
                                          "Python's recursion limit")
