"""A disk cache entry whose manifest matches but whose content is not this
kernel's code is a miss: the entry is dropped with one warning, the kernel is
compiled again and a good entry published — never a raw decoding error, a
hang, or another kernel's code run as this one.

The kernel's source carries a random constant, so each run's keys are new.
"""
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import textwrap
import warnings
from pathlib import Path

import pytest

import tk_mlir as tk
from tk_mlir.toolchain import find_tool

pytestmark = [pytest.mark.skipif(find_tool("ptxas") is None,
                                 reason="the disk cache keeps only assembled kernels"),
              pytest.mark.usefixtures("cache_root")]     # (conftest.py) every test

RNG = random.Random()
FACTOR = RNG.choice([1.5, 2.0, 3.0, 0.25]) + RNG.randrange(1000)
N = RNG.choice([32, 64, 128])
SOURCE = textwrap.dedent(f"""\
    import tk_mlir as tk
    from tk_mlir import f32


    @tk.kernel
    def scale(X: tk.gl[f32], Y: tk.gl[f32], N: tk.constexpr):
        i = tk.block_id(0)
        tk.store(Y, tk.load(X, (i, 0), (16, N)) * {FACTOR}, (i, 0))


    @tk.kernel
    def other(X: tk.gl[f32], Y: tk.gl[f32], N: tk.constexpr):
        i = tk.block_id(0)
        tk.store(Y, tk.load(X, (i, 0), (16, N)) + {FACTOR}, (i, 0))
""")
X = tk.spec((RNG.randrange(1, 9) * 16, N), "f32")


@pytest.fixture
def kernel_file(tmp_path):
    path = tmp_path / "kernels.py"
    path.write_text(SOURCE)
    return path


_imports = 0


