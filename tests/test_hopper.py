"""The Hopper toolkit without a GPU: the GEMM's PTX, ptxas report and SASS
(wgmma, TMA, mbarriers, elect.sync, setmaxnreg, no serialization), the
fences it carries, the shared-tile and descriptor layouts, and the errors
the new ops give at the user's line."""
import importlib
import re
from pathlib import Path

import pytest

import markers
import tk_mlir as tk
from tk_mlir import bf16, f32
from tk_mlir.dialects import types as T
from tk_mlir.lowering import descriptors, mma as mma_lowering
from tk_mlir.toolchain import find_tool

HERE = Path(__file__).resolve()
# The module (the package's name `matmul` is the function).
gemm = importlib.import_module("tk_mlir.kernels.gemm")
HAS_NVDISASM = find_tool("nvdisasm") is not None


def spec(*shape, dtype="bf16"):
    return tk.spec(shape, dtype)


@pytest.fixture(scope="module", params=[("nk", "bf16", "bf16"), ("kn", "bf16", "bf16"),
                                        ("nk", "f16", "f32"), ("kn", "f16", "f16")],
                ids=lambda p: "-".join(p))
def gemm_kernel(request, tmp_path_factory):
    layout, dt, odt = request.param
    kn = layout == "kn"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TK_MLIR_CACHE_DIR", str(tmp_path_factory.mktemp("gemm-cache")))
        b = spec(512, 256, dtype=dt) if kn else spec(256, 512, dtype=dt)
        return gemm.gemm_kernel.compile(spec(384, 512, dtype=dt), b, spec(384, 256, dtype=odt),
                                   B_KN=kn, config=0)


def test_ptx_has_the_hopper_instructions(gemm_kernel):
    ptx = gemm_kernel.asm["ptx"]
    for instruction in ("wgmma.mma_async.sync.aligned.m64n256k16.f32", "cp.async.bulk.tensor",
                        "mbarrier.try_wait.parity", "elect.sync", "mbarrier.arrive.expect_tx"):
        assert instruction in ptx, instruction
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40", ptx)
    assert ".target sm_90a" in ptx
    # ptxas ignores setmaxnreg without .minnctapersm (warning C7508).
    assert re.search(r"\.maxntid 384, 1, 1", ptx) and ".minnctapersm 1" in ptx
    # Tensor maps are 128-byte, 64-byte aligned grid-constant parameters.
    assert len(re.findall(r"\.param \.align 64 \.b8 \w+_param_\d+\[128\]", ptx)) == \
        len(gemm_kernel.tensor_maps) >= 2


def test_ptxas_no_spills_no_serialization_warnings(gemm_kernel):
    log = gemm_kernel.ptxas_log
    info = gemm_kernel.info
    assert info["spill stores (bytes)"] == 0 and info["spill loads (bytes)"] == 0, log
    assert "C7508" not in log, log          # setmaxnreg ignored
    assert "C7514" not in log, log          # wgmma serialized
    assert "C75" not in log, log            # any other performance warning of that family
    assert info["dynamic shared memory (bytes)"] <= 227 * 1024


def test_only_the_fences_the_memory_model_requires(gemm_kernel):
    """One mbarrier-init fence; one proxy fence per TMA store site (generic
    writes to shared -> async-proxy reads); the TMA -> mbarrier -> wgmma chain
    needs none; no full memory barriers anywhere."""
    ptx = gemm_kernel.asm["ptx"]
    fences = [line.strip() for line in ptx.splitlines() if re.search(r"\b(fence|membar)\b", line)]
    assert fences.count("fence.mbarrier_init.release.cluster;") == 1
    proxy = [f for f in fences if f.startswith("fence.proxy")]
    assert all(f == "fence.proxy.async.shared::cta;" for f in proxy)
    stores = ptx.count("cp.async.bulk.tensor.2d.global.shared::cta")
    assert (len(proxy) > 0) == (stores > 0) and len(proxy) <= stores
    assert not [f for f in fences if f.startswith("membar") or ".sc" in f or "acq_rel" in f]
    # No fence or barrier op in the tk IR (the file name in its locations may
    # say anything).
    ops = re.findall(r'"([a-z_]+\.[a-z_.]+)"\(', gemm_kernel.asm["tk"])
    assert ops and not [op for op in ops if "fence" in op or op == "tk.barrier"]


