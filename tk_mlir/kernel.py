"""`@tk.kernel`: a Python function that compiles, caches and launches.

    @tk.kernel
    def scale(X: tk.gl[tk.bf16], Y: tk.gl[tk.bf16], s: float, BM: tk.constexpr = 64): ...

    scale[grid](x, y, 2.0, BM=64)          # launch on torch's current stream
    scale.compile(tk.spec((M, N), tk.bf16), ..., BM=64).asm   # IR at every stage

Parameters annotated `tk.gl[...]` take tensors, `int`/`float` take Python
scalars (i32/f32 in the kernel), `tk.constexpr` take compile-time values
that specialize the code (params.py describes them, binds arguments to them
and makes the specialization key). A specialization is compiled once per
process (in-memory cache, lock + recheck; a signature keeps a few codes, each
with what its compile read from outside the kernel, and a lookup takes one
whose reads still hold: global_reads.py) and once per machine (disk cache,
looked up in two levels: the read sets, then the code for their values). A launch runs on the device
its tensor arguments are on, on torch's current stream for that device.
"""
from __future__ import annotations

import ast
import functools
import threading
from collections import OrderedDict
from typing import Callable

from . import knobs, launcher
from .cache import always_compile
from . import compiler
from .compiled import CompiledKernel
from .errors import CompilationError, for_the_user
from .knobs import KnobError
from .global_reads import GlobalRead, all_fresh, global_reads, key_text
from .params import (CONSTEXPR, DEFAULT_NUM_WARPS, GL, NUM_WARPS_RULE, PGL, KernelParams,
                     peer_pieces, valid_num_warps)
from .runtime.peers import PeerTensor, read_peers
from .runtime.arguments import ArgumentError, check_tensor, describe, tensor_info
from .source import KernelSource
from .specialization import Specialization
from . import target as targets

# What a public entry point raises as the user's error, its traceback cut
# there (errors.for_the_user): a refused kernel, a bad argument, a bad knob.
USER_ERRORS = (CompilationError, ArgumentError, KnobError)

_MAX_PLANS = 8     # launch plans kept per kernel (one per argument signature and device)
_MAX_ENTRIES = 8   # compiled codes kept per signature (for other values of its globals)
_MAX_CODES = 64    # compiled codes (and interpreter programs) kept per kernel, all signatures


