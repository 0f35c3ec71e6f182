"""TK_MLIR_DUMP_DIR gets one file per stage (a folder that cannot be written is
refused before anything is written: tests/test_runtime_checks.py)."""
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


def test_writable_dump_dir_gets_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(tmp_path / "dump"))
    x = tk.spec((64, 64), "f32")
    compiled = dumped.compile(x, x)
    (folder,) = (tmp_path / "dump").iterdir()
    names = sorted(p.name for p in folder.iterdir())
    assert len(names) == len(compiled.asm)
    assert names[0] == "00-python.py" and any(n.endswith("-ptx.ptx") for n in names)


def test_a_dump_dir_set_after_the_first_compile_still_dumps(tmp_path, monkeypatch):
    """Knobs are read when used: code kept in memory from before
    TK_MLIR_DUMP_DIR was set is dumped by the next compile() too."""
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE")
    x = tk.spec((32, 64), "f32")
    first = dumped.compile(x, x)
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(tmp_path / "later"))
    assert dumped.compile(x, x) is first                  # (kept in memory)
    (folder,) = (tmp_path / "later").iterdir()
    assert len(list(folder.iterdir())) == len(first.asm)


def test_compile_in_a_loop_writes_each_stage_once(tmp_path, monkeypatch):
    """kernel.compile called again for the same code does not write its stages
    again (nvdisasm's SASS among them), unless the folder went away."""
    from tk_mlir import dumps
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE")
    monkeypatch.setenv("TK_MLIR_DUMP_DIR", str(tmp_path / "dump"))
    x = tk.spec((16, 64), "f32")
    first = dumped.compile(x, x)
    (folder,) = (tmp_path / "dump").iterdir()
    writes = []
    real = dumps.write_stage
    monkeypatch.setattr(dumps, "write_stage", lambda *a, **k: writes.append(a) or real(*a, **k))
    import tk_mlir.compiled as compiled_module
    monkeypatch.setattr(compiled_module, "write_stage", dumps.write_stage)
    for _ in range(3):
        assert dumped.compile(x, x) is first
    assert writes == [] and len(list(folder.iterdir())) == len(first.asm)
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    dumped.compile(x, x)                    # (the folder was removed: written again)
    assert len(writes) == len(first.asm) and len(list(folder.iterdir())) == len(first.asm)
