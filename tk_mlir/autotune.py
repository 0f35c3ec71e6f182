"""`@tk.autotune`: time a kernel's candidate constexpr configurations once per
key and launch the fastest (in the spirit of `triton.autotune`).

    @tk.autotune(configs=[tk.Config(BM=16, BN=64), tk.Config(BM=64, BN=128, num_warps=8)],
                 key=["X"])
    @tk.kernel
    def scale(X: tk.gl[f32], Y: tk.gl[f32], s: float, BM: tk.constexpr, BN: tk.constexpr): ...

    grid = lambda meta: (tk.cdiv(M, meta["BM"]), tk.cdiv(N, meta["BN"]))
    scale[grid](x, y, 2.0)        # BM, BN (and num_warps) come from the chosen config

Invariants: a choice belongs to a (device, key) pair: the key is, per key
name, a tensor's (dtype, shape) or a scalar's value; the device is where the
launch runs, by launcher.launch_device's rule. It is made once, by timing
every config (`bench`; a config that fails to compile or launch is skipped)
or read from the disk cache, whose key holds all that changes the winner
(`Autotuner._disk_key`). The quick key of the fast path decides the same
config as the full key. Tuning re-runs the kernel on the caller's arguments:
it may overwrite its outputs but not read what it writes (`Y += X`,
accumulating atomics), as Triton requires. torch is imported when a key is
first timed, not with tk_mlir.
"""
from __future__ import annotations

import functools
import json
import statistics
import sys
import threading
from typing import Any, Callable, Sequence

from . import cache, knobs, launcher
from .dtypes import BY_TORCH_NAME
from .errors import CompilationError, for_the_user
from .kernel import Kernel, _Interpreting, _interpret_all
from .params import GL, NUM_WARPS_RULE, describe_value, hashable, valid_num_warps
from .runtime.arguments import ArgumentError, describe

_FLUSH_FALLBACK_BYTES = 64 << 20      # when torch does not report the L2 size


class Config:
    """One candidate: constexpr values by name, and optionally num_warps
    (None: the kernel's own). Frozen; equal when names, values and value
    types are equal (True, 1 and 1.0 compile differently)."""

    __slots__ = ("_items", "num_warps", "_ident", "_launch")

    def __init__(self, *, num_warps: int | None = None, **constexprs):
        if num_warps is not None and not valid_num_warps(num_warps):
            # (the kernel's rule, params.valid_num_warps)
            raise ValueError(f"Config num_warps={num_warps!r}: num_warps {NUM_WARPS_RULE}, as "
                             f"@tk.kernel takes it")
        for name, value in constexprs.items():
            try:
                hash(value)
            except TypeError:
                raise TypeError(f"Config {name}={value!r} must be hashable (an int, float, "
                                f"bool, str, tuple or tk dtype)") from None
        ident = (tuple((k, type(v).__name__, v) for k, v in sorted(constexprs.items())),
                 num_warps)
        extra = {} if num_warps is None else {"num_warps": num_warps}
        for slot, value in (("_items", tuple(constexprs.items())), ("num_warps", num_warps),
                            ("_ident", ident), ("_launch", {**constexprs, **extra})):
            object.__setattr__(self, slot, value)

    def __setattr__(self, name, value):
        raise AttributeError("tk.Config is frozen")

    @property
    def kwargs(self) -> dict:
        """The constexpr values (without num_warps)."""
        return dict(self._items)

    def all_kwargs(self) -> dict:
        """What a launch with this config passes: the constexprs and num_warps if set."""
        return dict(self._launch)

    def __eq__(self, other):
        return isinstance(other, Config) and self._ident == other._ident

    def __hash__(self):
        return hash(self._ident)

    def __repr__(self):
        return f"Config({', '.join(f'{k}={v!r}' for k, v in self.all_kwargs().items())})"

    def _jsonable(self) -> list:
        return [[[k, t, cache.jsonable(v)] for k, t, v in self._ident[0]], self.num_warps]


