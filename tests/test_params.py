"""One description of a kernel's parameters (tk_mlir/params.py): binding
(and its messages), annotation errors at the parameter, the specialization
key's messages, the ABI parameters' launch values."""
import traceback
from pathlib import Path

import pytest
import torch

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.compiled import CompiledKernel
from tk_mlir.launcher import launch_value_code, launch_values_function
from tk_mlir.params import CONSTEXPR, F32, GL, I32, AbiParam
from tk_mlir.runtime.arguments import TensorInfo

from markers import marked

HERE = Path(__file__).resolve()
X = tk.spec((64, 64), "f32")


@tk.kernel(num_warps=4)
def scale(X: tk.gl[f32], Y: tk.gl[f32], s: float, n: int, N: tk.constexpr = 64):
    i = tk.block_id(0)
    tk.store(Y, tk.load(X, (i, 0), (16, N)) * s, (i, 0))


def test_the_parameters_are_typed():
    assert [(p.name, p.kind) for p in scale.params] == \
        [("X", GL), ("Y", GL), ("s", F32), ("n", I32), ("N", CONSTEXPR)]
    assert scale.params[0].dtype == "f32" and scale.params[4].default == 64
    assert scale.params.runtime == [0, 1, 2, 3] and scale.params.constexprs == [4]


def test_bind_fills_defaults_keywords_and_num_warps():
    values, warps = scale.params.bind((1, 2), {"s": 3.0, "n": 4, "num_warps": 8})
    assert values == [1, 2, 3.0, 4, 64] and warps == 8
    assert scale.params.bind((1, 2, 3.0, 4, 32), {}) == ([1, 2, 3.0, 4, 32], 4)


@tk.kernel(num_warps=4)
def rows(X: tk.gl[f32], BLOCK: tk.constexpr = 32):
    tk.store(X, tk.load(X, (0, 0), (16, BLOCK)) * 2.0, (0, 0))


def test_a_misspelled_keyword_is_named_with_a_suggestion():
    with pytest.raises(tk.ArgumentError) as info:
        scale.compile(X, X, 2.0, 1, NN=64)
    message = str(info.value)
    assert "'NN'" in message and "did you mean 'N'?" in message
    assert "missing" not in message
    with pytest.raises(tk.ArgumentError, match="did you mean 'num_warps'"):
        scale.compile(X, X, 2.0, 1, num_warp=8)
    with pytest.raises(tk.ArgumentError, match="'block' \\(did you mean 'BLOCK'\\?\\)"):
        rows.compile(X, block=64)                  # (case only: difflib alone misses it)


def test_missing_and_doubled_arguments():
    with pytest.raises(tk.ArgumentError, match=r"scale\(\) missing arguments 's', 'n'"):
        scale.compile(X, X)
    with pytest.raises(tk.ArgumentError, match="two values for 'X'"):
        scale.compile(X, X, 2.0, 1, X=X)
    with pytest.raises(tk.ArgumentError, match=r"takes 5 arguments \(X, Y, s, n, N\), got 6"):
        scale.compile(X, X, 2.0, 1, 64, 7)


def test_a_tensor_for_a_scalar_is_described_not_printed():
    big = torch.zeros(512, 512, dtype=torch.bfloat16)
    with pytest.raises(tk.ArgumentError) as info:
        scale.compile(X, X, big, 1)
    message = str(info.value)
    assert message == ("argument 's' must be a float, got a torch.Tensor of shape (512, 512) "
                       "bf16 on cpu")
    with pytest.raises(tk.ArgumentError, match="argument 'n' must be an int, got a torch.Tensor"):
        scale.compile(X, X, 1.0, big)


def test_numpy_and_torch_scalars_are_refused_with_the_conversion():
    """Scalars are Python numbers (a kernel's key tells int from float): a
    numpy or 0-d torch scalar, for a run-time scalar or a constexpr, is
    refused at the call with the conversion, not later inside the kernel."""
    import numpy as np
    hint = r"convert numpy and torch scalars with int\(x\) or float\(x\)"
    for s, n in ((np.float32(2.0), 1), (2.0, np.int64(1)), (2.0, np.int32(1)),
                 (torch.tensor(2.0), 1), (2.0, torch.tensor(1))):
        with pytest.raises(tk.ArgumentError, match=hint):
            scale.compile(X, X, s, n)
    for n in (np.int64(64), torch.tensor(64), np.array(64)):
        with pytest.raises(tk.ArgumentError, match=r"constexpr 'N' = .* must be a Python value "
                                                   r".*int\(x\)"):
            scale.compile(X, X, 2.0, 1, N=n)
    with pytest.raises(tk.ArgumentError, match=hint):           # (a float subclass, too)
        scale.compile(X, X, np.float64(2.0), 1)


# ------------------------------------------------- annotation errors at the parameter

def _decoration_error(make) -> tk.CompilationError:
    with pytest.raises(tk.CompilationError) as info:
        make()
    return info.value


