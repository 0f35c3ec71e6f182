"""fp8 on Hopper without a GPU: e4m3/e5m2 shared tiles filled by TMA (byte
tensor maps) and read by wgmma k32 in the only form it takes for 8-bit types
(both operands K-major: tk.mma_ABt), and the forms it cannot take refused at
the user's line."""
import re
from pathlib import Path

import pytest

import markers
import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.dialects import tk as tk_dialect, types as T
from tk_mlir.lowering import descriptors, mma as mma_lowering

HERE = Path(__file__).resolve()
FP8 = ("f8e4m3", "f8e5m2")
PTX_TYPE = {"f8e4m3": "e4m3", "f8e5m2": "e5m2"}


@tk.kernel(num_warps=4)
def mma_fp8(A: tk.gl, B: tk.gl, C: tk.gl[f32], M: tk.constexpr, N: tk.constexpr,
            K: tk.constexpr):
    """One warpgroup: TMA A (M x K) and B (N x K) in, acc = A @ B.T, store C."""
    a = tk.shared_tile(A.dtype, (M, K), swizzle=128)
    b = tk.shared_tile(B.dtype, (N, K), swizzle=128)
    sem = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(sem, a, b)
        tk.tma.load_async(a, A, (0, 0), sem)
        tk.tma.load_async(b, B, (0, 0), sem)
    tk.wait(sem, 0)
    acc = tk.mma_ABt(tk.zeros((M, N), f32, layout="row", scope="warpgroup"), a, b)
    tk.mma_wait(0)
    tk.store(C, acc, (0, 0))


def compile_mma(a_dtype, b_dtype, M=128, N=64, K=256):
    return mma_fp8.compile(tk.spec((M, K), a_dtype), tk.spec((N, K), b_dtype),
                           tk.spec((M, N), "f32"), M=M, N=N, K=K)


@pytest.mark.parametrize("a_dtype", FP8)
@pytest.mark.parametrize("b_dtype", FP8)
def test_fp8_wgmma_k32_every_pair(a_dtype, b_dtype):
    compiled = compile_mma(a_dtype, b_dtype)
    ptx = compiled.asm["ptx"]
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx)
    # M = 128: two 64-row blocks, K = 256: eight k32 steps each.
    assert wgmma == [f"m64n64k32.f32.{PTX_TYPE[a_dtype]}.{PTX_TYPE[b_dtype]}"] * 16
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx
    # One tensor map per operand, a box of 128 one-byte columns (one 128-byte
    # swizzled row) by the tile's rows.
    assert sorted(compiled.tensor_maps) == [(0, 128, 128, 128, a_dtype),
                                            (1, 64, 128, 128, b_dtype)]
    assert compiled.info["spill stores (bytes)"] == 0


def test_fp8_descriptors_step_32_bytes_along_k():
    """One k32 step of an 8-bit operand is 32 bytes of its row, as a k16 step
    of a 16-bit one: the same swizzled geometry, half the elements."""
    st = T.ST("f8e4m3", 128, 256, 128)          # two 128-byte column blocks
    assert tk_dialect.wgmma_k("f8e4m3") == 32 and tk_dialect.wgmma_k("bf16") == 16
    assert [mma_lowering._offset(st, True, k, 0) for k in range(5)] == \
        [0, 32, 64, 96, 128 * 128]              # step 4 starts the second column block
    assert mma_lowering._offset(st, True, 0, 1) == 64 * 128
    bits = descriptors.wgmma_smem(*descriptors.operand_offsets(st, k_major=True), st.swizzle)
    assert bits >> 62 == 1 and (bits >> 32) & 0x3FFF == 1024 >> 4


# ------------------------------------------------------------------ errors

@tk.kernel(num_warps=4)
def k_fp8_ab(A: tk.gl):
    a = tk.shared_tile(A.dtype, (64, 64), swizzle=64)
    b = tk.shared_tile(A.dtype, (64, 64), swizzle=64)
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    acc = tk.mma_AB(acc, a, b)  # E:fp8-ab


