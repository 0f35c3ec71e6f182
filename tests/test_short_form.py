"""The tk stages' short form (dialects/short_form.py, `compiled.asm.short`):
one readable line per op, short types, the Python line as a gutter, every
attribute kept; the generic text stays in `compiled.asm[stage]`."""
import re
from pathlib import Path

import pytest
from mlir import ir

import tk_mlir as tk
from tk_mlir.dialects import short_form as S, tk as tk_dialect, types as T
from tk_mlir.kernels import flash_attention, gemm, norms

ROW = re.compile(r"^ *(\S*) │ (.*)$")


def rows(text: str) -> list[tuple[str, str]]:
    """(gutter, op text) per listing line, the file header left out."""
    return [(m[1], m[2].strip()) for m in map(ROW.match, text.splitlines()[1:])]


def gutter_of(text: str, needle: str) -> str:
    return next(g for g, op in rows(text) if needle in op)


def line_of(path: str, needle: str) -> int:
    return next(i for i, l in enumerate(Path(path).read_text().splitlines(), 1) if needle in l)


@pytest.fixture(scope="module")
def rmsnorm():
    x, w = tk.spec((256, 4096), "bf16"), tk.spec((4096,), "bf16")
    return norms.rmsnorm_kernel.compile(x, w, x, 1e-6, BLOCK=4096)


@pytest.fixture(scope="module")
def gemm_kernel():
    a, b = tk.spec((384, 512), "bf16"), tk.spec((256, 512), "bf16")
    return gemm.gemm_kernel.compile(a, b, tk.spec((384, 256), "bf16"), config=0)


@pytest.fixture(scope="module")
def attention():
    cfg = flash_attention._config(128)
    q, lse = tk.spec((2, 16, 1024, 128), tk.bf16), tk.spec((2, 16, 1024), tk.f32)
    return flash_attention.attention_kernel.compile(
        q, q, q, q, lse, tk.spec((1024,), "i32"), 0.125, D=128, CAUSAL=True,
        num_warps=4 * (cfg["CONSUMERS"] + 1), **cfg)


def test_rmsnorm_reads_like_its_source(rmsnorm):
    text = rmsnorm.asm.short("tk-proxy-fences")
    assert text.splitlines()[0] == "// norms.py"
    assert "loc(" not in text and "!tk." not in text and '"tk.' not in text
    ops = [op for _, op in rows(text)]
    assert "%13 = tk.mul_row %2, %12 : rt<f32, 1x4096>" in ops
    assert any(re.fullmatch(r"%\d+ = tk.row_sum %\d+ \{exchange_group=0, exchange_sync_after="
                            r"false, scratch_offset=0\} : rv<f32, 1, \S+>", op) for op in ops)
    assert any(re.fullmatch(r"%\d+ = tk.load %arg0 \[%0, %c0_i32\] \{fill=0.0\} : "
                            r"rt<bf16, 1x4096>", op) for op in ops)
    src = norms.__file__
    # (ops of a tk.func carry its own lines: rms_normalized's)
    assert gutter_of(text, "tk.mul_row") == str(line_of(src, "return x.mul_row(inv_rms)"))
    assert gutter_of(text, "tk.rsqrt") == str(line_of(src, "inv_rms = "))
    assert [g for g, op in rows(text) if op == "}"] == [""]    # closers have no line


def test_gemm_short_form(gemm_kernel):
    text = gemm_kernel.asm.short("tk-proxy-fences")
    ops = [op for _, op in rows(text)]
    assert text.splitlines()[0] == "// gemm.py"
    assert any(re.fullmatch(r"%\d+ = tk.alloc_st \{count=4, offset=\d+, stride=\d+\} : "
                            r"st<bf16, 128x64, swizzle 128>", op) for op in ops)
    assert any(re.fullmatch(r"%\d+ = tk.mma %arg\d+, %\d+, %\d+ \{trans_a=0, trans_b=0\} : "
                            r"rt<f32, 64x256, row, warpgroup>", op) for op in ops)
    assert any(re.fullmatch(r"tk.tma_load %\d+, %arg0, %\d+ \[%\d+, %arg\d+\]", op) for op in ops)
    assert "tk.mma_wait {pending=1}" in ops
    assert any(op.startswith("scf.for ") or " = scf.for " in op for op in ops)
    # The template's own ops (register split, pipeline) carry the kernel's
    # call of it, as in a user's kernel: the line of `tk.lcf(`.
    assert gutter_of(text, "tk.set_registers {count=40, action=dec}") == \
        str(line_of(gemm.__file__, "tk.lcf(tasks * SPLIT_K"))
    assert gutter_of(text, "tk.mma ") == \
        str(line_of(gemm.__file__, "acc = (tk.mma_AB if B_KN else tk.mma_ABt)(acc,"))


def test_attention_short_form(attention):
    text = attention.asm.short()                     # the frontend's tk stage
    ops = [op for _, op in rows(text)]
    for pattern in (r"%\d+ = tk.sub_row %\d+, %\d+ : rt<f32, 64x128, row, warpgroup>",
                    r"%\d+ = tk.exp2 %\d+ : rt<f32, 64x128, row, warpgroup>",
                    r"%\d+ = tk.row_max %\d+ : rv<f32, 64, \S+, warpgroup>",
                    r"%\d+ = tk.cmp_le %\d+, %\S+ : rt<bool, 64x128, row, warpgroup>"):
        assert any(re.fullmatch(pattern, op) for op in ops), pattern
    src = flash_attention.__file__
    assert gutter_of(text, "tk.sub_row") == str(line_of(src, ".sub_row(finite(m))"))


def _parse(text: str) -> ir.Module:
    return ir.Module.parse(text)