def autotune(configs: Sequence[Config], key: Sequence[str], *, warmup: int = 5,
             reps: int = 20) -> Callable[[Kernel], "Autotuner"]:
    """Decorator, above `@tk.kernel`: `@tk.autotune(configs=[...], key=["X", "M"])`.
    `warmup` launches and then `reps` timed launches per config and key."""
    return lambda k: Autotuner(k, configs, key, warmup=warmup, reps=reps)


def bench(launch: Callable[[], Any], *, warmup: int, reps: int) -> float:
    """Median ms of `reps` launches, each between two CUDA events on torch's
    current stream (where tk kernels launch), after `warmup` launches. Before
    each timed launch a buffer twice the L2's size is zeroed, so every launch
    starts from a cold L2 (as triton.testing.do_bench does). Autotuner calls it
    through this module's global, so a test or notebook may replace it."""
    import torch
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 0) or _FLUSH_FALLBACK_BYTES
    flush = torch.empty(2 * l2, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        launch()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


class Autotuner:
    """A Kernel with a choice of configs; launch it like the kernel:
    `tuned[grid](*args, **kwargs)` without the constexprs the configs set.

    Attributes: `kernel` (the wrapped tk.kernel), `configs`, `key`,
    `timings` ({key: {Config: median ms, or the failure's text}} for the keys
    timed by this object), `key_of(*args, **kwargs)` and
    `best_config(*args, **kwargs)` (the choice for those arguments, from
    memory or disk, never timing; None when there is none yet)."""

    def __init__(self, kernel: Kernel, configs: Sequence[Config], key: Sequence[str], *,
                 warmup: int = 5, reps: int = 20):
        if not isinstance(kernel, Kernel):
            raise TypeError(f"tk.autotune wraps a @tk.kernel: put @tk.autotune(...) above "
                            f"@tk.kernel, got {kernel!r}")
        self.kernel, self.__name__ = kernel, kernel.__name__
        self.configs = _check_configs(kernel, configs)
        self.key = _check_key(kernel, key, self.configs)
        if not (isinstance(warmup, int) and warmup >= 0 and isinstance(reps, int) and reps >= 1):
            raise ValueError(f"tk.autotune: warmup must be an int >= 0 and reps an int >= 1, "
                             f"got {warmup!r}, {reps!r}")
        self.warmup, self.reps = warmup, reps
        self.timings: dict[tuple, dict[Config, float | str]] = {}
        self._key_params = [(kernel.params.index[name], kernel.params[kernel.params.index[name]])
                            for name in self.key]
        # The names the configs set may not be passed by the caller as well.
        self._tuned = {n for c in self.configs for n in c.all_kwargs()}
        self._first_tuned = min([i for i, p in enumerate(kernel.params) if p.name in self._tuned],
                                default=len(kernel.params))
        self._chosen: dict[tuple, Config] = {}        # (device ordinal, key) -> config
        # What best_config read on the disk: (device, key, cache folder, always
        # compile) -> the choice there or None (the knobs apply at once).
        self._on_disk: dict[tuple, Config | None] = {}
        # The launch's fast path: per call shape (positional count, keyword
        # names) a generated quick-key function and, by quick key, the chosen
        # config's launch keywords and the kernel plan that launched it.
        self._quick: dict[tuple, tuple[Callable, dict]] = {}
        self._lock = threading.Lock()                 # one tuning at a time: timings interfere
        self._disk = cache.DiskCache()

    def __repr__(self):
        return f"<tk.autotune {self.__name__}: {len(self.configs)} configs, key {self.key}>"

    def __call__(self, *args, **kwargs):
        raise TypeError(f"launch a kernel with a grid: {self.__name__}[grid](...)")

    def __getitem__(self, grid) -> Callable:
        return functools.partial(self.run, grid)

    # ---------------------------------------------------------------- launch

    def run(self, grid, *args, **kwargs) -> None:
        """Launch with the config chosen for these arguments' key, tuning first
        when the key is new (see the module's docstring). Under
        TK_MLIR_INTERPRET=1 the first config runs on the CPU interpreter,
        untimed."""
        if _interpret_all():
            return self._interpret(grid, *args, **kwargs)
        try:
            shape = (len(args), *kwargs)
            quick = self._quick.get(shape)
            if quick is not None:              # a call shaped like an earlier one
                key_of, choices = quick
                try:
                    k = key_of(args, kwargs)
                    hit = choices.get(k)
                except TypeError:              # an unhashable value: the full path says so
                    hit = None
                if hit is not None:
                    launch_kwargs, plan = hit
                    merged = {**kwargs, **launch_kwargs} if kwargs else launch_kwargs
                    if plan is None or not plan(grid, args, merged):
                        choices[k] = (launch_kwargs,
                                      self.kernel.launch_by_plan(grid, args, merged))
                    return
            values = self._bind(args, kwargs)
            key = self._key(values)
            device = launcher.arguments_device(self.kernel.params, values)
            config = self._chosen.get((device, key))
            if config is None:
                config = self._choose(device, key, grid, args, kwargs)
            plan = self.kernel.launch_by_plan(grid, args, {**kwargs, **config._launch})
            self._remember(shape, args, kwargs, config, plan)
        except (CompilationError, ArgumentError) as e:
            raise for_the_user(e)

    @property
    def interpret(self):
        """`tuned.interpret[grid](...)`: the first config on the CPU
        interpreter, untimed (as every launch under TK_MLIR_INTERPRET=1)."""
        return _Interpreting(self)

    def _interpret(self, grid, *args, **kwargs) -> None:
        try:
            self._check_not_tuned(args, kwargs)
        except ArgumentError as e:
            raise for_the_user(e)
        return self.kernel._interpret(grid, *args, **{**kwargs, **self.configs[0]._launch})

    def _remember(self, shape: tuple, args: tuple, kwargs: dict, config: Config,
                  plan: Callable | None) -> None:
        """After a launch went through the full key: let later calls of the
        same shape (positional count, keyword names) find `config`, and the
        kernel's launch plan that served it, by a quick key read straight off
        their arguments."""
        quick = self._quick.get(shape)
        if quick is None:
            quick = self._quick[shape] = (_quick_key_function(
                self.kernel.params, self._key_params, len(args), tuple(kwargs)), {})
        key_of, choices = quick
        k = key_of(args, kwargs)
        if k is not None and len(choices) < _MAX_QUICK_CHOICES:
            choices[k] = (config._launch, plan)

    def compile(self, *args, config: Config | int | None = None, **kwargs):
        """`kernel.compile` for one config (a Config or an index into `configs`):
        `tuned.compile(tk.spec(...), ..., config=0).asm`. Works without a GPU."""
        try:
            config = self._config(config)
            self._check_not_tuned(args, kwargs)
        except ArgumentError as e:
            raise for_the_user(e)
        return self.kernel.compile(*args, **kwargs, **config.all_kwargs())

    def _config(self, config) -> Config:
        """`config=` of compile: one of the configs, or its index."""
        if isinstance(config, Config) and config in self.configs:
            return config
        if isinstance(config, int) and not isinstance(config, bool) and \
                -len(self.configs) <= config < len(self.configs):
            return self.configs[config]
        listing = "; ".join(f"{i}: {c}" for i, c in enumerate(self.configs))
        if config is None:          # (left out: tuning picks one only on a GPU)
            raise ArgumentError(f"{self.__name__}.compile needs config=, one of its configs "
                                f"or its index ({listing}): the autotuner picks one only when "
                                f"launched on a GPU")
        raise ArgumentError(f"{self.__name__}.compile: config={config!r} is not one of its "
                            f"configs; pass a Config from the list or its index ({listing})")

    def key_of(self, *args, **kwargs) -> tuple:
        """The tuning key of a call's arguments: per key name, a tensor's
        (dtype, shape) or a scalar's value. Works without a GPU."""
        return self._key(self._bind(args, kwargs))

    def _bind(self, args: tuple, kwargs: dict) -> list:
        """The kernel's parameters bound to a call (those the configs set unbound)."""
        if len(args) > self._first_tuned or kwargs and not self._tuned.isdisjoint(kwargs):
            self._check_not_tuned(args, kwargs)
        return self.kernel.params.bind(args, kwargs, unbound_ok=self._tuned)[0]

    def _key(self, values: list) -> tuple:
        return tuple([_key_value(p, values[i]) for i, p in self._key_params])

    def best_config(self, *args, **kwargs) -> Config | None:
        """The config chosen for these arguments (this object's memory, else the
        disk cache), without timing anything; None when none has been chosen.
        The disk is read once per device and key, and what it held (a choice
        or none) remembered: its key names the globals the kernel reads, a
        walk of its source (milliseconds), which a caller asking at every
        launch (gemm's accumulating product) would pay each time."""
        key = self._key(self._bind(args, kwargs))
        import torch
        if not torch.cuda.is_available():
            return None                         # (nothing is chosen without a GPU)
        device = _device()
        at = (device[0], key)
        if at in self._chosen:
            return self._chosen[at]
        disk = (*at, knobs.cache_dir(), knobs.always_compile())
        if disk not in self._on_disk:
            self._on_disk[disk] = self._load_choice(key, device[1:])
        return self._on_disk[disk]

    def _check_not_tuned(self, args, kwargs) -> None:
        passed = self._tuned.intersection(kwargs)
        passed |= {p.name for p in self.kernel.params[:len(args)] if p.name in self._tuned}
        if passed:
            raise ArgumentError(f"{self.__name__}: {', '.join(sorted(passed))} "
                                f"{'is' if len(passed) == 1 else 'are'} chosen by tk.autotune "
                                f"from its configs; do not pass "
                                f"{'it' if len(passed) == 1 else 'them'}")

    # ---------------------------------------------------------------- tuning

    def _choose(self, device: int, key: tuple, grid, args, kwargs) -> Config:
        with self._lock:
            config = self._chosen.get((device, key))     # another thread may have tuned it
            if config is None:
                where = _device(device)[1:]
                config = self._load_choice(key, where)
                if config is not None:
                    self._report(f"{self._describe(key)}: {config} (from the cache)")
                else:
                    import torch
                    with torch.cuda.device(device):    # bench times on this device's stream
                        config = self._tune(key, where, grid, args, kwargs)
                self._chosen[(device, key)] = config
            return config

    def _tune(self, key: tuple, where: tuple, grid, args, kwargs) -> Config:
        """Launch (so compile) and time each config; store and return the fastest."""
        CudaError = _driver().CudaError
        results: dict[Config, float | str] = {}
        for config in self.configs:
            launch = functools.partial(self.kernel.launch, grid, *args, **kwargs,
                                       **config.all_kwargs())
            try:
                launch()
            except CompilationError as e:         # e.g. too much shared memory
                results[config] = str(e)
                continue
            except CudaError as e:                 # too many registers x threads to launch
                if e.name != "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES":
                    raise
                results[config] = str(e)
                continue
            results[config] = bench(launch, warmup=self.warmup, reps=self.reps)
        self.timings[key] = results
        timed = {c: ms for c, ms in results.items() if not isinstance(ms, str)}
        if not timed:
            raise CompilationError(
                f"autotune {self.__name__}: no config could run for {self._describe(key)}:\n"
                + "\n".join(f"  {c}: {msg}".replace("\n", "\n    ") for c, msg in results.items()))
        best = min(timed, key=timed.get)
        self._report(self._table(key, results, best))
        if not cache.always_compile():
            self._save_choice(key, where, best, results)
        return best

    # ------------------------------------------------------------ disk cache

    def _disk_key(self, key: tuple, where: tuple) -> str:
        """`where`: (device name, (major, minor)). Everything that changes which
        config wins, or what a config index means."""
        k = self.kernel
        return cache.make_key(
            kind="tk-autotune", name=k.__name__, source=k.source,
            where=[k.filename, k._source.first_line], globals=k._globals_key(),
            num_warps=k.default_num_warps, fp_contract=k.fp_contract, configs=[c._jsonable() for c in self.configs],
            key=[[n, cache.jsonable(v)] for n, v in zip(self.key, key)],
            device=[where[0], list(where[1])])

    def _save_choice(self, key: tuple, where: tuple, best: Config, results: dict) -> None:
        entry = {"config": self.configs.index(best), "repr": repr(best),
                 "timings_ms": [[repr(c), r] for c, r in results.items()]}
        self._disk.put(self._disk_key(key, where), {"choice.json": json.dumps(entry)})

    def _load_choice(self, key: tuple, where: tuple) -> Config | None:
        """The stored choice, or None: missing, TK_MLIR_ALWAYS_COMPILE, or an
        entry that does not name one of our configs (dropped, so the next
        tuning can publish a good one; DiskCache never overwrites)."""
        disk_key = self._disk_key(key, where)
        entry = self._disk.get(disk_key)
        if entry is None:
            return None
        try:
            choice = json.loads(entry["choice.json"])
            config = self.configs[choice["config"]]
            if isinstance(choice["config"], int) and choice["repr"] == repr(config):
                return config
        except (KeyError, IndexError, TypeError, ValueError):
            pass
        cache._remove(self._disk.path(disk_key))
        return None

    # ------------------------------------------------------------- reporting

    def _describe(self, key: tuple) -> str:
        parts = []
        for name, (_, p), v in zip(self.key, self._key_params, key):
            shown = f"{v[0]}[{','.join(map(str, v[1]))}]" if p.kind == GL else repr(v)
            parts.append(f"{name}={shown}")
        return f"{self.__name__}({', '.join(parts)})"

    def _table(self, key: tuple, results: dict, best: Config) -> str:
        lines = [f"{self._describe(key)}:"]
        for c, r in results.items():
            shown = f"failed: {r.splitlines()[0]}" if isinstance(r, str) else f"{r:.4f} ms"
            lines.append(f"  {c}: {shown}{'  <- chosen' if c == best else ''}")
        return "\n".join(lines)

    @staticmethod
    def _report(text: str) -> None:
        if knobs.print_autotuning():
            print(f"tk_mlir autotune: {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ helpers

def _check_configs(kernel: Kernel, configs) -> tuple[Config, ...]:
    configs = tuple(configs) if isinstance(configs, (list, tuple)) else configs
    if not isinstance(configs, tuple) or not configs:
        raise ValueError(f"tk.autotune({kernel.__name__}): configs must be a non-empty list "
                         f"of tk.Config, got {configs!r}")
    settable = [kernel.params[i].name for i in kernel.params.constexprs]
    for c in configs:
        if not isinstance(c, Config):
            raise TypeError(f"tk.autotune({kernel.__name__}): configs must be tk.Config, "
                            f"got {c!r}")
        bad = [n for n in c.kwargs if n not in settable]
        if bad:
            what = "is not a constexpr parameter" if len(bad) == 1 else \
                "are not constexpr parameters"
            raise ValueError(f"tk.autotune({kernel.__name__}): {c} sets {', '.join(bad)}, "
                             f"which {what} of the kernel; a config may set "
                             f"{', '.join(settable + ['num_warps'])}")
    if len(set(configs)) != len(configs):
        twice = next(c for i, c in enumerate(configs) if c in configs[:i])
        raise ValueError(f"tk.autotune({kernel.__name__}): {twice} is listed twice in configs")
    return configs


def _check_key(kernel: Kernel, key, configs) -> tuple[str, ...]:
    if isinstance(key, str) or not isinstance(key, (list, tuple)) \
            or not all(isinstance(n, str) for n in key):
        raise TypeError(f"tk.autotune({kernel.__name__}): key must be a list of parameter "
                        f"names, got {key!r}")
    names = [p.name for p in kernel.params]
    tuned = {n for c in configs for n in c.kwargs}
    for n in key:
        if n not in names:
            raise ValueError(f"tk.autotune({kernel.__name__}): key names '{n}', which is not "
                             f"a parameter of the kernel; its parameters are {', '.join(names)}")
        if n in tuned:
            raise ValueError(f"tk.autotune({kernel.__name__}): key names '{n}', which the "
                             f"configs set; key on what the caller passes: "
                             f"{', '.join(x for x in names if x not in tuned)}")
    return tuple(key)


# torch's dtype objects -> tk names, from the one table (dtypes.BY_TORCH_NAME),
# filled once torch is in use: a torch tensor's part of the key is one dict
# lookup. Any other array's dtype (numpy's, CuPy's, a tk.spec's) is read by
# describe(), as the kernel reads it.
_TORCH_DTYPES: dict = {}


def _key_value(p, v):
    if p.kind == GL:
        try:
            return (_TORCH_DTYPES[v.dtype], tuple(v.shape))
        except (KeyError, AttributeError, TypeError):
            _learn_torch_dtypes()
            t = describe(v, p.name)
            return (t.dtype, tuple(t.shape))
    if not hashable(v):
        raise ArgumentError(f"argument '{p.name}' = {describe_value(v)} is part of the "
                            f"autotune key and must be hashable")
    return v


def _learn_torch_dtypes() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and not _TORCH_DTYPES:
        _TORCH_DTYPES.update({getattr(torch, n): name for n, name in BY_TORCH_NAME.items()
                              if hasattr(torch, n)})        # (fp8 needs torch >= 2.1)


@functools.cache
def _driver():
    """The CUDA driver layer, imported on first launch (it loads cuda-python)."""
    from .runtime import driver
    return driver


_MAX_QUICK_CHOICES = 4096


def _quick_key_function(params, key_params, n_positional: int, keywords: tuple) -> Callable:
    """A function of (args, kwargs), for calls of one shape (`n_positional`
    positional arguments, the keyword names `keywords`), returning a key that
    decides the same config as the full path: per key tensor its torch dtype
    and shape, per other key parameter its type and value (`Autotuner._key`),
    then the launch's device (launcher.launch_device_code). None when a key
    tensor, or the one the device is read from, is not a torch tensor: such
    calls take the full path. Cheap: the launch plan's argument reads
    (launcher.read_arguments) and attribute reads, no binding."""
    env: dict = {"TENSORS": frozenset(launcher.torch_tensor_types())}
    device_reads, tests, device = launcher.launch_device_code(params, env)
    parts = []
    for i, p in key_params:
        v = launcher.arg_var(i)
        if p.kind == GL:
            tests.append(f"type({v}) in TENSORS")
            parts += [f"{v}.dtype", f"{v}.shape"]
        else:
            parts += [f"type({v})", v]
    wanted = [i for i, _ in key_params] + device_reads
    lines = ["def quick(args, kwargs):",
             *launcher.read_arguments(params, n_positional, keywords, wanted, env)]
    if tests:
        lines += [f"    if not ({' and '.join(dict.fromkeys(tests))}):", "        return None"]
    lines.append(f"    return ({', '.join(parts + [device])},)")
    return launcher.define("quick", lines, env, "autotune quick key")


def _device(ordinal: int | None = None) -> tuple[int, str, tuple[int, int]]:
    """(ordinal, name, compute capability) of torch's current device."""
    import torch
    if not torch.cuda.is_available():
        raise ArgumentError("tk.autotune: there is no CUDA GPU here to tune on "
                            "(torch.cuda.is_available() is False); TK_MLIR_INTERPRET=1 runs "
                            "the first config on CPU tensors in the interpreter")
    if ordinal is None:
        ordinal = torch.cuda.current_device()
    capability = tuple(torch.cuda.get_device_capability(ordinal))
    return ordinal, torch.cuda.get_device_name(ordinal), capability
