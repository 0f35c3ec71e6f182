"""tk.autotune: configs checked when decorating, choices timed once per key on
the GPU and kept in memory and on disk (a new Autotuner over the same cache
directory stands for a new process), the table printed on request.

Disk entries are exercised on the CPU through the tuner's own save/load
functions; nothing here fakes a timing. GPU tests count the timings through
the module's `bench` hook.
"""
import re
import subprocess
import sys

import pytest

import tk_mlir as tk
from tk_mlir import f32
from tk_mlir.autotune import Autotuner, Config, autotune

autotune_module = sys.modules["tk_mlir.autotune"]   # tk.autotune may name the function

pytestmark = pytest.mark.usefixtures("cache_root")     # (conftest.py) every test

GOOD = [Config(BM=16, BN=64), Config(BM=64, BN=128, num_warps=8)]
TOO_BIG = Config(BM=256, BN=512)     # a 512 KiB shared tile: does not compile
WHERE = ("NVIDIA H200", (9, 0))      # a device description for the disk key


@tk.kernel(num_warps=4)
def staged(X: tk.gl[f32], Y: tk.gl[f32], s: float, BM: tk.constexpr, BN: tk.constexpr):
    i, j = tk.block_id(0), tk.block_id(1)
    a = tk.shared_tile(f32, (BM, BN))
    tk.copy(a, X, (i, j))
    tk.store(Y, tk.load(a) * s, (i, j))


def grid(meta):
    m, n = meta["X"].shape
    return (tk.cdiv(m, meta["BM"]), tk.cdiv(n, meta["BN"]))


def tuner(configs=(*GOOD, TOO_BIG), key=("X",)):
    """A new Autotuner over `staged`: an empty memory over the same disk cache."""
    return Autotuner(staged, list(configs), list(key), warmup=2, reps=5)


def entries(root):
    return [p for p in root.glob("*/*") if p.is_dir() and len(p.name) == 64]


# ------------------------------------------------------------------ Config

def test_config_repr_equality_and_frozen():
    c = Config(BM=64, BN=128, num_warps=8)
    assert repr(c) == "Config(BM=64, BN=128, num_warps=8)"
    assert repr(Config(BM=16)) == "Config(BM=16)"
    same = Config(BN=128, BM=64, num_warps=8)
    assert c == same and hash(c) == hash(same)
    assert c != Config(BM=64, BN=128) != Config(BM=64, BN=128, num_warps=4)
    assert Config(A=1) != Config(A=True) != Config(A=1.0)     # compile differently
    assert c.kwargs == {"BM": 64, "BN": 128}
    assert c.all_kwargs() == {"BM": 64, "BN": 128, "num_warps": 8}
    with pytest.raises(AttributeError, match="frozen"):
        c.num_warps = 4


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="Config num_warps=3: num_warps must be from 1 to 32 "
                                         "and a power of two or a multiple of 4"):
        Config(BM=16, num_warps=3)
    with pytest.raises(TypeError, match=r"Config BM=\[16\] must be hashable"):
        Config(BM=[16])


# ---------------------------------------------------- decoration-time checks

def test_autotune_wraps_only_kernels():
    with pytest.raises(TypeError, match=r"tk.autotune wraps a @tk.kernel: put "
                                        r"@tk.autotune\(...\) above @tk.kernel"):
        autotune(configs=GOOD, key=["X"])(lambda x: x)


def test_key_must_name_parameters():
    with pytest.raises(ValueError, match=r"key names 'M', which is not a parameter of the "
                                         r"kernel; its parameters are X, Y, s, BM, BN"):
        tuner(key=["X", "M"])
    with pytest.raises(ValueError, match=r"key names 'BM', which the configs set; key on "
                                         r"what the caller passes: X, Y, s"):
        tuner(key=["BM"])
    with pytest.raises(TypeError, match="key must be a list of parameter names, got 'X'"):
        Autotuner(staged, GOOD, "X")