def test_a_missing_annotation_points_at_the_parameter():
    def make():
        @tk.kernel
        def k(X: tk.gl[f32],
              Y):  # E:params-missing
            pass
    e = _decoration_error(make)
    line, text = marked(HERE, "params-missing")
    assert (Path(e.filename).resolve(), e.line, e.col) == (HERE, line, text.index("Y"))
    assert "kernel parameter 'Y' needs an annotation" in e.message


def test_an_unknown_annotation_points_at_it():
    def make():
        @tk.kernel
        def k(X: tk.gl[f32],
              Y: str):  # E:params-unknown
            pass
    e = _decoration_error(make)
    line, text = marked(HERE, "params-unknown")
    assert (e.line, e.col) == (line, text.index("str"))
    assert e.message.endswith("got <class 'str'>")


def test_a_bad_dtype_points_at_the_annotation():
    def make():
        @tk.kernel
        def k(X: tk.gl[f32],
              Y: tk.gl["f64"]):  # E:params-dtype
            pass
    e = _decoration_error(make)
    line, text = marked(HERE, "params-dtype")
    assert (e.line, e.col) == (line, text.index("tk.gl"))
    assert e.message.startswith("kernel parameter 'Y': expected a tk dtype")
    assert str(e).splitlines()[-1].strip() == "^"


# ------------------------------------------------------------ TK_MLIR_DEBUG

@tk.kernel(num_warps=4)
def broken(X: tk.gl[f32]):
    tk.store(X, tk.load(X, (0, 0), (16, 64)) + tk.zeros((16, 128)), (0, 0))


def _tk_files(e) -> set[str]:
    return {Path(f.filename).name for f in traceback.extract_tb(e.__traceback__)
            if "tk_mlir" in f.filename or "/lowering/" in f.filename or "/passes/" in f.filename}


def test_debug_keeps_the_full_traceback(monkeypatch):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    with pytest.raises(tk.CompilationError) as cut:
        broken.compile(X)
    assert _tk_files(cut.value) <= {"kernel.py"}
    monkeypatch.setenv("TK_MLIR_DEBUG", "1")
    with pytest.raises(tk.CompilationError) as full:
        broken.compile(X)
    assert len(_tk_files(full.value) - {"kernel.py"}) >= 2     # the compiler's own frames


# -------------------------------------------------------------- ABI level

def test_abi_params_are_the_disk_entry_tuples():
    p = AbiParam(1, "stride", 0)
    assert p == (1, "stride", 0) and p.passed_as == "i64"
    compiled = scale.compile(X, X, 2.0, 1)
    again = CompiledKernel.from_entry(compiled.to_entry())
    assert again.params == compiled.params and all(isinstance(p, AbiParam) for p in again.params)


@tk.kernel
def κ(X: tk.gl[tk.f32]):
    """A kernel whose Python name is not its PTX entry point's."""
    tk.store(X, tk.load(X, (0, 0), (16, 64)) * 2.0, (0, 0))


def test_a_disk_entry_of_a_kernel_with_a_mangled_entry_point_is_its_own():
    """The entry check compares the stored entry point with the kernel's
    name as PTX spells it (a non-ASCII name is mangled): not a miss forever."""
    from tk_mlir.toolchain import find_tool
    if find_tool("ptxas") is None:
        pytest.skip("a disk entry holds a cubin")
    compiled = κ.compile(tk.spec((16, 64), "f32"))
    identity = {"name": "κ", "source_sha256": "0" * 64}
    assert compiled.name != "κ"
    again = CompiledKernel.from_entry(compiled.to_entry(identity), identity, compiled.arch)
    assert again.name == compiled.name


def test_launch_values_follow_the_abi():
    compiled = scale.compile(X, X, 2.0, 1)
    infos = {j: TensorInfo(0x1000 * (j + 1), (64 + j, 64), (64, 1), "f32", "cuda:0", 4)
             for j in (0, 1)}
    values = compiled.launch_values([None, None, 2.5, 7], infos)
    by_kind = list(zip([p.kind for p in compiled.params], values))
    assert by_kind[0] == ("ptr", 0x1000) and ("f32", 2.5) in by_kind and ("i32", 7) in by_kind
    want = {"ptr": lambda i, d: infos[i].ptr, "dim": lambda i, d: infos[i].shape[d],
            "stride": lambda i, d: infos[i].strides[d]}
    for p, v in zip(compiled.params, values):
        if p.kind in want:
            assert v == want[p.kind](p.arg, p.index), p
    fn = launch_values_function([AbiParam(0, "i32"), AbiParam(1, "ptr")], [])
    assert fn([5, None], {1: infos[1]}) == (5, 0x2000)


def test_tensor_map_values_come_from_the_map_cache():
    from tk_mlir.runtime.tensor_maps import CACHE
    env = {}
    abi = [AbiParam(0, "ptr"), AbiParam(0, "stride", 0), AbiParam(1, "f32"), AbiParam(0, "tmap", 0)]
    code = launch_value_code(abi, ["x", "s"], [(0, 64, 32, 128, "bf16")], env)
    assert code == ["x_ptr", "x_strides[0]", "s", "tensor_map(x_ptr, x_shape, x_strides, *TMAP0)"]
    assert env["TMAP0"] == ("bf16", 2, (64, 32, 128)) and env["tensor_map"] == CACHE.get