class Kernel:
    def __init__(self, fn: Callable, num_warps: int = DEFAULT_NUM_WARPS,
                 fp_contract: bool = True, target: str | None = None):
        try:
            self._source = KernelSource.of(fn)   # (first: it checks what fn is)
        except CompilationError as e:
            raise for_the_user(e)
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.source, self.filename = self._source.text, self._source.filename
        self.default_num_warps = num_warps
        if not isinstance(fp_contract, bool):
            raise CompilationError(f"fp_contract must be True or False, got {fp_contract!r}",
                                   self.filename, self._source.first_line, self._source.indent)
        self.fp_contract = fp_contract      # a*b+c may be one fma (lowering/compute.py)
        try:
            self.target = targets.named(target)  # what it compiles for (target.py)
        except ValueError as e:
            raise CompilationError(str(e), self.filename, self._source.first_line,
                                   self._source.indent) from None
        if not valid_num_warps(num_warps):
            raise CompilationError(f"num_warps {NUM_WARPS_RULE}, got "
                                   f"{num_warps!r}", self.filename, self._source.first_line,
                                   self._source.indent)
        try:
            self.params = KernelParams.of_function(fn, self._source.function_ast(),
                                                   self.filename, num_warps)
        except CompilationError as e:
            raise for_the_user(e)
        self.runtime = self.params.runtime
        # signature -> [(what its code read from outside, the code)], the last used first
        # (least recently used signature first: _keep and _used bound it)
        self._compiled: OrderedDict[tuple, list[tuple[tuple[GlobalRead, ...],
                                                      CompiledKernel]]] = OrderedDict()
        self._plans: list[Callable] = []
        self._programs: OrderedDict[tuple, list] = OrderedDict()  # as _compiled, of Programs
        self._plan_keywords = {self.params[i].name for i in self.params.constexprs} | \
            {"num_warps"}
        self._lock = threading.Lock()

    def __repr__(self):
        return f"<tk.kernel {self.__name__}>"

    def __call__(self, *args, **kwargs):
        raise TypeError(f"launch a kernel with a grid: {self.__name__}[grid](...)")

    def __getitem__(self, grid) -> Callable:
        return functools.partial(self.launch, grid)

    # ------------------------------------------------------------ compile

    def compile(self, *args, **kwargs) -> CompiledKernel:
        """Compile for argument descriptions (tk.spec, torch meta tensors, numpy
        arrays, or real tensors) without launching; works without a GPU."""
        try:
            values, num_warps = self.params.bind(args, kwargs)
            sig = self.params.key(values, num_warps, describe)
            for i, rule in self.params.tensor_rules(sig).items():
                name = self.params[i].name   # (dtypes and static dims hold for descriptions too)
                info = read_peers(values[i], name, describe) if self.params[i].kind == PGL \
                    else describe(values[i], name)
                for what, t in _copies(name, info):
                    check_tensor(t, what, **rule)
            compiled = self._get(sig)
            dump_dir = knobs.dump_dir()
            if dump_dir is not None:    # (also for code kept from before it was set)
                compiled.dump_once(dump_dir, self._specialization(sig).dump_name(),
                                   knobs.DUMP_DIR.name)
            return compiled
        except USER_ERRORS as e:
            raise for_the_user(e)

    def _get(self, sig: tuple) -> CompiledKernel:
        return self._entry(sig)[1]

    def _entry(self, sig: tuple) -> tuple[tuple[GlobalRead, ...], CompiledKernel]:
        """The code for `sig` and what it read from outside the kernel when it
        was compiled (global_reads.py): one of the entries for `sig` whose
        reads all still hold, else compiled now (never the old code for a new
        global)."""
        if always_compile():
            return self._compile(sig)
        entry = self._fresh_entry(sig)
        if entry is None:
            with self._lock:
                entry = self._fresh_entry(sig)
                if entry is None:
                    entry = self._compile(sig)
                    _keep(self._compiled, sig, entry)
        return entry

    def _fresh_entry(self, sig: tuple):
        entries = self._compiled.get(sig)
        if entries:
            for i, entry in enumerate(entries):
                if all_fresh(entry[0]):
                    if i:
                        _to_front(entries, entry)
                    _used(self._compiled, sig)
                    return entry
        return None

    def _compile(self, sig: tuple) -> tuple[tuple[GlobalRead, ...], CompiledKernel]:
        knobs.check_all()       # (a bad knob found before the work, not after it)
        spec = self._specialization(sig)
        return compiler.compile_cached(spec, self._ast, self.fn.__globals__,
                                       dict(spec.constexprs))

    def _specialization(self, sig: tuple) -> Specialization:
        *per_param, num_warps = sig
        rt_args, names, consts = [], [], []
        for p, s in zip(self.params, per_param):
            if s[0] == CONSTEXPR:
                consts.append((p.name, s[1]))
            else:
                rt_args.append(s)
                names.append(p.name)
        return Specialization(self.__name__, self.source, self.filename, tuple(rt_args),
                              tuple(names), tuple(consts), num_warps, "",
                              self._source.first_line, self.fp_contract, self.target.arch)

    # -------------------------------------------------------- interpreter

    @property
    def interpret(self) -> _Interpreting:
        """`kernel.interpret[grid](...)`: run on the CPU (tk_mlir/interpreter)."""
        return _Interpreting(self)

    @property
    def interpret_ranks(self) -> _Interpreting:
        """`kernel.interpret_ranks[grid]([rank0_args, rank1_args, ...], **kw)`:
        one launch per rank on the CPU, all at once (tk.pgl kernels: their
        ranks wait for each other's signals)."""
        return _Interpreting(self, ranks=True)

    def _interpret_ranks(self, grid, ranks, **kwargs) -> None:
        from . import interpreter
        try:
            interpreter.launch_ranks(self, grid, ranks, kwargs)
        except USER_ERRORS as e:
            raise for_the_user(e)

    def _interpret(self, grid, *args, **kwargs) -> None:
        from . import interpreter
        try:
            interpreter.launch(self, grid, args, kwargs)
        except USER_ERRORS as e:
            raise for_the_user(e)

    def interpreted(self, sig: tuple):
        """The interpreter's Program for `sig`, built once (kept while the
        globals its build read still hold, as compiled code is)."""
        from . import global_reads as reads_
        from .interpreter.program import Program, build_module
        with self._lock:
            for reads, program in self._programs.get(sig, ()):
                if all_fresh(reads):
                    _used(self._programs, sig)
                    return program
            spec = self._specialization(sig)
            with reads_.recording(reads_.Recorder(dict(spec.constexprs),
                                                  self.fn.__globals__)) as rec, \
                    targets.compiling_for(self.target):
                program = Program(*build_module(spec, self._ast(), self.fn.__globals__))
            _keep(self._programs, sig, (tuple(rec.reads), program))
            return program

    def _ast(self) -> ast.FunctionDef:
        return self._source.function_ast()

    def _global_reads(self) -> tuple[GlobalRead, ...]:
        """A guess, before compiling, at the globals the kernel reads (from the
        names in its source and its tk.funcs'): only for keys that must exist
        before a compile (the autotuner's choice); the code is checked against
        what its compile recorded."""
        return global_reads(self.source, self.fn.__globals__)

    def _globals_key(self) -> str:
        return key_text(self._global_reads())

    # ------------------------------------------------------------- launch

    def launch(self, grid, *args, **kwargs) -> None:
        try:
            interpret = _interpret_all()
        except KnobError as e:
            raise for_the_user(e)
        if interpret:
            return self._interpret(grid, *args, **kwargs)
        try:
            self.launch_by_plan(grid, args, kwargs)
        except USER_ERRORS as e:
            raise for_the_user(e)

    def launcher(self, grid, **constexprs) -> Callable:
        """`run(*args)`, the same as `kernel[grid](*args, **constexprs)`, for a
        launch repeated with one grid and these keywords (a library
        wrapper's planned launch): the plan that launched last is tried
        first, and skips its keyword tests (the keywords are the launcher's
        own dict, which nothing changes)."""
        return self._repeated_launch(grid, constexprs, bind=False)

    def _signature_launcher(self, grid, **constexprs) -> Callable:
        """`run(*args)` as `launcher`'s, for the library's wrappers, whose
        function for one eager signature passes on every call tensors with
        its first call's types, dtypes, shapes, strides, device and 16-byte
        alignment (eager.py's key holds all of these). From the second call
        on, a launch reads only the tensors' addresses (launcher.torch_plan's
        bound plan); scalars, constexprs and the globals the code read are
        tested as `launcher`'s are, and a call they turn away takes the full
        path. Not for user code: tensors laid out otherwise than promised
        would launch with the first call's shapes and strides, unchecked."""
        return self._repeated_launch(grid, constexprs, bind=True)

    def _repeated_launch(self, grid, constexprs: dict, bind: bool) -> Callable:
        kwargs, first, beside, calls = dict(constexprs), None, None, 0

        def run(*args):
            nonlocal first, beside, calls
            try:
                if first is not None and first(grid, args, kwargs):
                    return
                if _interpret_all():
                    return self._interpret(grid, *args, **kwargs)
                plan = self.launch_by_plan(grid, args, kwargs, trusted=True)
                calls += 1
                if not bind:
                    first = plan
                # A bound plan, made beside the full plan that launched: not by
                # a launcher called once, and again only beside a new full plan
                # (e.g. after a global the code read changed).
                elif plan is not None and calls > 1 and plan is not beside:
                    beside, first = plan, self._plan(args, kwargs, bound=True)
                    first = first and launcher.trust(first, kwargs)
            except USER_ERRORS as e:
                raise for_the_user(e)
        return run

    def launch_by_plan(self, grid, args: tuple, kwargs: dict,
                       trusted: bool = False) -> Callable | None:
        """Launch; return the plan that did it (None: the general path), which
        a caller may try first for a call like this one (tk.autotune does).
        trusted=True: `kwargs` is never changed (a launcher's own dict), and
        the plan that launched (its keyword tests passed for it) skips them
        for that very dict from now on (launcher.trust)."""
        plans = self._plans
        for i, plan in enumerate(plans):   # the last one used first
            if plan(grid, args, kwargs):
                if i:                      # (autotuned kernels alternate between plans)
                    _to_front(plans, plan)
                return launcher.trust(plan, kwargs) if trusted else plan
        plan = self._plan(args, kwargs)
        if plan is None:                # not all torch tensors: the general path
            self.launch_general(grid, args, kwargs)
            return None
        self._plans.insert(0, plan)
        del self._plans[_MAX_PLANS:]
        if not plan(grid, args, kwargs):    # its guard refuses what it was made from
            self.launch_general(grid, args, kwargs)    # (e.g. an np.float64 for a float)
            return None
        return launcher.trust(plan, kwargs) if trusted else plan

    def _plan(self, args, kwargs, bound: bool = False) -> Callable | None:
        """Compile for these arguments, check them, and make the launch plan for
        arguments of the same kinds on the same device (see launcher.py); None
        when some tensor argument is not a torch tensor. bound: the plan for
        tensors with these very tensors' metadata (_signature_launcher's)."""
        from .runtime import driver
        values, num_warps = self.params.bind(args, kwargs)
        tensors = launcher.torch_tensor_types()
        if not tensors or any(type(values[i]) not in tensors for i in self.params.tensors) \
                or not all(_peer_of_torch_tensors(values[i], tensors)
                           for i in self.params.peer_tensors) \
                or not self._plan_keywords.issuperset(kwargs):
            return None
        compiled, rules, _, reads, device = self._checked(values, num_warps)
        kinds = tuple(p.passed_as for p in compiled.params)
        # Tensors on another device than torch's current one: launch there,
        # its context pushed around the launch.
        launch = driver.PackedLauncher(compiled.function(device), kinds).bind(
            compiled.num_threads, compiled.smem_bytes,
            in_context=device != driver.default_device())
        return launcher.torch_plan(self.params, values, len(args), kwargs, rules, compiled,
                                   launch, driver.stream_function(device), device, reads, bound)

    def _checked(self, values, num_warps) -> tuple[CompiledKernel, dict, dict, tuple, int]:
        """The compiled kernel for these argument values after checking them,
        the check for each tensor argument, what was read of each tensor, the
        globals the code read, and the device to launch on."""
        infos = {}
        def read(v, name):
            infos[name] = tensor_info(v, name)
            return infos[name]
        sig = self.params.key(values, num_warps, read)
        for i in self.params.peer_tensors:     # (key read each copy under its own name)
            name = self.params[i].name
            infos[name] = read_peers(values[i], name, lambda v, n: infos[n])
        reads, compiled = self._entry(sig)
        rules = self.params.tensor_rules(sig)
        tensors = {i: infos[self.params[i].name] for i in rules}
        on = {}
        for i, rule in rules.items():
            name = self.params[i].name
            for what, t in _copies(name, tensors[i]):
                check_tensor(t, what, **rule)
            on[name] = getattr(tensors[i], "local", tensors[i])   # (a peer's copy may be on
        device = launcher.launch_device(on)                        # another GPU)
        return compiled, rules, tensors, reads, device

    def launch_general(self, grid, args, kwargs) -> None:
        """Any tensor-like arguments: read, check and launch, every call."""
        from .runtime import driver
        from .runtime.tensor_maps import check_tma_tensor
        values, num_warps = self.params.bind(args, kwargs)
        compiled, _, infos, _, device = self._checked(values, num_warps)
        runtime, by_arg, names = self.params.abi_arguments(
            values, {self.params[i].name: t for i, t in infos.items()})
        for p in compiled.params:
            name = names[p.arg]
            if p.kind == "tmap":
                check_tma_tensor(name, by_arg[p.arg])
            elif p.kind in ("i32", "f32"):
                launcher.check_scalar(name, p.kind, runtime[p.arg])
        g = launcher.normalize_grid(grid, dict(zip(self.params.names, values)), compiled.cluster)
        compiled.function(device).launch(
            g, (compiled.num_threads, 1, 1), compiled.smem_bytes, driver.current_stream(device),
            compiled.launch_values(runtime, by_arg), compiled.ctypes)


