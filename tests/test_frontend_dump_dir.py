"""TK_MLIR_DUMP_DIR is a debugging aid: a folder that cannot be written (a
file, a read-only folder) warns and the compile goes on, stages intact."""
import os

import pytest

import tk_mlir as tk
from tk_mlir import f32


@tk.kernel
def dumped(X: tk.gl[f32], Y: tk.gl[f32]):
    tk.store(Y, tk.load(X, (tk.block_id(0), 0), (16, 64)) * 2.0, (tk.block_id(0), 0))


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path / "cache"))


def compile_with_dump_dir(path, monkeypatch):
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(path))
    x = tk.spec((64, 64), "f32")
    with pytest.warns(RuntimeWarning, match=f"TK_MLIR_DUMP_DIR={path}: cannot write the "
                                            f"stages there .*; compiling dumped without dumping"):
        compiled = dumped.compile(x, x)
    assert ".entry dumped" in compiled.asm["ptx"] and "tk.mul" in compiled.asm["tk"]


def test_dump_dir_that_is_a_file(tmp_path, monkeypatch):
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    compile_with_dump_dir(path, monkeypatch)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_dump_dir_read_only(tmp_path, monkeypatch):
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o500)
    try:
        compile_with_dump_dir(path, monkeypatch)
    finally:
        path.chmod(0o700)


def test_writable_dump_dir_gets_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(tmp_path / "dump"))
    x = tk.spec((64, 64), "f32")
    compiled = dumped.compile(x, x)
    (folder,) = (tmp_path / "dump").iterdir()
    names = sorted(p.name for p in folder.iterdir())
    assert len(names) == len(compiled.asm)
    assert names[0] == "00-python.py" and any(n.endswith("-ptx.ptx") for n in names)