def test_configs_must_set_only_constexprs():
    with pytest.raises(ValueError, match=r"Config\(BM=16, s=2.0\) sets s, which is not a "
                                         r"constexpr parameter of the kernel; a config may set "
                                         r"BM, BN, num_warps"):
        tuner(configs=[Config(BM=16, s=2.0)])
    with pytest.raises(ValueError, match=r"sets BK, Q, which are not constexpr parameters of "
                                         r"the kernel; a config may set BM, BN, num_warps"):
        tuner(configs=[GOOD[0], Config(BK=16, Q=1)])
    with pytest.raises(ValueError, match="configs must be a non-empty list of tk.Config"):
        tuner(configs=[])
    with pytest.raises(TypeError, match=r"configs must be tk.Config, got \{'BM': 16\}"):
        tuner(configs=[{"BM": 16}])
    with pytest.raises(ValueError, match=r"Config\(BN=64, BM=16\) is listed twice"):
        tuner(configs=[GOOD[0], GOOD[1], Config(BN=64, BM=16)])


# ---------------------------------------------------------- keys, compile

def test_key_of_uses_dtype_and_shape_of_tensors_and_values_of_scalars():
    t = tuner(key=["X", "s"])
    x = tk.spec((300, 512), "f32")
    assert t.key_of(x, x, 2.0) == (("f32", (300, 512)), 2.0)
    assert t.key_of(x, Y=x, s=3.0) == (("f32", (300, 512)), 3.0)
    assert t._describe(t.key_of(x, x, 2.0)) == "staged(X=f32[300,512], s=2.0)"
    with pytest.raises(TypeError, match="staged\\(\\) missing argument 's'"):
        t.key_of(x, x)


def test_quick_key_tells_apart_what_the_full_key_does():
    import torch
    from tk_mlir.autotune import _quick_key_function
    t = tuner(key=["X", "s"])
    quick = _quick_key_function(staged.params, t._key_params, 3, ())
    x = torch.rand(8, 16)
    calls = [(x, x, 2.0), (torch.rand(8, 32), x, 2.0), (x.double(), x, 2.0), (x, x, 3.0),
             (x, x, 2)]
    assert len({quick(c, {}) for c in calls}) == len(calls)
    assert len({t.key_of(*c) for c in calls}) == len(calls) - 1   # 2 == 2.0 for the full key,
    assert quick((torch.rand(8, 16), x, 2.0), {}) == quick(calls[0], {})  # (a miss is safe)
    assert quick((tk.spec((8, 16), "f32"), x, 2.0), {}) is None   # not torch: the full path
    by_keyword = _quick_key_function(staged.params, t._key_params, 1, ("s", "Y"))
    assert by_keyword((x,), {"s": 2.0, "Y": x}) == quick(calls[0], {})


@tk.kernel(num_warps=4)
def with_default(X: tk.gl[f32], Y: tk.gl[f32], BM: tk.constexpr, s: float = 2.0):
    tk.store(Y, tk.load(X, (0, 0), (BM, 64)) * s, (0, 0))


def test_quick_key_reads_arguments_as_the_launch_plan_does():
    """Positional, keyword and default arguments (launcher.read_arguments),
    and the device part from the first tensor argument, whichever way it
    came: a call that passes an argument and one that leaves its default
    agree when the values do."""
    import torch
    from tk_mlir.autotune import _quick_key_function
    t = Autotuner(with_default, [Config(BM=16)], ["s"])
    x = torch.rand(16, 64)
    positional = _quick_key_function(with_default.params, t._key_params, 2, ())
    by_keyword = _quick_key_function(with_default.params, t._key_params, 0, ("Y", "X", "s"))
    assert positional((x, x), {}) == (float, 2.0, x.get_device())
    assert by_keyword((), {"Y": x, "X": x, "s": 2.0}) == positional((x, x), {})
    assert by_keyword((), {"Y": x, "X": x, "s": 3.0}) == (float, 3.0, x.get_device())
    # The device is read from X, so X must be a torch tensor though it is no key.
    assert positional((tk.spec((16, 64), "f32"), x), {}) is None