def _peer_of_torch_tensors(value, tensors: tuple) -> bool:
    """A PeerTensor whose copies are torch tensors (a launch plan holds it)."""
    return isinstance(value, PeerTensor) and all(type(t) in tensors
                                                 for t in (value.local, *value.peers))


def _copies(name: str, info) -> list[tuple[str, object]]:
    """A tensor argument's memory to check, by name: itself, or each copy of
    a tk.pgl argument's (runtime/peers.py PeerInfo)."""
    if getattr(info, "peers", None) is None:
        return [(name, info)]
    return [(n, piece) for n, kind, piece in peer_pieces(name, info) if kind == GL]


class _Interpreting:
    """What `kernel.interpret` (and `interpret_ranks`) is: indexed by a grid,
    a function that runs."""

    def __init__(self, kernel: Kernel, ranks: bool = False):
        self.kernel, self.ranks = kernel, ranks

    def __getitem__(self, grid) -> Callable:
        run = self.kernel._interpret_ranks if self.ranks else self.kernel._interpret
        return functools.partial(run, grid)

    def __call__(self, *args, **kwargs):
        name = "interpret_ranks" if self.ranks else "interpret"
        raise TypeError(f"run a kernel in the interpreter with a grid: "
                        f"{self.kernel.__name__}.{name}[grid](...)")