@pytest.mark.skipif(not HAS_NVDISASM, reason="nvdisasm not installed")
def test_sass_hgmma_utma_and_no_serialization_loop(gemm_kernel):
    sass = gemm_kernel.asm["sass"]
    assert "HGMMA.64x256x16.F32" in sass
    assert "UTMALDG.2D" in sass
    assert "USETMAXREG" in sass
    # TMA is issued under elect.sync, which picks one lane without a loop over
    # the active lanes:
    # no BRA.U.ANY anywhere, in particular not around a UTMALDG.
    assert "BRA.U.ANY" not in sass
    lines = sass.splitlines()
    for i, line in enumerate(lines):
        if "UTMALDG" in line:
            window = "\n".join(lines[max(0, i - 12):i + 12])
            assert "BRA.U.ANY" not in window


def test_16_bit_results_are_stored_with_tma(gemm_kernel, request):
    """16-bit outputs leave through shared memory and TMA stores; f32 ones
    (twice the staging space) from registers."""
    out_dtype = request.node.callspec.id.split("-")[-1]
    stores = gemm_kernel.asm["ptx"].count("cp.async.bulk.tensor.2d.global.shared::cta")
    c_has_map = any(arg == 2 for arg, *_ in gemm_kernel.tensor_maps)
    assert (stores > 0) == c_has_map == (out_dtype != "f32")


def test_gemm_reads_in_under_100_lines():
    source = Path(gemm.__file__).read_text()
    kernel = source[source.index("@tk.autotune"):source.index("def matmul")]
    code = [l for l in kernel.splitlines() if l.strip() and not l.strip().startswith("#")]
    assert len(code) < 100