@pytest.mark.parametrize("kernel", ["rmsnorm", "gemm_kernel", "attention"])
def test_no_attribute_operand_or_result_is_lost(kernel, request):
    compiled = request.getfixturevalue(kernel)
    ctx = ir.Context()
    tk_dialect.load(ctx)
    with ctx:
        module = _parse(compiled.asm["tk-proxy-fences"])
        listing = S.op_lines(module.operation)
        names = S._Namer(module.operation)
        tk_rows = [(op, text) for _, _, text, op in listing if op is not None and
                   tk_dialect.op_def(op)]
        count = [0]
        def visit(op):
            count[0] += tk_dialect.op_def(op) is not None
            return ir.WalkResult.ADVANCE
        module.operation.walk(visit)
        assert len(tk_rows) == count[0]            # every tk op has its line
        for op, text in tk_rows:
            d = tk_dialect.op_def(op)
            folded = S.mnemonic_fields(d)
            for n in op.attributes:
                value = S.attribute_short(op.attributes[n])
                assert (f"{n}={value}" in text) or (n in folded and value in text), (n, text)
            for v in op.operands:
                assert re.search(re.escape(names(v)) + r"\b", text), (names(v), text)
            for r in op.results:
                t = T.parse(r.type)
                assert (S.type_short(t) if t else str(r.type)) in text


def test_every_op_of_the_dialect_has_a_short_form():
    ctx = ir.Context()
    tk_dialect.load(ctx)
    with ctx, ir.Location.file("k.py", 7, 1):
        i32 = ir.IntegerType.get_signless(32)
        module = ir.Module.create()
        block = module.body
        with ir.InsertionPoint(block):
            from mlir.dialects import arith
            c = arith.ConstantOp(i32, 3).result
            made = []
            for d in tk_dialect.OPS:
                operands = [c] * (len(d.operands) + (2 if d.variadic else 0))
                attrs = {a: ir.StringAttr.get(f"v{i}") for i, a in enumerate(d.attributes)}
                made.append(ir.Operation.create(f"tk.{d.name}", results=[i32] * len(d.results),
                                                operands=operands, attributes=attrs))
        listing = S.op_lines(module.operation)
        by_op = {str(op): text for _, _, text, op in listing if op is not None}
        assert len([t for t in by_op.values() if " tk." in t or t.startswith("tk.")]) == \
            len(tk_dialect.OPS)
        for d, op in zip(tk_dialect.OPS, made):
            text = next(t for _, _, t, o in listing if o == op)
            shown_name = d.mnemonic.format(**{a: f"v{i}" for i, a in enumerate(d.attributes)}) \
                if d.mnemonic else d.name
            assert re.search(rf"(^|= )tk\.{shown_name}( |$)", text), (d.name, text)
            for i, a in enumerate(d.attributes):
                assert f"{a}=v{i}" in text or (a in S.mnemonic_fields(d) and f"v{i}" in text)
            assert text.count("%c") == len(d.operands) + (2 if d.variadic else 0), text
            if d.results:
                assert text.endswith(" : i32"), text
        gutter = S.short_form(module)
        assert gutter.splitlines()[0] == "// k.py"
        assert all(line.startswith("7 │ ") for line in gutter.splitlines()[1:])


def test_types_are_short():
    assert S.type_short(T.RT("f32", 4, 512)) == "rt<f32, 4x512>"
    assert S.type_short(T.RT("bf16", 64, 64, "col", "warp")) == "rt<bf16, 64x64, col, warp>"
    assert S.type_short(T.GL("bf16", (None, 4096))) == "gl<bf16, ?x4096>"
    assert S.type_short(T.ST("bf16", 64, 64, 128)) == "st<bf16, 64x64, swizzle 128>"
    assert S.type_short(T.ST("f32", 16, 16)) == "st<f32, 16x16>"
    assert S.type_short(T.RV("f32", 16)) == "rv<f32, 16>"
    assert S.type_short(T.SV("f32", 64)) == "sv<f32, 64>"
    assert S.type_short(T.Sem()) == "sem"
    assert S.types_short('(!tk.gl<f32, array<i64: -1, 8>>, i32) -> !tk.sem') == \
        "(gl<f32, ?x8>, i32) -> sem"


def test_short_is_for_tk_stages_and_the_generic_text_stays(rmsnorm):
    with pytest.raises(ValueError, match=r"asm.short\('ptx'\): the short form is for the tk "
                                         r"stages \(tk, tk-assign-layouts"):
        rmsnorm.asm.short("ptx")
    assert '"tk.reduce"' in rmsnorm.asm["tk"]          # generic, re-parsable
    assert "short" not in list(rmsnorm.asm)            # not a stage of its own


import kernel_helpers  # noqa: E402  (tests/ is on sys.path: conftest)


@tk.kernel(num_warps=4)
def uses_a_helper_module(X: tk.gl[tk.f32], Y: tk.gl[tk.f32]):
    x = tk.load(X, (0, 0), (16, 64))
    tk.store(Y, kernel_helpers.scaled_exp(x, 2.0), (0, 0))


def test_lines_from_another_user_file_name_it_in_the_gutter():
    x = tk.spec((16, 64), tk.f32)
    text = uses_a_helper_module.compile(x, x).asm.short("tk")
    helpers = Path(__file__).with_name("kernel_helpers.py")
    assert text.splitlines()[0] == "// test_short_form.py"
    assert gutter_of(text, "tk.exp ") == f"kernel_helpers.py:{line_of(helpers, '.exp()')}"
    assert gutter_of(text, "tk.load ") == str(line_of(__file__, "x = tk.load(X, (0, 0), (16, 64))"))