_INTERPRET_ALL: bool | None = None


def _interpret_all() -> bool:
    """TK_MLIR_INTERPRET, read once, at the process's first launch: reading
    os.environ costs ~2 µs, more than the rest of a launch's host time."""
    global _INTERPRET_ALL
    if _INTERPRET_ALL is None:
        from .knobs import interpret
        _INTERPRET_ALL = interpret()
    return _INTERPRET_ALL


def _to_front(items: list, item) -> None:
    """Move `item` to the front of `items`, the last used first. Lists are
    shared by the threads that launch: another may have moved it already,
    and at worst a cached entry is dropped or listed twice (both harmless)."""
    for j, x in enumerate(items):
        if x is item:
            try:
                del items[j]
            except IndexError:     # another thread changed the list: leave it
                return
            items.insert(0, item)
            return


def _keep(table: OrderedDict, sig: tuple, entry) -> None:
    """Put `entry` first among `sig`'s entries in `table` (signature -> entries,
    the least recently used signature first), keeping at most _MAX_ENTRIES per
    signature and _MAX_CODES in all: the least recently used signatures go, so
    a kernel called with ever new signatures stays bounded. Under the
    kernel's lock (readers look up without it)."""
    entries = [entry] + table.get(sig, [])[:_MAX_ENTRIES - 1]
    table[sig] = entries          # (one store: a reader sees the old list or this one)
    table.move_to_end(sig)
    total = sum(len(e) for e in list(table.values()))
    while total > _MAX_CODES:
        _, dropped = table.popitem(last=False)
        total -= len(dropped)


def _used(table: OrderedDict, sig: tuple) -> None:
    """Mark `sig` the most recently used (move_to_end is atomic: readers need
    no lock); another thread may have dropped it meanwhile."""
    try:
        table.move_to_end(sig)
    except KeyError:
        pass


def kernel(fn: Callable | None = None, *, num_warps: int = DEFAULT_NUM_WARPS,
           fp_contract: bool = True, target: str | None = None):
    """Decorator: `@tk.kernel` or `@tk.kernel(num_warps=8)`. fp_contract=False
    keeps each tile multiply and add rounded on its own (no fma contraction;
    Triton's enable_fp_fusion=False). target="sm_100a" compiles for
    Blackwell instead of Hopper (sm_90a, the default; target.TARGETS): the
    stages down to SASS work without the GPU, and a launch on another GPU is
    an UnsupportedDevice error."""
    if fn is None:
        return lambda f: Kernel(f, num_warps, fp_contract, target)
    return Kernel(fn, num_warps, fp_contract, target)
