"""Eager calls that repeat a signature: a wrapper's checks and choices, made
once and remembered.

A library wrapper checks its arguments and plans its launch from their
metadata alone: each tensor's type, shape, strides, dtype, device, whether
autograd records it, and whether its data pointer is 16-byte aligned (what
TMA and the kernels' vector loads assume), plus the call's options. A model
calls the same few signatures over and over, so each wrapper keeps, per
`signature`, the function its first call prepared (the outputs' allocation
and the planned launch), and a repeat costs a key, a lookup and that
function: the host time a torch op costs, not a Python re-check. Its
launches, made by `launcher(kernel, same_signature=True)`, read from their
second call the tensors' addresses alone: the key holds everything else
about them, and so does it for the tensors the function derives from them
(views, copies, outputs), which must follow from the key alone.

Invariants: a prepared function is stored only after a call with that key
passed every check (a call that breaks a rule raises, as before, and leaves
nothing); a key holds everything the checks and the plan read, so two calls
with one key are checked and planned alike. Calls under torch.compile never
look here (dynamo must not trace a lookup in Python state): wrappers ask
torch.compiler.is_compiling() first. `forget_all()` drops every
wrapper's remembered calls.
"""
from __future__ import annotations

import weakref

# Entries per wrapper; when full, the table is cleared (a model's signatures
# are few: a full table means shapes that change with every call).
CAPACITY = 1024


class _Unkeyed:
    """A key part that cannot be hashed: a call holding one is checked every
    time and never remembered (Prepared.get and add skip unhashable keys)."""
    __hash__ = None

    def __repr__(self):
        return "<not remembered>"


UNKEYED = _Unkeyed()


def tensor_key(t) -> tuple | None | _Unkeyed:
    """What a wrapper's checks read of tensor argument t, hashable: None for
    None (an optional tensor left out). A value that is not a plain strided
    torch tensor (a tensor subclass such as torch.compile's fake tensors,
    whose metadata may not say what the checks read; a sparse or nested
    tensor, which has no data pointer or no one shape; no tensor at all)
    gives UNKEYED: the checks say what is wrong with it."""
    if t is None:
        return None
    if type(t) not in (_PLAIN or _plain_tensor_types()) or t.layout is not _STRIDED or \
            t.is_nested:
        return UNKEYED
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad,
            t.data_ptr() & 15)


def _plain_tensor_types() -> tuple:
    global _PLAIN, _STRIDED
    if _PLAIN is None:
        import torch
        _PLAIN, _STRIDED = (torch.Tensor, torch.nn.Parameter), torch.strided
    return _PLAIN


_PLAIN: tuple | None = None
_STRIDED = None


def empty_rows(x):
    """A new row-major tensor of x's shape, dtype and device: x.new_empty(x.shape)
    at about half its host time (torch.empty_like parses less: 1.5 against
    2.9-3.6 µs on the CPU machine), for the outputs of eager calls."""
    global _EMPTY_LIKE, _ROW_MAJOR
    if _EMPTY_LIKE is None:
        import torch
        _EMPTY_LIKE, _ROW_MAJOR = torch.empty_like, torch.contiguous_format
    return _EMPTY_LIKE(x, memory_format=_ROW_MAJOR)


_EMPTY_LIKE = _ROW_MAJOR = None


def option_key(*options) -> tuple:
    """The call's options with their types: the checks tell True from 1 and
    1 from 1.0, which compare (and hash) equal. A tuple option (a window)
    is taken apart the same way."""
    return tuple([(type(v), option_key(*v) if type(v) is tuple else v) for v in options])


class Prepared:
    """One wrapper's prepared calls by key (see the module docstring)."""

    def __init__(self, capacity: int = CAPACITY):
        self._by_key: dict = {}
        self._capacity = capacity
        _TABLES.add(self)

    def get(self, key):
        """The function prepared for `key`, or None (also for a key that cannot
        be hashed, e.g. a list option: those calls take the checked path)."""
        try:
            return self._by_key.get(key)
        except TypeError:
            return None

    def call(self, key, prepare, *args):
        """The function prepared for `key` called on args; on the first call
        with the key, `prepare()` (which checks the call's arguments, and
        raises for a broken rule) makes it, and it is remembered."""
        run = self.get(key)
        if run is None:
            run = self.add(key, prepare())
        return run(*args)

    def add(self, key, fn):
        """Remember fn for key (a checked call's); returns fn."""
        try:
            hash(key)
        except TypeError:
            return fn
        if len(self._by_key) >= self._capacity:
            self._by_key.clear()
        self._by_key[key] = fn
        return fn

    def __len__(self) -> int:
        return len(self._by_key)

    def clear(self) -> None:
        self._by_key.clear()


_TABLES: weakref.WeakSet = weakref.WeakSet()     # every Prepared, for forget_all


def laid_out(t, shape, strides, dtype):
    """t when it has `dtype`, `strides` and a 16-byte-aligned address (the
    layout a launch bound to a signature was planned for), else a copy of it
    so laid out: for the gradients autograd hands a remembered backward in
    any layout (expanded, transposed, f32). `shape` is t's; `strides` dense."""
    if t.dtype is dtype and t.stride() == strides and not t.data_ptr() & 15:
        return t
    import torch
    return torch.empty_strided(shape, strides, dtype=dtype, device=t.device).copy_(t)


def per_layout(make, saved: int):
    """`run(grad, *args, **keywords)` for a remembered backward whose launches
    are bound to the layouts of the tensors autograd saved (`args[:saved]`):
    the plan `make(*args[:saved])` returns for tensors laid out as these,
    made once per layout seen. Saved tensors come back as the forward saw
    them, unless a saved-tensor hook hands copies laid out otherwise
    (activation offloading's save_on_cpu: a strided view comes back
    contiguous); a plan bound to the forward's layout would read those
    with the wrong strides."""
    plans: dict = {}

    def run(grad, *args, **keywords):
        key = tuple(None if t is None else (t.stride(), t.data_ptr() & 15)
                    for t in args[:saved])
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = make(*args[:saved])
        return plan(grad, *args, **keywords)
    return run


def launcher(kernel, same_signature: bool):
    """kernel's `_signature_launcher` for a function prepared for one signature
    (every call's tensors laid out as the first's: launches read their
    addresses alone), else its `launcher`: a planned launch's maker, for
    wrappers that plan both for a signature and per call."""
    return kernel._signature_launcher if same_signature else kernel.launcher


def forget_all() -> None:
    """Drop every wrapper's remembered calls: each signature's next call is
    checked and planned again. For after a change to what a plan reads but
    no key holds: a module's knob (gemm.CLUSTER_SPLIT_CANDIDATES,
    flash_attention.QUERY_ROW_BYTES_PER_D) or a patched num_sms."""
    for table in list(_TABLES):
        table.clear()