def test_cluster_gemm_multicasts_and_arrives_across_the_cluster():
    compiled = gemm.gemm_kernel.kernel.compile(spec(512, 256), spec(512, 256), spec(512, 512),
                                               CLUSTER=2)
    ptx = compiled.asm["ptx"]
    assert compiled.cluster == 2
    assert re.search(r"\.reqnctapercluster 2, 1, 1", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\S*\.multicast::cluster", ptx)
    assert "mapa.shared::cluster" in ptx
    assert "mbarrier.arrive.shared::cluster.b64" in ptx
    if HAS_NVDISASM:
        # A stage release is a signal, not a fence: a cluster-scope release
        # would put MEMBAR.ALL.GPU before every arrival (~40% slower, measured).
        lines = compiled.asm["sass"].splitlines()
        remote = [i for i, line in enumerate(lines) if "SYNCS.ARRIVE.TRANS64.RED" in line]
        assert remote and not any("MEMBAR" in lines[i - 1] for i in remote)
    # semaphores initialised cluster-wide before use, and no block exits early
    assert ptx.count("barrier.cluster.arrive") == ptx.count("barrier.cluster.wait") == 2
    assert "C75" not in compiled.ptxas_log and compiled.info["spill stores (bytes)"] == 0


def test_cluster_grid_must_be_whole_clusters():
    from tk_mlir.launcher import normalize_grid
    assert normalize_grid((132,), {}, 2) == (132, 1, 1)
    with pytest.raises(tk.ArgumentError, match="multiple of 2"):
        normalize_grid((131,), {}, 2)


# ------------------------------------------------------------- layouts

@pytest.mark.parametrize("swizzle", [32, 64, 128])
def test_swizzled_tile_layout_is_the_tma_pattern(swizzle):
    """Column blocks of `swizzle` bytes per row; 16-byte chunk c of row r
    lands at chunk c ^ (r % (swizzle / 16)) within its line (the TMA table)."""
    st = T.ST("bf16", 64, 128, swizzle)
    per_chunk = 8
    for row in range(64):
        for col in range(0, 128, per_chunk):
            block, inner = divmod(col, st.block_cols)
            line = block * st.rows * swizzle + row * swizzle
            chunk = inner // per_chunk
            # bits 4.. of the offset XOR bits 7.. (the 128-byte line index)
            expect = line + ((chunk ^ ((line >> 7) & (swizzle // 16 - 1))) << 4)
            assert st.byte_offset(row, col) == expect


@pytest.mark.parametrize("st", [T.ST("bf16", 64, 48, 0), T.ST("f32", 16, 80, 0),
                                T.ST("bf16", 16, 64, 32), T.ST("bf16", 16, 128, 64),
                                T.ST("bf16", 8, 256, 128), T.ST("f32", 8, 64, 128)],
                         ids=lambda st: f"{st.dtype}-{st.rows}x{st.cols}-sw{st.swizzle}")
def test_lowered_shared_offsets_are_the_tile_layout(st):
    """The IR every shared access computes its address with, run on the CPU,
    puts each element where T.ST.byte_offset (the TMA pattern) says: unswizzled
    tiles of any width (48, 80 columns: one block per row), swizzled ones of
    several column blocks."""
    from lowering_jit import shared_offsets
    got = shared_offsets(st)
    wrong = [(at, off, st.byte_offset(*at)) for at, off in got.items()
             if off != st.byte_offset(*at)]
    assert not wrong, wrong[:4]


def wgmma_bits(st, k_major):
    return descriptors.wgmma_smem(*descriptors.operand_offsets(st, k_major), st.swizzle)


def test_descriptor_fields():
    kmajor = T.ST("bf16", 64, 64, 128)
    bits = wgmma_bits(kmajor, k_major=True)
    assert bits >> 62 == 1                                  # 128-byte swizzle
    assert (bits >> 32) & 0x3FFF == 1024 >> 4               # SBO: 8 rows of 128 bytes
    assert mma_lowering._offset(kmajor, True, k_step=1, mn_step=0) == 32
    assert mma_lowering._offset(kmajor, True, k_step=0, mn_step=1) == 64 * 128
    mn_major = T.ST("bf16", 64, 256, 128)                   # B of A @ B: K x N
    bits = wgmma_bits(mn_major, k_major=False)
    assert (bits >> 16) & 0x3FFF == 64 * 128 >> 4           # LBO: between 64-column blocks
    assert (bits >> 32) & 0x3FFF == 1024 >> 4
    assert mma_lowering._offset(mn_major, False, k_step=1, mn_step=0) == 16 * 128
    assert wgmma_bits(T.ST("f16", 64, 32, 64), True) >> 62 == 2
    assert wgmma_bits(T.ST("f16", 64, 16, 32), True) >> 62 == 3



@pytest.mark.parametrize("encode", [descriptors.wgmma_smem, descriptors.tcgen05_smem],
                         ids=["wgmma", "tcgen05"])
@pytest.mark.parametrize("st, k_major", [(T.ST("bf16", 64, 64, 128), True),
                                         (T.ST("bf16", 128, 256, 128), False),
                                         (T.ST("f16", 64, 32, 64), True),       # bit 63 set
                                         (T.ST("f16", 64, 32, 64), False),
                                         (T.ST("bf16", 64, 16, 32), True),
                                         (T.ST("bf16", 64, 80, 32), False),
                                         (T.ST("f8e4m3", 128, 128, 128), True)])
def test_descriptors_at_every_step_are_the_encoded_bits(st, k_major, encode, monkeypatch):
    """Descriptors.at(k, mn), built as an i32 low word plus a constant high
    word, is the encoded constant fields with the start address (bits 0-13)
    of the operand block: JIT-run on the CPU for shared addresses every 1 KB
    up to the top of the 227 KB a block may have (no carry out of the start
    field, whatever the swizzle's bits in the high word)."""
    from mlir import ir
    from mlir.dialects import llvm
    from lowering_jit import run_i32_functions
    from tk_mlir.lowering.fragments import SharedRef
    from tk_mlir.target import HOPPER
    monkeypatch.setattr(mma_lowering, "in_place", lambda v: v)
    bits = encode(*descriptors.operand_offsets(st, k_major), st.swizzle)
    k_steps = st.cols * T.itemsize(st.dtype) // 32 if k_major else st.rows // 16
    mn_steps = (st.rows if k_major else st.cols) // 64
    steps = [(k, mn) for k in range(k_steps) for mn in range(mn_steps)]

    def body(j, address, _):
        ptr = llvm.inttoptr(ir.Type.parse("!llvm.ptr<3>"), address)
        return mma_lowering.Descriptors(SharedRef(ptr, st), k_major, encode).at(*steps[j])

    top = HOPPER.max_shared_bytes - st.rows * st.cols * T.itemsize(st.dtype)
    addresses = [*range(0, top + 1, 1024), top // 16 * 16]
    got = run_i32_functions(len(steps), body, [(a, 0) for a in addresses])
    for (k, mn), by_address in zip(steps, got):
        for (address, _), desc in by_address.items():
            start = (address + mma_lowering._offset(st, k_major, k, mn)) >> 4
            assert desc & (1 << 64) - 1 == bits | start, (k, mn, address)

# -------------------------------------------------------------- helpers

@tk.func
def twice(x):
    y = x + x
    return y


@tk.kernel(num_warps=4)
def k_helpers(X: tk.gl[f32], Y: tk.gl[f32]):
    def load_row(i, scale=1.0):
        return tk.load(X, (i, 0), (16, 64)) * scale
    tiles = [load_row(i, 2.0) for i in range(2)]
    tk.store(Y, twice(tiles[0] + tiles[1]), (0, 0))


def test_nested_functions_tk_func_and_comprehensions_inline():
    tk_ir = k_helpers.compile(spec(64, 64, dtype="f32"), spec(64, 64, dtype="f32")).asm["tk"]
    assert tk_ir.count('"tk.load"') == 2 and tk_ir.count('"tk.mul"') == 2
    assert tk_ir.count('"tk.add"') == 2
    assert "func.call" not in tk_ir        # inlined


# --------------------------------------------------------------- errors

def marked(marker):
    return markers.marked(HERE, marker)[0]


@tk.func
def returns_early(x, flag: bool):
    for i in range(2):
        return x  # E:early-return
    return x


@tk.kernel(num_warps=4)
def k_early_return(X: tk.gl[f32]):
    returns_early(tk.load(X, (0, 0), (16, 64)), True)


@tk.kernel(num_warps=12)
def k_mma_unswizzled(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 64))
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    acc = tk.mma_ABt(acc, a, a)  # E:mma-swizzle


@tk.kernel(num_warps=12)
def k_mma_layout(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    acc = tk.zeros((64, 64), f32, layout="vec", scope="warpgroup")
    acc = tk.mma_ABt(acc, a, a)  # E:mma-acc


@tk.kernel(num_warps=12)
def k_mma_k(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    b = tk.shared_tile(bf16, (64, 128), swizzle=128)
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    acc = tk.mma_ABt(acc, a, b)  # E:mma-k


@tk.kernel(num_warps=4)
def k_tma_rows(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (512, 64), swizzle=128)
    s = tk.semaphore()
    tk.tma.load_async(a, A, (0, 0), s)  # E:tma-rows


@tk.kernel(num_warps=4)
def k_sem_in_if(A: tk.gl[bf16]):
    if tk.block_id(0) == 0:
        s = tk.semaphore()  # E:sem-if


@tk.kernel(num_warps=4)
def k_subtile_blocks(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (128, 128), swizzle=128)
    b = a.subtile(1, 64)  # E:subtile


@tk.kernel(num_warps=4)
def k_swizzle_row(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 32), swizzle=128)  # E:swizzle-row


@tk.kernel(num_warps=4)
def k_not_array(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (64, 64))
    b = a[1]  # E:not-array


@tk.kernel(num_warps=4)
def k_barrier_id(A: tk.gl[bf16]):
    tk.named_barrier(0, warps=4)  # E:barrier-id


@tk.kernel(num_warps=4)
def k_registers(A: tk.gl[bf16]):
    tk.increase_registers(300)  # E:registers


@tk.kernel(num_warps=4)
def k_remote_without_cluster(A: tk.gl[bf16]):
    s = tk.semaphore()
    tk.arrive(s, cta=1)  # E:no-cluster


@tk.kernel(num_warps=4)
def k_slice(A: tk.gl[f32]):
    x = tk.load(A, (0, 0), (64, 64))
    y = x.slice(cols=(8, 8))  # E:slice


ERRORS = [
    (k_early_return, "early-return", "return in tk.func returns_early is only allowed as its last"),
    (k_mma_unswizzled, "mma-swizzle", "must be a swizzled shared tile"),
    (k_mma_layout, "mma-acc", "the accumulator must be an f32 tile of warpgroup scope in the row"),
    (k_mma_k, "mma-k", "must agree"),
    (k_tma_rows, "tma-rows", "a TMA box has at most 256 rows"),
    (k_sem_in_if, "sem-if", "at the kernel's top level"),
    (k_subtile_blocks, "subtile", "column blocks"),
    (k_swizzle_row, "swizzle-row", "must be a multiple of 128 bytes"),
    (k_not_array, "not-array", "is not an array"),
    (k_barrier_id, "barrier-id", "from 1 to 15"),
    (k_registers, "registers", "multiple of 8 from 24 to 256"),
    (k_slice, "slice", "slice"),
    (k_remote_without_cluster, "no-cluster", "needs a cluster: call tk.use_cluster(n) first"),
]


@pytest.mark.parametrize("kernel,marker,message", ERRORS, ids=[e[1] for e in ERRORS])
def test_hopper_errors_point_at_the_line(kernel, marker, message):
    dtype = "f32" if marker in ("early-return", "slice") else "bf16"
    with pytest.raises(tk.CompilationError) as info:
        kernel.compile(spec(1024, 64, dtype=dtype))
    e = info.value
    assert message in e.message, e.message
    assert Path(e.filename).resolve() == HERE and e.line == marked(marker), (e.filename, e.line)


# ------------------------------------------------- fixes from review

@tk.kernel(num_warps=4)
def k_late_binding(X: tk.gl[f32], Y: tk.gl[f32], n: int):
    acc = tk.zeros((16, 64), f32)

    def add():
        return acc + 1.0
    for k in range(n):
        acc = add()
    tk.store(Y, acc, (0, 0))


def test_nested_function_sees_names_when_called():
    """Python's late binding: inside the loop `acc` is the loop-carried value."""
    tk_ir = k_late_binding.compile(spec(64, 64, dtype="f32"), spec(64, 64, dtype="f32"), 3).asm["tk"]
    (add,) = [line for line in tk_ir.splitlines() if '"tk.add"' in line]
    assert '"tk.add"(%arg' in add          # the scf.for iter_arg, not the initial zeros


@tk.kernel(num_warps=4)
def k_wait_in_one_branch(A: tk.gl[bf16], n: int):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    if n > 0:
        acc = tk.mma_ABt(acc, a, a)
    else:
        acc = tk.mma_ABt(acc, a, a)
        tk.mma_wait(0)
    tk.mma_wait(0)
    tk.store(A, acc.to(bf16), (0, 0))


def test_mma_wait_in_one_branch_of_an_if():
    compiled = k_wait_in_one_branch.compile(spec(64, 64), 1)
    assert "C7514" not in compiled.ptxas_log


@tk.kernel(num_warps=4)
def k_two_groups_from_threads(A: tk.gl[bf16], V: tk.gl[f32]):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)     # (compiled only: never filled)
    v = tk.load(V, (0,), (64,), scope="warpgroup")
    # Both accumulators made by threads, a column broadcast (each value in two
    # registers of a thread): the second one's copies must not land between
    # the first group's issue and its own.
    s0 = tk.zeros((64, 64), f32, layout="row", scope="warpgroup").sub_col(v)
    d0 = tk.zeros((64, 64), f32, layout="row", scope="warpgroup").sub_col(v * 2.0)
    s = tk.mma_ABt(s0, a, a)
    d = tk.mma_ABt(d0, a, a)
    tk.mma_wait(0)
    tk.store(A, (s * d).to(bf16), (0, 0))


def test_accumulators_made_by_threads_keep_two_mma_groups_in_flight():
    """ptxas injects a wait for the first group (C7517) when registers of the
    second one's accumulator are written after the first was issued:
    lower_mma fences them where they are computed, above both."""
    compiled = k_two_groups_from_threads.compile(spec(64, 64), spec(64, dtype="f32"))
    assert "C75" not in compiled.ptxas_log, compiled.ptxas_log
    sass = compiled.asm["sass"]
    first, last = sass.index("HGMMA"), sass.rindex("HGMMA")
    assert "DEPBAR" not in sass[first:last]          # both groups issued before a wait


@tk.kernel(num_warps=4)
def k_accumulators_from_outer_blocks(A: tk.gl[bf16], V: tk.gl[f32], n: int):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)     # (compiled only: never filled)
    v = tk.load(V, (0,), (64,), scope="warpgroup")
    s0 = tk.zeros((64, 64), f32, layout="row", scope="warpgroup").sub_col(v)
    for _ in range(n):          # made outside the loop, a loop-carried one inside it
        d0 = s0
        if n > 1:
            d0 = s0.sub_col(v * 2.0)
        s = tk.mma_ABt(s0, a, a)
        d = tk.mma_ABt(d0, a, a)
        tk.mma_wait(0)
        s0 = s * d
    tk.store(A, s0.to(bf16), (0, 0))


def test_accumulators_made_in_outer_blocks_and_branches_compile_clean():
    """lower_mma's fences where an accumulator is computed: computed outside
    the loop (fenced at the MMA), or an if's result in the loop's block."""
    compiled = k_accumulators_from_outer_blocks.compile(spec(64, 64), spec(64, dtype="f32"), 3)
    assert "C75" not in compiled.ptxas_log, compiled.ptxas_log


def test_cache_key_follows_what_a_tk_func_reads(tmp_path):
    src = tmp_path / "mod_key.py"
    src.write_text(
        "import tk_mlir as tk\nfrom tk_mlir import f32\nSCALE = 2\n"
        "@tk.func\ndef helper(x):\n    return x * SCALE\n"
        "@tk.kernel\ndef k(X: tk.gl[f32]):\n"
        "    tk.store(X, helper(tk.load(X, (0, 0), (16, 64))), (0, 0))\n")
    import importlib.util
    module_spec = importlib.util.spec_from_file_location("mod_key", src)
    mod = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(mod)
    before = mod.k._globals_key()
    mod.SCALE = 3
    assert mod.k._globals_key() != before


@tk.kernel(num_warps=8)
def k_lcf_warps(A: tk.gl[bf16]):
    def nothing(*args):
        pass
    tk.lcf(1, 1, [(bf16, (64, 64), 128)], nothing, nothing, nothing, nothing)  # E:lcf-warps


@tk.kernel(num_warps=8)
def k_lcf_one_stage(A: tk.gl[bf16]):
    def nothing(*args):
        pass
    tk.lcf(1, 1, [(bf16, (64, 64), 128)], nothing, nothing, nothing, nothing, stages=1,  # E:lcf-stages
           consumers=1)


@tk.kernel(num_warps=8)
def k_cluster_twice(A: tk.gl[bf16]):
    def nothing(*args):
        pass
    tk.use_cluster(2)
    tk.lcf(1, 1, [(bf16, (64, 64), 128)], nothing, nothing, nothing, nothing,  # E:lcf-cluster
           consumers=1)


@tk.kernel(num_warps=4)
def k_whole_array(A: tk.gl[bf16]):
    sems = tk.semaphores(2)
    tk.wait(sems, 0)  # E:whole-array


@tk.kernel(num_warps=4)
def k_subtile_range(A: tk.gl[bf16]):
    a = tk.shared_tile(bf16, (128, 64), swizzle=128)
    b = a.subtile(2, 64)  # E:subtile-range


@tk.kernel(num_warps=4)
def k_align_slack(A: tk.gl[bf16]):
    a = tk.shared_tiles(bf16, (128, 64), 14, swizzle=128)  # E:align-slack
    b = tk.shared_tile(bf16, (16, 64))
    s = tk.semaphore()          # 231432 bytes: fits, but not with the 1024 of alignment


@tk.kernel(num_warps=4)
def k_prefetch_dtype(A: tk.gl[bf16]):
    a = tk.shared_tile(f32, (64, 32), swizzle=128)
    tk.tma.prefetch(A, a)  # E:prefetch


@tk.kernel(num_warps=4)
def k_one_element_array(A: tk.gl[bf16]):
    sems = tk.semaphores(1)
    tiles = tk.shared_tiles(bf16, (64, 64), 1, swizzle=128)
    tk.wait(sems[0], 0)
    b = tiles[0]


REVIEW_ERRORS = [
    (k_lcf_warps, "lcf-warps", HERE, "needs num_warps=12"),   # at the user's call of the template
    (k_lcf_one_stage, "lcf-stages", HERE, "lcf needs stages >= 2"),
    (k_cluster_twice, "lcf-cluster", HERE, "tk.lcf calls it with its cluster= argument"),
    (k_whole_array, "whole-array", HERE, "whole array of 2 semaphores"),
    (k_subtile_range, "subtile-range", HERE, "outside the tile's 128 rows"),
    (k_align_slack, "align-slack", HERE, "plus 1024 to align swizzled tiles"),
    (k_prefetch_dtype, "prefetch", HERE, "differ in dtype"),
]


@pytest.mark.parametrize("kernel,marker,where,message", REVIEW_ERRORS,
                         ids=[e[1] for e in REVIEW_ERRORS])
def test_review_errors(kernel, marker, where, message):
    with pytest.raises(tk.CompilationError) as info:
        kernel.compile(spec(1024, 64))
    e = info.value
    assert message in e.message, e.message
    assert Path(e.filename).resolve() == where and e.line == marked(marker)


def test_arrays_of_one_are_arrays():
    k_one_element_array.compile(spec(64, 64))


def test_tensor_map_strides_of_size_one_dims():
    from tk_mlir.runtime.tensor_maps import _byte_strides
    assert _byte_strides((4, 64, 32), (2048, 32, 1), 2) == [64, 4096]
    # torch's (1, K) view of a (K, 1) column: the size-1 dim's stride is 1 element
    assert _byte_strides((1, 200), (1, 1), 2) == [400]
    assert _byte_strides((1, 1, 8), (1, 1, 1), 2) == [16, 16]


def test_narrow_tiles_still_store_their_results():
    """BN below the epilogue width: the epilogue narrows to BN (it once stored nothing)."""
    compiled = gemm.gemm_kernel.kernel.compile(spec(512, 256), spec(512, 256), spec(512, 512),
                                               BN=64, STAGES=6)
    assert compiled.asm["ptx"].count("cp.async.bulk.tensor.2d.global.shared::cta") >= 1


@tk.kernel(num_warps=4)
def k_batched_tma(A: tk.gl[bf16], R: tk.constexpr = 1, C: tk.constexpr = 3,
                  ELEMENTS: tk.constexpr = False):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    s = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(s, a)
        tk.tma.load_async(a, A, (2, R, C), s, elements=ELEMENTS)     # batch 2, row R, column C
    tk.wait(s, 0)


def _box_coordinates(**constexprs) -> list[int]:
    """The element coordinates of k_batched_tma's load (on a (4, 256, 256)
    tensor), as the lowering passes them: innermost first."""
    text = k_batched_tma.compile(spec(4, 256, 256), **constexprs).asm["cse"]
    constants = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((-?\d+) : i32\)", text))
    (box,) = re.findall(r"cp\.async\.bulk\.tensor\.shared\.cluster\.global .*box\[([^\]]*)\]",
                        text)
    return [int(constants[v.strip()]) for v in box.split(",")]


def test_tma_coordinates_innermost_first_for_batched_tensors():
    """TMA wants element coordinates innermost dim first: (column, row, batch)."""
    assert _box_coordinates() == [3 * 64, 1 * 64, 2]


@tk.kernel(num_warps=4)
def k_element_tma(A: tk.gl[bf16], B: tk.gl[bf16], r: int, c: int, r2: int, c2: int):
    a = tk.shared_tile(bf16, (64, 64), swizzle=128)
    s = tk.semaphore()
    if tk.elect_leader("warpgroup"):
        tk.tma.expect(s, a)
        tk.tma.load_async(a, A, (r, c), s, elements=True)
    tk.wait(s, 0)
    if tk.elect_leader("warpgroup"):
        tk.tma.store_async(B, a, (r2, c2), elements=True)
        tk.tma.store_commit()
        tk.tma.store_wait(0, read=False)


def test_tma_element_coordinates_are_passed_unscaled():
    assert _box_coordinates(R=37, C=24, ELEMENTS=True) == [24, 37, 2]
    assert "elements = true" in k_batched_tma.compile(spec(4, 256, 256), C=8,
                                                       ELEMENTS=True).asm["tk"]


# Columns on 16-byte boundaries (8 bf16): the copy engine faults on any other.
ELEMENT_CORNERS = [(37, 8, 3, 16), (-3, -16, 70, 8), (90, 40, 0, 0)]


def _element_copy(r, c, r2, c2):
    """(A, B poisoned, B as the copy should leave it) for k_element_tma."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(r * 7 + c)
    A = torch.rand(100, 80, generator=g).to(torch.bfloat16)
    B = torch.full((96, 72), 7.0, dtype=torch.bfloat16)
    want = B.float().clone()
    padded = torch.zeros(100 + 2 * 64, 80 + 2 * 64)
    padded[64:164, 64:144] = A.float()
    tile = padded[64 + r:128 + r, 64 + c:128 + c]
    rows, cols = slice(max(r2, 0), min(r2 + 64, 96)), slice(max(c2, 0), min(c2 + 64, 72))
    want[rows, cols] = tile[rows.start - r2:rows.stop - r2, cols.start - c2:cols.stop - c2]
    return A, B, want


@pytest.mark.parametrize("r,c,r2,c2", ELEMENT_CORNERS)
def test_tma_at_element_coordinates_in_the_interpreter(r, c, r2, c2):
    """A tile loaded from any row and any 16-byte column group (zeros past
    every edge, above and left included) and stored at one (clipped at the
    edges), against numpy."""
    A, B, want = _element_copy(r, c, r2, c2)
    k_element_tma.interpret[(1,)](A, B, r, c, r2, c2)
    assert B.float().equal(want)


@pytest.mark.gpu
@pytest.mark.parametrize("r,c,r2,c2", ELEMENT_CORNERS)
def test_tma_at_element_coordinates_on_the_gpu(r, c, r2, c2):
    A, B, want = _element_copy(r, c, r2, c2)
    A, B = A.cuda(), B.cuda()
    k_element_tma[(1,)](A, B, r, c, r2, c2)
    assert B.float().cpu().equal(want)


@pytest.mark.parametrize("r,c,r2,c2,rule", [
    (0, 5, 0, 0, "column coordinate 5 is not on a 16-byte boundary"),
    (0, -6, 0, 0, "column coordinate -6 is not on a 16-byte boundary"),
    (0, 0, 0, 4, "column coordinate 4 is not on a 16-byte boundary"),
    (0, 0, 0, -8, "coordinate 1 of idx \\(0-based\\) is -8; TMA stores and reduce-adds must "
                  "not start at a negative coordinate"),
    (0, 0, -3, 0, "coordinate 0 of idx \\(0-based\\) is -3")])
def test_tma_starts_the_gpu_faults_on_are_errors_in_the_interpreter(r, c, r2, c2, rule):
    """The GPU faults (illegal instruction) on a column off 16 bytes and on a
    store at a negative coordinate; the interpreter names the line and the
    rule instead."""
    from tk_mlir.interpreter.machine import InterpretError
    A, B, _ = _element_copy(0, 0, 0, 0)
    with pytest.raises(InterpretError, match=rule) as e:
        k_element_tma.interpret[(1,)](A, B, r, c, r2, c2)
    assert "test_hopper.py" in str(e.value)


def test_tma_element_columns_known_at_compile_time_are_checked_there():
    @tk.kernel(num_warps=4)
    def k_constant_column(A: tk.gl[bf16]):
        a = tk.shared_tile(bf16, (64, 64), swizzle=128)
        s = tk.semaphore()
        tk.tma.expect(s, a)
        tk.tma.load_async(a, A, (3, 4), s, elements=True)
    with pytest.raises(tk.CompilationError, match="not on a 16-byte boundary") as e:
        k_constant_column.compile(spec(128, 128))
    assert "tk.tma.load_async(a, A, (3, 4)" in str(e.value)


def test_tma_writes_at_negative_constant_coordinates_are_compile_errors():
    """Tile coordinates too (a negative tile is a negative box start), and
    reduce-adds as stores."""
    @tk.kernel(num_warps=4)
    def k_negative_store(A: tk.gl[f32], ADD: tk.constexpr = False):
        a = tk.shared_tile(f32, (64, 32), swizzle=128)
        if ADD:
            tk.tma.reduce_add_async(A, a, (0, -4), elements=True)
        else:
            tk.tma.store_async(A, a, (-1, 0))
    with pytest.raises(tk.CompilationError, match="coordinate 0 of idx .* is -1") as e:
        k_negative_store.compile(spec(128, 128, dtype="f32"))
    assert "tk.tma.store_async(A, a, (-1, 0))" in str(e.value)
    with pytest.raises(tk.CompilationError, match="reduce_add_async: coordinate 1 of idx .* -4"):
        k_negative_store.compile(spec(128, 128, dtype="f32"), ADD=True)


def test_tma_elements_must_be_a_bool():
    @tk.kernel(num_warps=4)
    def k_elements_flag(A: tk.gl[bf16], e: int):
        a = tk.shared_tile(bf16, (64, 64), swizzle=128)
        s = tk.semaphore()
        tk.tma.load_async(a, A, (0, 0), s, elements=e)
    with pytest.raises(tk.CompilationError, match=r"elements must be True or False"):
        k_elements_flag.compile(spec(64, 64), 1)