def load(path: Path):
    """A new module, so new Kernel objects: empty in-memory caches."""
    global _imports
    _imports += 1
    spec = importlib.util.spec_from_file_location(f"cache_damage_{_imports}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def entry_of(root: Path, kernel: str) -> Path:
    (found,) = [p for p in root.glob("*/*")
                if re.fullmatch(r"[0-9a-f]{64}", p.name)
                and json.loads((p / "meta.json").read_text())["name"] == kernel]
    return found


# ------------------------------------------------------------- damage kinds

def consistent(d: Path) -> None:
    """The manifest rewritten to match the files: only their content is wrong."""
    manifest = json.loads((d / ".manifest.json").read_text())
    for name, info in manifest["files"].items():
        data = (d / name).read_bytes()
        info.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (d / ".manifest.json").write_text(json.dumps(manifest))


def rewrite(d: Path, name: str, edit) -> None:
    (d / name).write_text(edit((d / name).read_text()))
    consistent(d)


def edit_meta(**changes):
    return lambda text: json.dumps(json.loads(text) | changes)


def bad_base64(text: str) -> str:
    stages = json.loads(text)
    name = next(n for n, v in stages.items() if isinstance(v, dict))
    stages[name] = {"mlirbc": "!!not base64!!"}
    return json.dumps(stages)


def replace(path: Path, make) -> None:
    data = path.read_bytes()
    path.unlink()
    make(path, data)


def symlink_to_copy(path: Path, data: bytes) -> None:
    copy = path.with_name("copy")
    copy.write_bytes(data)           # the right bytes: only the symlink is wrong
    path.symlink_to(copy)


def other_kernels_entry(d: Path, root: Path, rewrite_key: bool) -> None:
    """The other kernel's entry copied under this key; its manifest naming
    this key too when `rewrite_key` (only the kernel it holds tells)."""
    key = d.name
    shutil.rmtree(d)
    shutil.copytree(entry_of(root, "other"), d)
    if rewrite_key:
        manifest = json.loads((d / ".manifest.json").read_text())
        (d / ".manifest.json").write_text(json.dumps(manifest | {"key": key}))


DAMAGE = {
    "meta-empty-object": lambda d, r: rewrite(d, "meta.json", lambda t: "{}"),
    "meta-not-json": lambda d, r: rewrite(d, "meta.json", lambda t: t[:-7] + "garbage"),
    "meta-truncated": lambda d, r: rewrite(d, "meta.json", lambda t: t[: len(t) // 2]),
    "meta-wrong-types": lambda d, r: rewrite(d, "meta.json", edit_meta(num_warps="4")),
    "params-malformed": lambda d, r: rewrite(d, "meta.json", edit_meta(params=[["x"]])),
    "tensor-maps-malformed": lambda d, r: rewrite(d, "meta.json", edit_meta(tensor_maps=[1])),
    "no-kernel-identity": lambda d, r: rewrite(d, "meta.json", edit_meta(kernel=None)),
    "another-entry-point": lambda d, r: rewrite(d, "meta.json", edit_meta(name="other")),
    "another-target": lambda d, r: rewrite(d, "meta.json", edit_meta(arch="sm_100a")),
    "stages-bad-base64": lambda d, r: rewrite(d, "stages.json", bad_base64),
    "stages-not-object": lambda d, r: rewrite(d, "stages.json", lambda t: "[]"),
    "cubin-empty": lambda d, r: ((d / "cubin").write_bytes(b""), consistent(d)),
    "fifo-for-cubin": lambda d, r: replace(d / "cubin", lambda p, _: os.mkfifo(p)),
    "fifo-for-manifest": lambda d, r: replace(d / ".manifest.json", lambda p, _: os.mkfifo(p)),
    "symlink-for-stages": lambda d, r: replace(d / "stages.json", symlink_to_copy),
    "dir-for-meta": lambda d, r: replace(d / "meta.json", lambda p, _: p.mkdir()),
    "file-truncated": lambda d, r: (d / "cubin").write_bytes((d / "cubin").read_bytes()[:9]),
    "other-kernels-entry": lambda d, r: other_kernels_entry(d, r, rewrite_key=False),
    "other-kernel-under-this-key": lambda d, r: other_kernels_entry(d, r, rewrite_key=True),
}


def within(seconds: int, fn):
    """fn(), failing the test (not hanging it) when it blocks."""
    def blocked(*_):
        raise AssertionError(f"the compile blocked for {seconds} s")
    old = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_dropped_and_recompiled_with_one_warning(
        damage, kernel_file, cache_root, compiles):
    first = load(kernel_file)
    good = first.scale.compile(X, X, N=N)
    first.other.compile(X, X, N=N)
    assert compiles == ["scale", "other"]
    entry = entry_of(cache_root, "scale")
    DAMAGE[damage](entry, cache_root)

    with pytest.warns(RuntimeWarning, match="dropped a damaged compilation cache entry") as got:
        again = within(60, lambda: load(kernel_file).scale.compile(X, X, N=N))
    assert len([w for w in got if issubclass(w.category, RuntimeWarning)]) == 1
    assert compiles == ["scale", "other", "scale"]          # compiled again, as scale
    assert again.name == "scale" and again.cubin == good.cubin
    assert again.params == good.params and again.stages["tk"] == good.stages["tk"]

    with warnings.catch_warnings():                          # republished: a quiet hit
        warnings.simplefilter("error")
        hit = load(kernel_file).scale.compile(X, X, N=N)
    assert compiles == ["scale", "other", "scale"]
    assert hit.cubin == good.cubin and hit.stages["tk"] == good.stages["tk"]


def test_a_hit_with_an_unwritable_dump_dir_is_a_clear_error(kernel_file, monkeypatch):
    load(kernel_file).scale.compile(X, X, N=N)
    # Not writable even for root, whose os.access passes it.
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", f"/proc/tk_mlir-{RNG.randrange(1 << 30)}")
    with pytest.raises(tk.CompilationError, match=r"^TK_MLIR_DUMP_DIR: cannot write to '/proc/"):
        load(kernel_file).scale.compile(X, X, N=N)


def test_the_read_set_index_damaged_is_dropped(kernel_file, cache_root, compiles):
    good = load(kernel_file).scale.compile(X, X, N=N)
    (index,) = [p for p in (cache_root / "reads").glob("*/*") if p.is_dir()]
    rewrite(index, "reads.json", lambda t: "{not json")
    with pytest.warns(RuntimeWarning, match="dropped a damaged") as got:
        again = load(kernel_file).scale.compile(X, X, N=N)
    assert len(got) == 1 and again.cubin == good.cubin and compiles == ["scale", "scale"]