def test_the_launch_device_follows_the_launchers_rule(monkeypatch):
    """The full path picks the device as launcher.launch_device does: the
    one every tensor argument is on, and tensors on two GPUs are refused
    before anything is tuned (no longer the first CUDA tensor's device)."""
    import torch
    from tk_mlir import launcher
    from tk_mlir.runtime.arguments import TensorInfo
    devices = {}
    monkeypatch.setattr(launcher, "tensor_info", lambda v, name: TensorInfo(
        v.data_ptr(), tuple(v.shape), v.stride(), "f32", devices[name], 4))
    x, y = torch.rand(64, 64), torch.rand(64, 64)
    devices.update(X="cuda:1", Y="cuda:1")
    assert launcher.arguments_device(staged.params, [x, y, 2.0, 16, 64]) == 1
    devices.update(X="cuda:0")
    t = tuner()
    monkeypatch.setattr(t, "_choose", lambda *a: pytest.fail("tuned across two devices"))
    with pytest.raises(tk.ArgumentError, match="'X' on cuda:0, 'Y' on cuda:1"):
        t[grid](x, y, 2.0)


@pytest.mark.parametrize("config", [9, -4, "fast", True, Config(BM=32, BN=64)])
def test_compile_names_a_config_it_does_not_have(config):
    with pytest.raises(tk.ArgumentError, match="is not one of its configs") as info:
        tuner().compile(tk.spec((64, 64), "f32"), tk.spec((64, 64), "f32"), 2.0, config=config)
    assert "0: Config(BM=16, BN=64)" in str(info.value)


def test_compile_without_a_config_says_it_needs_one():
    with pytest.raises(tk.ArgumentError, match=r"compile needs config=, one of its configs or "
                                               r"its index \(0: Config\(BM=16, BN=64\)"):
        tuner().compile(tk.spec((64, 64), "f32"), tk.spec((64, 64), "f32"), 2.0)


def test_caller_may_not_pass_what_the_configs_set():
    x = tk.spec((64, 64), "f32")
    with pytest.raises(tk.ArgumentError, match="BM is chosen by tk.autotune from its configs; "
                                               "do not pass it"):
        tuner().key_of(x, x, 2.0, BM=16)
    with pytest.raises(tk.ArgumentError, match="BM, num_warps are chosen by tk.autotune"):
        tuner().compile(x, x, 2.0, 16, num_warps=4, config=0)


def test_compile_passes_a_config_through():
    t = tuner()
    x = tk.spec((256, 512), "f32")
    assert t.compile(x, x, 2.0, config=0).info["dynamic shared memory (bytes)"] == 16 * 64 * 4
    assert t.compile(x, x, 2.0, config=GOOD[1]).num_threads == 256
    with pytest.raises(tk.CompilationError, match="shared memory"):
        t.compile(x, x, 2.0, config=TOO_BIG)


def test_importing_autotune_does_not_import_torch():
    code = "import sys, tk_mlir.autotune; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


# ------------------------------------------------------ disk cache (no GPU)

KEY = (("f32", (1024, 1024)),)


