"""Math and sync for FlashAttention-3-style kernels, checked in the PTX/SASS
(no GPU): fma contraction of tile arithmetic (and its opt-out,
@tk.kernel(fp_contract=False), which keys the caches), rcp.approx, tile
division by div.full.f32, and bar.arrive (tk.named_barrier_arrive)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

import markers
import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.specialization import Specialization
from tk_mlir.toolchain import find_tool

HERE = Path(__file__).resolve()
F32 = tk.spec((64, 64), f32)


def _ptx_ops(compiled) -> Counter:
    """Instruction mnemonics of the PTX, counted."""
    return Counter(re.findall(r"^\s*(?:@%p\d+\s+)?([a-z][a-z0-9_.]*)\s", compiled.asm["ptx"], re.M))


@tk.kernel(num_warps=4)
def scaled_minus(X: tk.gl[f32], Y: tk.gl[f32], s: float, FORM: tk.constexpr):
    x = tk.load(X, (0, 0), (16, 64))
    if FORM == "tiles":
        y = x * s - x            # x*s - y on two tiles
    else:
        y = (x * s).sub_row(x.row_max())
    tk.store(Y, y, (0, 0))


@tk.kernel(num_warps=4, fp_contract=False)
def scaled_minus_strict(X: tk.gl[f32], Y: tk.gl[f32], s: float, FORM: tk.constexpr):
    x = tk.load(X, (0, 0), (16, 64))
    if FORM == "tiles":
        y = x * s - x
    else:
        y = (x * s).sub_row(x.row_max())
    tk.store(Y, y, (0, 0))


@pytest.mark.parametrize("form", ["tiles", "sub_row"])
def test_tile_multiply_then_subtract_is_one_fma(form):
    ops = _ptx_ops(scaled_minus.compile(F32, F32, 0.5, FORM=form))
    assert ops["fma.rn.f32"] == 8, ops          # 8 registers per thread of a 16x64 tile
    assert not ops["mul.rn.f32"] and not ops["sub.rn.f32"], ops


@pytest.mark.parametrize("form", ["tiles", "sub_row"])
def test_fp_contract_false_keeps_two_roundings(form):
    ops = _ptx_ops(scaled_minus_strict.compile(F32, F32, 0.5, FORM=form))
    assert not ops["fma.rn.f32"], ops
    assert ops["mul.rn.f32"] == 8 and ops["sub.rn.f32"] == 8, ops


def test_fp_contract_is_in_the_cache_key():
    spec = Specialization("k", "src", "f.py", (), (), (), 4, "")
    strict = Specialization("k", "src", "f.py", (), (), (), 4, "", fp_contract=False)
    assert spec.cache_key() != strict.cache_key()


def test_same_function_with_and_without_fp_contract_share_no_code():
    """One function, two kernels: the second must not be served the first's
    code from the disk cache (same source, same place, same arguments)."""
    fn = scaled_minus.fn
    on = tk.Kernel(fn, num_warps=4).compile(F32, F32, 0.5, FORM="tiles")
    off = tk.Kernel(fn, num_warps=4, fp_contract=False).compile(F32, F32, 0.5, FORM="tiles")
    assert _ptx_ops(on)["fma.rn.f32"] == 8 and not _ptx_ops(off)["fma.rn.f32"]
    again = tk.Kernel(fn, num_warps=4).compile(F32, F32, 0.5, FORM="tiles")   # from disk
    assert again.asm["ptx"] == on.asm["ptx"]


def test_fp_contract_must_be_a_bool():
    with pytest.raises(tk.CompilationError, match="fp_contract must be True or False"):
        tk.kernel(num_warps=4, fp_contract="yes")(scaled_minus.fn)


@tk.kernel(num_warps=4)
def softmax_numerator(X: tk.gl[f32], Y: tk.gl[f32], scale: float, FORM: tk.constexpr):
    s = tk.load(X, (0, 0), (16, 64))
    m = s.row_max()
    if FORM == "sub_row":
        p = (s * scale).sub_row(m).exp2()
    else:
        p = (s * scale - s).exp2()
    tk.store(Y, p, (0, 0))


@pytest.mark.parametrize("form", ["sub_row", "tiles"])
def test_exp2_of_a_scaled_difference_is_fma_then_ex2(form):
    """FlashAttention's p = exp2(s * scale - m): one fma, one ex2 per element."""
    compiled = softmax_numerator.compile(F32, F32, 0.125, FORM=form)
    ops = _ptx_ops(compiled)
    assert ops["fma.rn.f32"] == 8 and ops["ex2.approx.ftz.f32"] == 8, ops
    assert not ops["mul.rn.f32"] and not ops["sub.rn.f32"], ops
    lines = [l.strip() for l in compiled.asm["ptx"].splitlines()]
    fma = next(i for i, l in enumerate(lines) if l.startswith("fma.rn.f32"))
    dst = lines[fma].split()[1].rstrip(",")
    assert any(l.startswith("ex2.approx.ftz.f32") and l.endswith(f"{dst};")
               for l in lines[fma:]), "the fma's result feeds an ex2"


