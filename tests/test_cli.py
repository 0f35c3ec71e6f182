"""`python -m tk_mlir compile ...`: compile-only, no GPU needed."""
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.cli import main
from tk_mlir.toolchain import find_tool

ROOT = Path(__file__).resolve().parents[1]
NORMS = ROOT / "tk_mlir" / "kernels" / "norms.py"
RMSNORM = f"{NORMS}::rmsnorm_kernel"
RMSNORM_ARGS = ["--arg", "bf16[256,4096]", "--arg", "bf16[4096]", "--arg", "bf16[256,4096]",
                "--arg", "1e-6", "--const", "BLOCK=4096"]
SOFTMAX = f"{ROOT / 'examples' / 'quickstart.py'}::softmax"
SOFTMAX_CALL = [SOFTMAX, "--arg", "f32[1000,512]", "--arg", "f32[1000,512]",
                "--const", "ROWS=4", "--const", "N=512"]

BAD_KERNEL = """\
import tk_mlir as tk
from tk_mlir import f32


@tk.kernel
def looping(X: tk.gl[f32], Y: tk.gl[f32], N: tk.constexpr):
    i = tk.block_id(0)
    while i < N:
        i = i + 1
    tk.store(Y, tk.load(X, (0, 0), (16, 16)), (0, 0))
"""