def test_without_a_gpu_tuning_says_so_and_nothing_is_chosen(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = tuner()
    x = torch.rand(64, 128)
    assert t.best_config(x, x, 2.0) is None
    with pytest.raises(tk.ArgumentError, match="no CUDA GPU here to tune on"):
        t[grid](x, x, 2.0)


def test_choice_round_trips_through_the_disk(cache_root):
    results = {GOOD[0]: 0.011, GOOD[1]: 0.009, TOO_BIG: "error: too much shared memory"}
    tuner()._save_choice(KEY, WHERE, GOOD[1], results)
    assert len(entries(cache_root)) == 1
    assert tuner()._load_choice(KEY, WHERE) == GOOD[1]        # a new "process"
    # Each part of the key is a different entry.
    assert tuner()._load_choice((("f32", (1024, 2048)),), WHERE) is None
    assert tuner()._load_choice(KEY, ("NVIDIA H100 80GB HBM3", (9, 0))) is None
    assert tuner(configs=GOOD)._load_choice(KEY, WHERE) is None
    assert tuner(key=["X", "s"])._load_choice(KEY + (2.0,), WHERE) is None


def test_always_compile_ignores_the_disk_choice(cache_root, monkeypatch):
    tuner()._save_choice(KEY, WHERE, GOOD[0], {GOOD[0]: 0.01})
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")
    assert tuner()._load_choice(KEY, WHERE) is None
    monkeypatch.delenv("TK_MLIR_ALWAYS_COMPILE")
    assert tuner()._load_choice(KEY, WHERE) == GOOD[0]


def test_damaged_entry_is_a_miss_and_dropped(cache_root):
    tuner()._save_choice(KEY, WHERE, GOOD[0], {GOOD[0]: 0.01})
    (entry,) = entries(cache_root)
    (entry / "choice.json").write_text('{"config": 1')        # no longer what the manifest says
    assert tuner()._load_choice(KEY, WHERE) is None
    assert not entries(cache_root)
    tuner()._save_choice(KEY, WHERE, GOOD[1], {GOOD[1]: 0.01})  # and a new choice is kept
    assert tuner()._load_choice(KEY, WHERE) == GOOD[1]


@pytest.mark.parametrize("text", ['not json', '[]', '{"config": 7, "repr": "Config(BM=16)"}',
                                  '{"config": 1, "repr": "Config(BM=16, BN=64)"}',
                                  '{"config": "0", "repr": "Config(BM=16, BN=64)"}',
                                  '{"repr": "Config(BM=16, BN=64)"}'])
def test_entry_naming_no_config_of_ours_is_a_miss_and_dropped(cache_root, text):
    t = tuner()
    t._disk.put(t._disk_key(KEY, WHERE), {"choice.json": text})   # a well-formed entry
    assert tuner()._load_choice(KEY, WHERE) is None
    assert not entries(cache_root)


def test_best_config_reads_the_disk_once_a_key(cache_root, monkeypatch):
    """What the disk held for a key, a choice or none, is remembered: its key
    walks the kernel's source for the globals it reads (milliseconds a call
    for a caller asking at every launch)."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(autotune_module, "_device", lambda ordinal=None: (0, *WHERE))
    t = tuner()
    t._save_choice(KEY, WHERE, GOOD[1], {GOOD[1]: 0.01})
    reads = []
    real = t._load_choice
    monkeypatch.setattr(t, "_load_choice", lambda *a: reads.append(a) or real(*a))
    x, wide = torch.rand(1024, 1024), torch.rand(1024, 2048)
    assert [t.best_config(x, x, 2.0) for _ in range(3)] == [GOOD[1]] * 3
    assert [t.best_config(wide, wide, 2.0) for _ in range(3)] == [None] * 3
    assert len(reads) == 2
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")       # (the knobs apply at once)
    assert t.best_config(x, x, 2.0) is None and len(reads) == 3


# --------------------------------------------------------------------- GPU

@pytest.fixture
def timed(monkeypatch):
    """The configs timed from here on (through the module's bench hook)."""
    calls = []
    real = autotune_module.bench

    def spy(launch, **kw):
        calls.append(launch.keywords)
        return real(launch, **kw)
    monkeypatch.setattr(autotune_module, "bench", spy)
    return calls


def inputs(m=1000, n=1024):
    import torch
    x = torch.rand(m, n, device="cuda") - 0.5
    return x, torch.full_like(x, float("nan"))


@pytest.mark.gpu
def test_tunes_once_then_launches_the_choice(timed):
    import torch
    t = tuner()
    x, y = inputs()
    t[grid](x, y, 2.0)
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2.0)
    assert len(timed) == 2                                  # the config too big is skipped
    (key,) = t.timings
    assert key == (("f32", (1000, 1024)),)
    times = t.timings[key]
    assert list(times) == [*GOOD, TOO_BIG]
    assert all(isinstance(times[c], float) and times[c] > 0 for c in GOOD)
    assert "shared memory" in times[TOO_BIG]
    best = t.best_config(x, y, 2.0)
    assert best == min(GOOD, key=times.get)
    y.fill_(float("nan"))
    t[grid](x, y, 3.0)                                       # same key: no timing
    torch.cuda.synchronize()
    assert torch.equal(y, x * 3.0) and len(timed) == 2
    x2, y2 = inputs(64, 256)                                 # a new key is tuned
    t[grid](x2, y2, 2.0)
    torch.cuda.synchronize()
    assert torch.equal(y2, x2 * 2.0) and len(timed) == 4 and len(t.timings) == 2
    y.fill_(float("nan"))
    t[grid](x, y, 4.0)                        # the first key again: its choice, no timing
    torch.cuda.synchronize()
    assert torch.equal(y, x * 4.0) and len(timed) == 4


@pytest.mark.gpu
def test_new_process_reuses_the_disk_choice(timed, capfd, monkeypatch):
    import torch
    x, y = inputs()
    first = tuner()
    first[grid](x, y, 2.0)
    best = first.best_config(x, y, 2.0)
    assert len(timed) == 2
    monkeypatch.setenv("TK_MLIR_PRINT_AUTOTUNING", "1")
    capfd.readouterr()
    second = tuner()                                          # empty memory, same disk
    assert second.best_config(x, y, 2.0) == best
    y.fill_(float("nan"))
    second[grid](x, y, 2.0)
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2.0)
    assert len(timed) == 2 and second.timings == {}
    err = capfd.readouterr().err
    assert err == f"tk_mlir autotune: staged(X=f32[1000,1024]): {best} (from the cache)\n"
    monkeypatch.setenv("TK_MLIR_ALWAYS_COMPILE", "1")        # ...which this ignores
    tuner()[grid](x, y, 2.0)
    assert len(timed) == 4