@tk.kernel(num_warps=4)
def k_fp8_atb(A: tk.gl):
    a = tk.shared_tile(A.dtype, (64, 64), swizzle=64)
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    acc = tk.mma_AtB(acc, a, a)  # E:fp8-atb


@tk.kernel(num_warps=4)
def k_fp8_with_bf16(A: tk.gl):
    a = tk.shared_tile(A.dtype, (64, 64), swizzle=64)
    b = tk.shared_tile(bf16, (64, 64), swizzle=128)
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    acc = tk.mma_ABt(acc, a, b)  # E:fp8-bf16


@tk.kernel(num_warps=4)
def k_fp8_f16_acc(A: tk.gl):
    a = tk.shared_tile(A.dtype, (64, 64), swizzle=64)
    acc = tk.zeros((64, 64), tk.f16, layout="row", scope="warpgroup")
    acc = tk.mma_ABt(acc, a, a)  # E:fp8-f16-acc


@tk.kernel(num_warps=4)
def k_fp8_register_a(A: tk.gl):
    a = tk.load(A, (0, 0), (64, 64), layout="row", scope="warpgroup")  # E:fp8-register-a
    b = tk.shared_tile(A.dtype, (64, 64), swizzle=64)
    acc = tk.mma_ABt(tk.zeros((64, 64), f32, layout="row", scope="warpgroup"), a, b)


ERRORS = [
    (k_fp8_ab, "fp8-ab", "fp8 wgmma reads both operands K-major"),
    (k_fp8_atb, "fp8-atb", "use tk.mma_ABt with a as M x K and b as N x K, got tk.mma_AtB"),
    (k_fp8_with_bf16, "fp8-bf16", "both fp8 (f8e4m3/f8e5m2, in any pair), got f8e4m3 and bf16"),
    (k_fp8_f16_acc, "fp8-f16-acc", "the accumulator must be an f32 tile"),
    (k_fp8_register_a, "fp8-register-a", "register tiles are not lowered yet"),
]


@pytest.mark.parametrize("kernel,marker,message", ERRORS, ids=[e[1] for e in ERRORS])
def test_fp8_forms_wgmma_cannot_take_are_refused_at_the_line(kernel, marker, message):
    with pytest.raises(tk.CompilationError) as info:
        kernel.compile(tk.spec((1024, 64), "f8e4m3"))
    e = info.value
    assert message in e.message, e.message
    assert Path(e.filename).resolve() == HERE and e.line == markers.marked(HERE, marker)[0]


@tk.kernel(num_warps=4)
def copy_fp8(A: tk.gl, B: tk.gl, SWIZZLE: tk.constexpr):
    """A global -> shared -> global round trip by tk.copy (no TMA)."""
    a = tk.shared_tile(A.dtype, (64, 128), swizzle=SWIZZLE)
    tk.copy(a, A, (0, 0))
    tk.copy(B, a, (0, 0))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("swizzle", [0, 128])
def test_tk_copy_moves_fp8_as_words(dtype, swizzle):
    """LLVM has no fp8 vectors: tk.copy moves fp8 tiles' 16-byte chunks as
    four i32 words (it was an internal error in convert-scf-to-cf), and the
    interpreter copies the bits; the ragged edge past the tensor stays out."""
    torch = pytest.importorskip("torch")
    c = copy_fp8.compile(tk.spec((60, 128), dtype), tk.spec((60, 128), dtype), SWIZZLE=swizzle)
    ptx = c.asm["ptx"]
    assert re.search(r"ld\.global[\w.]*\.v4\.(b32|u32)", ptx), ptx[-2000:]
    assert re.search(r"st\.global[\w.]*\.v4\.(b32|u32)", ptx)
    assert c.info["spill stores (bytes)"] == 0            # (ptxas takes it)
    a = torch.randn(60, 128).to(getattr(torch, {"f8e4m3": "float8_e4m3fn",
                                                "f8e5m2": "float8_e5m2"}[dtype]))
    b = torch.full((60, 128), float("nan")).to(a.dtype)
    copy_fp8.interpret[(1,)](a, b, SWIZZLE=swizzle)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
