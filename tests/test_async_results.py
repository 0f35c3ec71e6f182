"""tk-verify refuses a tk.mma_* result read before the tk.mma_wait that
completes it (passes/async_results.py), at the line of the read; chaining it
into another MMA, carrying it through loops and ifs, and reading it after a
wait that completes it on every path are all accepted."""
from __future__ import annotations

from pathlib import Path

import pytest

import markers
import tk_mlir as tk
from tk_mlir import bf16, f32

HERE = Path(__file__).resolve()


def marked(name: str) -> tuple[int, str]:
    return markers.marked(HERE, name)


def _acc():
    return tk.zeros((64, 64), f32, layout="row", scope="warpgroup")


@tk.func
def _tile():
    return tk.shared_tile(bf16, (64, 64), swizzle=128)


@tk.kernel(num_warps=4)
def store_before_wait(C: tk.gl[f32]):
    a = _tile()
    acc = tk.mma_ABt(_acc(), a, a)  # E:store-mma
    tk.store(C, acc, (0, 0))  # E:store-use
    tk.mma_wait(0)


@tk.kernel(num_warps=4)
def arithmetic_before_wait(C: tk.gl[f32]):
    a = _tile()
    acc = tk.mma_AB(_acc(), a, a)  # E:arith-mma
    acc = acc * 2.0  # E:arith-use
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))


@tk.kernel(num_warps=4)
def wait_one_leaves_the_newest(C: tk.gl[f32]):
    a = _tile()
    acc = tk.mma_AtB(_acc(), a, a)  # E:wait1-mma
    tk.mma_wait(1)
    tk.store(C, acc.to(f32), (0, 0))  # E:wait1-use


@tk.kernel(num_warps=4)
def wait_in_one_branch(C: tk.gl[f32], n: int):
    a = _tile()
    acc = tk.mma_ABt(_acc(), a, a)  # E:branch-mma
    if n > 0:
        tk.mma_wait(0)
    tk.store(C, acc, (0, 0))  # E:branch-use


@tk.kernel(num_warps=4)
def carried_out_of_a_loop(C: tk.gl[f32], n: int):
    a = _tile()
    acc = _acc()
    for i in range(n):
        acc = tk.mma_AtBt(acc, a, a)  # E:loop-mma
        tk.mma_wait(1)
    tk.store(C, acc, (0, 0))  # E:loop-use


@tk.kernel(num_warps=4)
def sliced_before_wait(C: tk.gl[f32]):
    a = _tile()
    acc = tk.mma_ABt(_acc(), a, a)  # E:slice-mma
    tk.mma_wait(0)
    acc = tk.mma_ABt(acc, a, a)
    part = acc.slice(cols=(0, 32))  # E:slice-use
    tk.mma_wait(0)
    tk.store(C, part, (0, 0))


REFUSED = [(store_before_wait, "store", "tk.mma_ABt"),
           (arithmetic_before_wait, "arith", "tk.mma_AB"),
           (wait_one_leaves_the_newest, "wait1", "tk.mma_AtB"),
           (wait_in_one_branch, "branch", "tk.mma_ABt"),
           (carried_out_of_a_loop, "loop", "tk.mma_AtBt"),
           (sliced_before_wait, "slice", "tk.mma_ABt")]


@pytest.mark.parametrize("kernel,case,mma", REFUSED, ids=[r[1] for r in REFUSED])
def test_a_result_read_before_its_wait_is_refused_at_the_read(kernel, case, mma):
    args = [tk.spec((64, 64), "f32")] + ([1] if case in ("branch", "loop") else [])
    with pytest.raises(tk.CompilationError) as info:
        kernel.compile(*args)
    e = info.value
    line, text = marked(f"{case}-use")
    assert Path(e.filename).resolve() == HERE and e.line == line, (e.line, e.message)
    assert text[e.col:].startswith(("tk.store", "acc", "part")), (e.col, text)
    mma_line = marked(f"{case}-mma")[0]
    if case == "slice":       # the second MMA (line after the wait) is the one read early
        mma_line = line - 1
    assert f"the result of {mma} at line {mma_line} is read before tk.mma_wait" in e.message
    assert "Traceback" not in str(e)


@tk.kernel(num_warps=4)
def legal_uses(C: tk.gl[f32], n: int):
    a = _tile()
    acc = tk.mma_ABt(_acc(), a, a)
    acc = tk.mma_ABt(acc, a, a)            # chained as the accumulator: legal
    first = tk.mma_ABt(_acc(), a, a)
    second = tk.mma_ABt(_acc(), a, a)
    tk.mma_wait(1)                         # completes all but `second`
    tk.store(C, first, (0, 0))
    for i in range(n):                     # carried through a loop, waited inside
        acc = tk.mma_ABt(acc, a, a)
        tk.mma_wait(1)
        if i > 2:
            acc = tk.mma_ABt(acc, a, a)
    if n > 0:
        tk.mma_wait(0)
    else:
        tk.mma_wait(0)
    tk.store(C, acc + second, (0, 0))      # complete on both paths