@pytest.mark.gpu
def test_print_autotuning_prints_the_table(timed, capfd, monkeypatch):
    monkeypatch.setenv("TK_MLIR_PRINT_AUTOTUNING", "1")
    x, y = inputs()
    t = tuner(key=["X", "s"])
    t[grid](x, y, 2.0)
    best = t.best_config(x, y, 2.0)
    lines = capfd.readouterr().err.splitlines()
    assert lines[0] == "tk_mlir autotune: staged(X=f32[1000,1024], s=2.0):"
    for line, c in zip(lines[1:3], GOOD):
        chosen = "  <- chosen" if c == best else ""
        assert re.fullmatch(rf"  {re.escape(repr(c))}: \d+\.\d{{4}} ms{chosen}", line), line
    assert lines[3].startswith(f"  {TOO_BIG}: failed: ") and "shared memory" in lines[3]
    assert len(lines) == 4


@pytest.mark.gpu
def test_every_config_failing_lists_each_failure(timed):
    x, y = inputs()
    t = tuner(configs=[TOO_BIG, Config(BM=512, BN=256)])
    with pytest.raises(tk.CompilationError) as info:
        t[grid](x, y, 2.0)
    message = str(info.value)
    assert "autotune staged: no config could run for staged(X=f32[1000,1024])" in message
    assert "Config(BM=256, BN=512): " in message and "Config(BM=512, BN=256): " in message
    assert timed == []


@pytest.mark.gpu
def test_bad_arguments_raise_what_the_kernel_raises(timed):
    import torch
    x, y = inputs()
    with pytest.raises(tk.ArgumentError, match="grid must be an int or a tuple of 1 to 3 ints"):
        tuner()[lambda meta: (0,)](x, y, 2.0)
    with pytest.raises(tk.ArgumentError, match="argument 'Y'") as info:
        tuner()[grid](x, y.to(torch.float16), 2.0)
    with pytest.raises(tk.ArgumentError, match="argument 'Y'") as direct:
        staged[grid](x, y.to(torch.float16), 2.0, BM=16, BN=64)
    assert str(info.value) == str(direct.value)
    assert timed == []


def test_interpret_runs_the_first_config_on_the_cpu():
    import torch
    t = tuner()
    x = torch.rand(40, 100)
    y = torch.full_like(x, float("nan"))
    t.interpret[grid](x, y, 2.0)
    assert torch.equal(y, x * 2.0)
    with pytest.raises(tk.ArgumentError, match="chosen by tk.autotune"):
        t.interpret[grid](x, y, 2.0, BM=16)