def run(capsys, *argv):
    code = main(["compile", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_summary_lists_stages_and_ptxas_info(capsys):
    code, out, err = run(capsys, RMSNORM, *RMSNORM_ARGS)
    assert code == 0, err
    listed = re.findall(r"^  (\d\d) +(\d+) lines  (\S+)$", out, re.M)
    names = [name for _, _, name in listed]
    assert {"python", "tk", "ptx", "ptxas"} <= set(names)
    if find_tool("nvdisasm"):
        assert "sass" in names
    assert [int(i) for i, _, _ in listed] == list(range(len(listed)))
    assert re.search(r"^  registers +\d+$", out, re.M) and re.search(r"^  threads +256$", out, re.M)
    assert re.search(r"^  blocks per SM +\d+$", out, re.M)


def test_summary_flag_prints_the_kernel_summary_only(capsys):
    code, out, err = run(capsys, RMSNORM, *RMSNORM_ARGS, "--summary")
    assert code == 0, err
    assert out.splitlines()[0].startswith("registers ") and "stages" not in out
    assert re.search(r"^instructions \(SASS, static\) ", out, re.M) or not find_tool("nvdisasm")
    assert re.search(r"^ptxas warnings +", out, re.M)


def test_list_stages_prints_only_names(capsys):
    code, out, _ = run(capsys, RMSNORM, *RMSNORM_ARGS, "--list-stages")
    assert code == 0
    names = out.splitlines()
    assert names[:2] == ["python", "tk"] and "ptx" in names
    assert ("sass" in names) == bool(find_tool("nvdisasm"))


def test_stage_prints_full_text(capsys):
    code, out, _ = run(capsys, RMSNORM, *RMSNORM_ARGS, "--stage", "ptx")
    assert code == 0
    assert ".entry rmsnorm_kernel" in out and ".target sm_90a" in out
    assert "==>" not in out                      # one stage: its text alone
    code, out, _ = run(capsys, RMSNORM, *RMSNORM_ARGS, "--stage", "0", "--stage", "tk")
    assert code == 0
    assert "==> python <==" in out and "==> tk <==" in out
    assert "def rmsnorm_kernel" in out and "tk.block_id" in out


def test_unknown_stage_lists_the_stages(capsys):
    code, _, err = run(capsys, RMSNORM, *RMSNORM_ARGS, "--stage", "nope")
    assert code == 2
    assert "nope" in err and "python, tk," in err and "ptx" in err


def test_dump_dir_writes_numbered_files(capsys, tmp_path):
    code, out, _ = run(capsys, RMSNORM, *RMSNORM_ARGS, "--dump-dir", str(tmp_path))
    assert code == 0
    folder = tmp_path / "rmsnorm_kernel"
    assert str(folder) in out
    files = sorted(p.name for p in folder.iterdir())
    assert files[:2] == ["00-python.py", "01-tk.mlir"]
    assert any(f.endswith(".ptx") for f in files)
    assert [int(f[:2]) for f in files] == list(range(len(files)))


def test_html_writes_a_standalone_page(capsys, tmp_path):
    page = tmp_path / "rmsnorm.html"
    code, out, _ = run(capsys, RMSNORM, *RMSNORM_ARGS, "--html", str(page))
    assert code == 0 and str(page) in out
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert "<details" in text and 'data-stage="ptx"' in text


def test_quickstart_softmax_by_name_with_num_warps(capsys):
    code, out, err = run(capsys, SOFTMAX, "--arg", "Y=f32[1000,512]", "--arg", "X=f32[1000,512]",
                         "--const", "ROWS=4", "--const", "N=512", "--num-warps", "8")
    assert code == 0, err
    assert out.startswith("softmax: ") and re.search(r"^  threads +256$", out, re.M)


def test_sibling_import_and_kernel_listing(capsys, tmp_path):
    (tmp_path / "kernels_here.py").write_text(BAD_KERNEL)
    (tmp_path / "uses_sibling.py").write_text("from kernels_here import looping as renamed\n"
                                              "def helper(): pass\n")
    code, _, err = run(capsys, f"{tmp_path / 'uses_sibling.py'}::nope")
    assert code == 2 and "'nope'" in err and "kernels in it are: renamed" in err
    code, _, err = run(capsys, f"{tmp_path / 'uses_sibling.py'}::helper")
    assert code == 2 and "not a @tk.kernel" in err and "renamed" in err
    code, _, err = run(capsys, str(tmp_path / "uses_sibling.py"))
    assert code == 2 and "FILE.py::KERNEL" in err and "renamed" in err


def test_missing_kernel_lists_the_kernels(capsys):
    code, _, err = run(capsys, f"{NORMS}::rms", *RMSNORM_ARGS)
    assert code == 2
    assert "'rms'" in err and "rmsnorm_kernel" in err


@pytest.mark.parametrize("args, named, expected", [
    (["--arg", "bf16[256,4096"], "--arg X", "DTYPE[D0,D1,...]"),
     (["--arg", "bf17[4,8]"], "--arg X", "DTYPE[D0,D1,...]"),
     (["--arg", "bf16[4,8]", "--arg", "bf16[8]", "--arg", "bf16[4,8]", "--arg", "tiny"],
      "--arg eps", "a float"),
     (["--arg", "W=7"], "--arg W", "DTYPE[D0,D1,...]"),
     (["--arg", "bf16[4,8]"], "missing --arg W", "--const BLOCK"),
     (RMSNORM_ARGS + ["--const", "BLOK=4"], "'BLOK'", "--const BLOCK"),
     (RMSNORM_ARGS + ["--num-warps", "3"], "num_warps", "power of two"),
])
def test_bad_arguments_exit_2(capsys, args, named, expected):
    code, out, err = run(capsys, RMSNORM, *args)
    assert code == 2 and out == ""
    assert named in err and expected in err and "Traceback" not in err


@pytest.mark.parametrize("args, named, expected", [
    (["--arg", "f32[4,8]"], "--arg A", "the kernel annotates it tk.gl[bf16], got f32"),
    (["--arg", "Z=bf16[4]"], "'Z'", "takes --arg A (bf16 tensor), B (bf16 tensor)"),
])
def test_bad_arguments_to_a_kernel_of_typed_tensors_exit_2(capsys, args, named, expected):
    """A tensor parameter annotated with its dtype (examples/fused_elementwise.py's
    swiglu_kernel: tk.gl[bf16]) refuses another, and the usage names the dtypes."""
    code, out, err = run(capsys, f"{ROOT / 'examples' / 'fused_elementwise.py'}::swiglu_kernel",
                         *args)
    assert code == 2 and out == ""
    assert named in err and expected in err and "Traceback" not in err


def test_arg_takes_every_dtype_a_kernel_argument_holds(capsys):
    """--arg reads dtypes.py's ARGUMENT_DTYPES: the i32 counters too."""
    written = f"{ROOT / 'tk_mlir' / 'kernels' / 'ag_gemm.py'}::written_kernel"
    code, out, err = run(capsys, written, "--arg", "i32[2,4]x2", "--arg", "i32[4]", "--summary")
    assert code == 0, err
    code, _, err = run(capsys, RMSNORM, "--arg", "f64[4,8]")
    assert code == 2 and "(DTYPE: bf16, f16, f32, f8e4m3, f8e5m2, i32)" in err


def test_compilation_error_subprocess(tmp_path):
    """The one real process: exit 1, the error at the kernel's source, no traceback."""
    bad = tmp_path / "bad_kernel.py"
    bad.write_text(BAD_KERNEL)
    proc = subprocess.run(
        [sys.executable, "-m", "tk_mlir", "compile", f"{bad}::looping",
         "--arg", "f32[16,16]", "--arg", "f32[16,16]", "--const", "N=4"],
        cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert f"{bad}:8:5: error:" in proc.stderr and "while" in proc.stderr
    assert "\n        ^" in proc.stderr                    # the caret under `while`
    assert "Traceback" not in proc.stderr


def test_compilation_error_in_process(capsys, tmp_path):
    bad = tmp_path / "bad_kernel2.py"
    bad.write_text(BAD_KERNEL)
    code, out, err = run(capsys, f"{bad}::looping", "--arg", "f32[16,16]", "--arg", "f32[16,16]",
                         "--const", "N=4")
    assert code == 1 and out == ""
    assert f"{bad}:8:5" in err and "^" in err and "Traceback" not in err


def test_autotuned_kernel_compiles_from_the_shell(capsys):
    """FILE::NAME may name a @tk.autotune'd kernel: the CLI compiles the kernel
    it tunes, with the defaults or --const values."""
    gemm = str(ROOT / "tk_mlir" / "kernels" / "gemm.py") + "::gemm_kernel"
    code, out, err = run(capsys, gemm, "--arg", "bf16[512,256]", "--arg", "bf16[512,256]",
                         "--arg", "bf16[512,512]", "--const", "STAGES=3", "--stage", "ptxas")
    assert code == 0, err
    assert "Compiling entry function 'gemm_kernel' for 'sm_90a'" in out


def test_html_into_a_missing_folder_is_a_usage_error(capsys, tmp_path):
    target = tmp_path / "nowhere" / "out.html"
    code, out, err = run(capsys, SOFTMAX_CALL[0], *SOFTMAX_CALL[1:], "--html", str(target))
    assert code == 2 and "Traceback" not in err
    assert f"--html: the folder '{target.parent}' does not exist" in err
    assert not target.parent.exists()


def test_dump_dir_onto_a_file_is_a_usage_error(capsys, tmp_path):
    file = tmp_path / "taken"
    file.write_text("")
    code, out, err = run(capsys, SOFTMAX_CALL[0], *SOFTMAX_CALL[1:], "--dump-dir", str(file))
    assert code == 2 and "Traceback" not in err
    assert "--dump-dir: cannot write to" in err and "is a file, not a folder" in err


def test_dump_dir_that_cannot_be_made_is_a_usage_error(capsys):
    # /proc refuses new folders even to root, whose permission checks all pass.
    impossible = f"/proc/tk_mlir-{random.randrange(1 << 30)}/dump"
    code, out, err = run(capsys, *SOFTMAX_CALL, "--dump-dir", impossible)
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"tk-mlir compile: error: --dump-dir: cannot write to '{impossible}'")
    assert not out


def test_dump_dir_that_fails_while_dumping_is_a_usage_error(capsys, tmp_path, monkeypatch):
    """The folder passes the check before compiling, then the disk fills: a
    usage error, and no cut-off stage file (nor temp file) left behind."""
    from tk_mlir import dumps
    write_whole = dumps._write_whole

    def full(path, text):
        write_whole(path, text[:len(text) // 2])         # what a full disk leaves ...
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(dumps, "_write_whole", full)
    code, out, err = run(capsys, *SOFTMAX_CALL, "--dump-dir", str(tmp_path / "dump"))
    assert code == 2 and "Traceback" not in err
    assert "--dump-dir: cannot write python to" in err and "No space left on device" in err


def test_a_stage_file_is_whole_or_absent(tmp_path, monkeypatch):
    """dumps._write_whole writes through a temp file renamed into place: a
    write that fails half-way leaves neither a cut-off stage nor the temp."""
    from tk_mlir import dumps

    class Full:
        """A file on a disk that fills half-way through the write."""
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:len(text) // 2])
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(dumps, "open", Full, raising=False)
    with pytest.raises(OSError):
        dumps._write_whole(tmp_path / "00-python.py", "x" * 100)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    dumps._write_whole(tmp_path / "00-python.py", "x")
    plain = tmp_path / "plain"
    plain.write_text("x")                      # the mode any new file gets here
    assert (tmp_path / "00-python.py").stat().st_mode == plain.stat().st_mode


def test_debug_reraises_with_the_traceback(monkeypatch, tmp_path):
    file = tmp_path / "taken"
    file.write_text("")
    monkeypatch.setenv("TK_MLIR_DEBUG", "1")
    from tk_mlir.cli import UsageError
    with pytest.raises(UsageError):
        main(["compile", *SOFTMAX_CALL, "--dump-dir", str(file)])


def test_a_misspelled_const_is_named_with_a_suggestion(capsys):
    code, out, err = run(capsys, *SOFTMAX_CALL[:-1], "NN=512")
    assert code == 2
    assert "--const NN: no tk.constexpr parameter 'NN' (did you mean 'N'?)" in err


def test_short_prints_tk_stages_in_short(capsys):
    code, out, err = run(capsys, *SOFTMAX_CALL, "--stage", "tk", "--short")
    assert code == 0, err
    assert out.startswith("// quickstart.py\n")
    assert re.search(r"^ *\d+ │   %\d+ = tk\.sub_row %\d+, %\d+ : rt<f32, 4x512>$", out, re.M)
    assert "loc(" not in out and '"tk.' not in out
    code, _, err = run(capsys, *SOFTMAX_CALL, "--short")
    assert code == 2 and "--short" in err and "--stage" in err
    code, _, err = run(capsys, *SOFTMAX_CALL, "--stage", "ptx", "--short")   # as c.asm.short
    assert code == 2 and "ptx has no short form" in err


def test_a_line_past_the_files_end_is_refused_as_lines_refuses_it(capsys):
    code, _, err = run(capsys, *SOFTMAX_CALL, "--stage", "sass", "--line", "9999")
    assert code == 2 and re.search(r"--line 9999: lines: \S+ has \d+ lines, not 9999", err), err


def test_a_name_that_is_no_kernel_is_called_what_it_is(capsys):
    """A module (whose .kernel attribute is tk's decorator) is called a module."""
    code, _, err = run(capsys, SOFTMAX_CALL[0].split("::")[0] + "::tk", "--arg", "f32[4]")
    assert code == 2 and "'tk' in " in err and "is a module, not a @tk.kernel" in err, err


def test_line_of_a_helper_module_the_kernel_calls(capsys):
    """--line FILE:N: a line of a user's helper module (tests/kernel_helpers.py,
    called from tests/test_short_form.py's kernel) keeps its own lines."""
    target = f"{ROOT / 'tests' / 'test_short_form.py'}::uses_a_helper_module"
    code, out, err = run(capsys, target, "--arg", "f32[16,64]", "--arg", "f32[16,64]",
                         "--line", "kernel_helpers.py:8")
    assert code == 0, err
    assert out.startswith(f"{ROOT / 'tests' / 'kernel_helpers.py'}:8: return (x * s).exp()")
    assert "tk.exp %" in out and "ex2.approx" in out


def test_line_takes_a_path_relative_to_the_working_folder(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    target = f"{ROOT / 'tests' / 'test_short_form.py'}::uses_a_helper_module"
    code, out, err = run(capsys, target, "--arg", "f32[16,64]", "--arg", "f32[16,64]",
                         "--line", "tests/kernel_helpers.py:8")
    assert code == 0, err
    assert out.startswith(f"{ROOT / 'tests' / 'kernel_helpers.py'}:8:")


# ------------------------------------------------------------------ cache

def cache_run(capsys, *argv):
    code = main(["cache", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cache_with_entries(tmp_path, monkeypatch):
    import os
    import time
    from tk_mlir.cache import DiskCache, make_key
    root = tmp_path / "cache"
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(root))
    monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", "500M")
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE", raising=False)
    disk = DiskCache()
    for i, age in enumerate((10, 3 * 86400, 8 * 86400)):
        key = make_key(cli=os.urandom(8).hex())
        disk.put(key, {"cubin": os.urandom(2048 * (i + 1))})
        used = time.time() - age
        os.utime(disk.path(key) / ".manifest.json", (used, used))
    return root


def test_cache_info(capsys, cache_with_entries):
    code, out, err = cache_run(capsys, "info")
    assert code == 0, err
    assert f"folder   {cache_with_entries} (TK_MLIR_CACHE_DIR)" in out
    assert re.search(r"^entries  3$", out, re.M)
    assert re.search(r"^size     1[23]\.\d KiB$", out, re.M)
    assert re.search(r"^cap      500\.0 MiB \(TK_MLIR_CACHE_MAX_SIZE", out, re.M)


def test_cache_clean_older_than_then_all(capsys, cache_with_entries):
    code, out, _ = cache_run(capsys, "clean", "--older-than", "2d")
    assert code == 0 and re.match(r"removed 2 entries \(10\.\d KiB\) from ", out)
    code, out, _ = cache_run(capsys, "clean")
    assert code == 0 and out.startswith("removed 1 entries")
    _, out, _ = cache_run(capsys, "info")
    assert re.search(r"^entries  0$", out, re.M)


@pytest.mark.parametrize("argv, message", [
    (["clean", "--older-than", "3 weeks"], "--older-than 3 weeks: expected an age such as"),
    (["info"], "TK_MLIR_CACHE_MAX_SIZE='lots': expected a size in bytes"),
])
def test_cache_usage_errors(capsys, cache_with_entries, monkeypatch, argv, message):
    if argv == ["info"]:
        monkeypatch.setenv("TK_MLIR_CACHE_MAX_SIZE", "lots")
    code, out, err = cache_run(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"tk-mlir cache: error: {message}")


@pytest.mark.parametrize("command", ["info", "clean"])
def test_cache_commands_say_when_the_folder_is_a_file_or_missing(capsys, tmp_path,
                                                                 monkeypatch, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a cache")
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(blocker))
    code, out, err = cache_run(capsys, command)
    assert code == 2 and "is a file, not a folder" in err
    monkeypatch.setenv("TK_MLIR_CACHE_DIR", str(tmp_path / "none"))
    code, out, err = cache_run(capsys, command)
    assert code == 0 and "(missing: nothing cached yet)" in out


def test_cache_command_runs_as_a_module(cache_with_entries):
    import os
    done = subprocess.run([sys.executable, "-m", "tk_mlir", "cache", "info"], capture_output=True,
                          text=True, env=dict(os.environ), cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "entries  3" in done.stdout


@pytest.mark.parametrize("source, message", [
    ("import tk_mlir as tk\ndef f(:\n    pass\n", r"bad\.py:2:\d+: SyntaxError: "),
    ("x = 1\nraise ValueError('boom')\n", r"bad\.py:2: ValueError: boom \(while importing bad\.py\)"),
    ("import no_such_module_xyz\n", r"bad\.py:1: ModuleNotFoundError: No module named"),
])
def test_a_file_that_fails_to_import_is_one_line_at_its_line(capsys, tmp_path, monkeypatch,
                                                             source, message):
    monkeypatch.delenv("TK_MLIR_DEBUG", raising=False)
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    code, out, err = run(capsys, f"{bad}::k")
    assert code == 1 and re.search(message, err) and len(err.strip().splitlines()) == 1, err


def test_a_bad_knob_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "maybe")
    code, out, err = run(capsys, *SOFTMAX_CALL)
    assert code == 2 and "Traceback" not in err
    assert "TK_MLIR_ALWAYS_COMPILE='maybe': expected 1, true" in err


def test_a_kernel_file_that_exits_at_import_says_so(capsys, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.exit(0)\n")
    code, out, err = run(capsys, f"{script}::k", "--arg", "f32[4]")
    assert code == 1
    assert "exited while being imported (SystemExit(0))" in err and "__main__" in err


def test_a_new_compile_replaces_the_stage_files_of_the_last(capsys, tmp_path):
    """One dump folder per (kernel, specialization): a later compile's stages
    replace the earlier ones', none left from before (here a stage the new
    compile does not make)."""
    code, _, err = run(capsys, *SOFTMAX_CALL, "--dump-dir", str(tmp_path))
    assert code == 0, err
    (folder,) = tmp_path.iterdir()
    (folder / "99-gone.mlir").write_text("from an older compile")
    code, _, err = run(capsys, *SOFTMAX_CALL, "--dump-dir", str(tmp_path))
    assert code == 0, err
    assert not (folder / "99-gone.mlir").exists() and (folder / "00-python.py").exists()


def test_an_empty_dump_dir_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["compile", *SOFTMAX_CALL, "--dump-dir", ""])
    assert info.value.code == 2
    assert "an empty path (write . for the working folder)" in capsys.readouterr().err


needs_nvdisasm = pytest.mark.skipif(find_tool("nvdisasm") is None, reason="nvdisasm is not installed")


@tk.kernel(num_warps=4)
def mma_loop(A: tk.gl[tk.bf16], n: int):
    a = tk.shared_tile(tk.bf16, (64, 64), swizzle=128)     # (compiled only: never filled)
    acc = tk.zeros((64, 64), f32, layout="row", scope="warpgroup")
    for _ in range(n):
        acc = tk.mma_ABt(acc, a, a)
        tk.mma_wait(0)
    tk.store(A, acc.to(tk.bf16), (0, 0))


@needs_nvdisasm
def test_sass_reads_the_loops_of_a_cubin(capsys, tmp_path):
    """`sass FILE.cubin` on a kernel's cubin (a peer's reads the same way):
    the mix, and each loop that issues MMAs with its opcodes by count."""
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(mma_loop.compile(tk.spec((64, 64), tk.bf16), 4).cubin)
    assert main(["sass", str(cubin), "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("k.cubin: ") and "HGMMA" in out[0]
    assert out[1] == "loops with MMAs or spills:"
    assert re.match(r"  \S+: \d+ instructions, [1-9]\d* MMA, \d+ moves, 0 LDL/STL$", out[2])
    assert len(out[3].split(", ")) == 3 and re.match(r"      [A-Z]", out[3])


def test_sass_of_a_missing_or_broken_cubin(capsys, tmp_path):
    assert main(["sass", str(tmp_path / "none.cubin")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "kernel.py").write_text("import tk_mlir\n")       # (not a cubin at all)
    assert main(["sass", str(tmp_path / "kernel.py")]) == 2
    assert "kernel.py: not a cubin (an ELF file" in capsys.readouterr().err
    if find_tool("nvdisasm") is not None:
        (tmp_path / "bad.cubin").write_bytes(b"\x7fELF but broken")
        assert main(["sass", str(tmp_path / "bad.cubin")]) == 1
        assert "nvdisasm failed" in capsys.readouterr().err