def test_legal_uses_compile():
    legal_uses.compile(tk.spec((64, 64), "f32"), 3)


def test_every_kernel_with_an_mma_still_compiles():
    import test_gemm_gpu as g
    for ta in (False, True):
        for tb in (False, True):
            g.mma_variant.compile(tk.spec((64, 64), "bf16"), tk.spec((64, 64), "bf16"),
                                  tk.spec((64, 64), "f32"), TA=ta, TB=tb, M=64, N=64, K=64)
        g.mma_register_a.compile(tk.spec((64, 64), "bf16"), tk.spec((64, 64), "bf16"),
                                 tk.spec((64, 64), "f32"), TB=ta, M=64, N=64, K=64)


# ---- the lowering: a wait nested below the accumulator's block fences it there

@tk.kernel(num_warps=4)
def wait_below_the_accumulator(C: tk.gl[f32], n: int, WHERE: tk.constexpr):
    """acc is issued at the top; the wait that completes it, and a use, sit in
    an if (WHERE="if"), an if in an if ("nested") or a loop ("loop"); every
    path waits, so ptxas has no reason to add a wait of its own."""
    a = _tile()
    acc = tk.mma_ABt(_acc(), a, a)
    if WHERE == "if":
        if n > 0:
            tk.mma_wait(0)
            tk.store(C, acc * 3.0, (0, 0))
        else:
            tk.mma_wait(0)
    elif WHERE == "nested":
        if n > 0:
            if n > 1:
                tk.mma_wait(0)
                tk.store(C, acc * 3.0, (0, 0))
        tk.mma_wait(0)
        tk.store(C, acc * 5.0, (0, 0))
    else:
        for i in range(n):
            tk.mma_wait(0)
            tk.store(C, acc * 3.0, (i, 0))
        tk.mma_wait(0)


def _ptx_lines(compiled) -> list[str]:
    return [line.strip() for line in compiled.asm["ptx"].splitlines()]


@pytest.mark.parametrize("where", ["if", "nested", "loop"])
def test_a_wait_below_the_accumulator_fences_it_there(where):
    """The uses of acc after a nested wait read registers fenced after that
    wait (the empty asm ties of lowering/mma.py): no arithmetic on acc between
    the wgmma commit and the wait, and no wait ptxas had to add (C7517: LLVM
    had hoisted the loop's `acc * 3.0` above it) or serialized wgmma (C7514)."""
    compiled = wait_below_the_accumulator.compile(tk.spec((64, 64), f32), 2, WHERE=where)
    gpu = compiled.asm["tk-to-gpu"]
    # 32 accumulator registers, tied after each of the two waits (in "nested",
    # the wait after the ifs fences the unfenced registers again: the inner
    # fence does not reach past its branch, where it would not dominate); none
    # at the mma, which starts from tk.zeros (scale-d 0: no register read)
    assert gpu.count('"=f,0"') == 32 * 2
    lines = _ptx_lines(compiled)
    commit = next(i for i, l in enumerate(lines) if l.startswith("wgmma.commit_group"))
    wait = next(i for i, l in enumerate(lines) if l.startswith("wgmma.wait_group"))
    assert not [l for l in lines[commit:wait] if l.startswith(("mul.", "fma.")) and "f32" in l]
    log = compiled.asm["ptxas"]
    assert "C75" not in log, log



@tk.kernel(num_warps=4)
def wait_on_the_carried_accumulator(C: tk.gl[f32], n: int, NESTED: tk.constexpr):
    """The mma of one iteration is waited for at the top of the next (or in an
    if there): the loop-carried accumulator is what the wait completes."""
    a = _tile()
    acc = _acc()
    for i in range(n):
        if NESTED:
            if i > 0:
                tk.mma_wait(0)
                tk.store(C, acc * 3.0, (i, 0))
        else:
            tk.mma_wait(0)
            tk.store(C, acc * 3.0, (i, 0))
        acc = tk.mma_ABt(acc, a, a)
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))


@pytest.mark.parametrize("nested", [False, True])
def test_a_wait_fences_the_loop_carried_accumulator(nested):
    """Ties at the mma, on the carried accumulator after the wait in the loop,
    on the loop's result after the last wait; the use after the wait in the
    loop comes after it in the PTX. (ptxas still serializes this kernel's
    wgmma, C7515: the loop's phi copies of the in-flight accumulator define
    its registers, which no fence at the wait can avoid — wait before the
    yield, as the GEMM's wait(1) does, to keep the pipeline.)"""
    compiled = wait_on_the_carried_accumulator.compile(tk.spec((64, 64), f32), 2,
                                                        NESTED=nested)
    assert compiled.asm["tk-to-gpu"].count('"=f,0"') == 32 * 3
    lines = _ptx_lines(compiled)
    wait = next(i for i, l in enumerate(lines) if l.startswith("wgmma.wait_group"))
    mul = next(i for i, l in enumerate(lines) if l.startswith("mul.") and "f32" in l)
    assert wait < mul