@tk.kernel(num_warps=4)
def reciprocal_and_division(X: tk.gl[f32], Y: tk.gl[f32], FORM: tk.constexpr):
    x = tk.load(X, (0, 0), (16, 64))
    if FORM == "rcp":
        y = x.rcp()
    elif FORM == "rcp_vector":
        y = x.mul_row(x.row_sum().rcp())
    elif FORM == "div":
        y = x / (x + 1.0)
    else:
        y = x.div_row(x.row_sum())
    tk.store(Y, y, (0, 0))


@pytest.mark.parametrize("form,instr,count", [
    ("rcp", "rcp.approx.ftz.f32", 8), ("rcp_vector", "rcp.approx.ftz.f32", 1),
    ("div", "div.full.f32", 8), ("div_row", "div.full.f32", 8)])
def test_rcp_and_division(form, instr, count):
    ops = _ptx_ops(reciprocal_and_division.compile(F32, F32, FORM=form))
    assert ops[instr] == count, ops
    assert not [o for o in ops if o.startswith("div.rn") or o.startswith("rcp.rn")], ops


@tk.kernel(num_warps=4)
def bf16_division(X: tk.gl[bf16], Y: tk.gl[bf16]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, x / (x + 1.0), (0, 0))


def test_bf16_division_is_computed_in_f32():
    ops = _ptx_ops(bf16_division.compile(tk.spec((64, 64), bf16), tk.spec((64, 64), bf16)))
    assert ops["div.full.f32"] == 8, ops
    assert not [o for o in ops if o.startswith("div.") and "bf16" in o], ops


# ------------------------------------------------------------ bar.arrive

@tk.kernel(num_warps=8)
def ping_pong(X: tk.gl[f32]):
    # Two consumer warpgroups: the first waits on barrier 1, the second
    # signals it without waiting.
    if tk.warpgroup_id() == 0:
        tk.named_barrier(1, warps=8)
    else:
        tk.named_barrier_arrive(1, warps=8)


def test_named_barrier_arrive_is_bar_arrive():
    compiled = ping_pong.compile(F32)
    assert '{mode = "arrive", warps = 8 : i64}' in compiled.asm["tk"]
    ptx = compiled.asm["ptx"]
    assert re.search(r"\bbar\.arrive\s", ptx) and re.search(r"\bbar\.sync\s+1, 256;", ptx), ptx
    if find_tool("nvdisasm") is None:
        pytest.skip("no nvdisasm")
    sass = compiled.asm["sass"]
    assert re.search(r"BAR\.ARV 0x1, 0x100", sass), sass
    assert re.search(r"BAR\.SYNC\S* 0x1, 0x100", sass), sass


@tk.kernel(num_warps=4)
def arrive_bad_id(X: tk.gl[f32]):
    tk.named_barrier_arrive(0, warps=4)  # E:arrive-id


@tk.kernel(num_warps=4)
def arrive_id_16(X: tk.gl[f32]):
    tk.named_barrier_arrive(16, 4)  # E:arrive-id-16


@tk.kernel(num_warps=4)
def arrive_bad_warps(X: tk.gl[f32]):
    tk.named_barrier_arrive(1, warps=33)  # E:arrive-warps


@tk.kernel(num_warps=4)
def arrive_runtime_warps(X: tk.gl[f32], n: int):
    tk.named_barrier_arrive(1, warps=n)  # E:arrive-runtime-warps


@tk.kernel(num_warps=4)
def arrive_float_id(X: tk.gl[f32]):
    tk.named_barrier_arrive(1.0, warps=4)  # E:arrive-float-id


@tk.kernel(num_warps=4)
def arrive_more_warps_than_the_kernel(X: tk.gl[f32]):
    tk.named_barrier_arrive(1, warps=8)  # E:arrive-too-many


ERRORS = [
    (arrive_more_warps_than_the_kernel, "arrive-too-many",
     "waits for more warps than the kernel has (num_warps=4)", ()),
    (arrive_bad_id, "arrive-id", "a named barrier id must be from 1 to 15", ()),
    (arrive_id_16, "arrive-id-16", "a named barrier id must be from 1 to 15", ()),
    (arrive_bad_warps, "arrive-warps", "warps must be a compile-time int from 1 to 32", ()),
    (arrive_runtime_warps, "arrive-runtime-warps", "warps must be a compile-time int", (3,)),
    (arrive_float_id, "arrive-float-id", "named_barrier_arrive id must be an int", ()),
]


@pytest.mark.parametrize("kernel,marker,message,extra", ERRORS, ids=[e[1] for e in ERRORS])
def test_named_barrier_arrive_errors_point_at_the_line(kernel, marker, message, extra):
    with pytest.raises(tk.CompilationError) as info:
        kernel.compile(F32, *extra)
    e = info.value
    assert message in e.message, e.message
    line, text = markers.marked(HERE, marker)
    assert Path(e.filename).resolve() == HERE and e.line == line, (e.filename, e.line)
    assert text[e.col:].startswith("tk.named_barrier_arrive"), (e.col, text)
