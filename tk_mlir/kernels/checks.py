"""The argument checks of the library's torch-facing wrappers.

A wrapper checks what its kernel assumes before anything reaches the GPU, and
says which argument broke which rule: `matmul: b must have a's dtype
torch.bfloat16, got torch.float32` rather than a launch error about kernel
parameter 'B'. Wrong kinds of value (not a tensor, a wrong dtype) raise
TypeError; wrong shapes, devices and options raise ValueError. The checks read
only tensor metadata, and a wrapper asks for a CUDA device last (`on_cuda`,
after its inputs have been checked against each other), so every other rule
shows on CPU tensors too.

What the launcher checks anyway (16-byte alignment of rows and base
addresses for TMA, unit innermost strides) is left to it: its errors
already name the kernel parameter and the rule.
"""
from __future__ import annotations


def _dtype_list(dtypes) -> str:
    names = [str(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def tensor(fn: str, name: str, value, *, ndim: int | None = None, dtypes) -> None:
    """`value` is a dense torch tensor of rank `ndim` (any, when None) and one of
    `dtypes`."""
    import torch
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.is_nested:     # (the kernels read memory)
        kind = "a nested tensor" if value.is_nested else f"layout {value.layout}"
        raise TypeError(f"{fn}: {name} must be a dense (strided) tensor, got {kind}: "
                        f"convert it with .to_dense() (or pad a nested one)")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        raise TypeError(f"{fn}: {name} must be {_dtype_list(dtypes)}, got {value.dtype}")


# How a wrapper runs on CPU tensors (its kernels' launches are its own, so
# kernel.interpret is not at hand): the environment variable, read once.
INTERPRET_LIBRARY = (", or run the library on CPU tensors in the interpreter: "
                     "TK_MLIR_INTERPRET=1 in the environment (read at the process's first "
                     "launch)")


def on_cuda(fn: str, name: str, value, *, on_cpu: str = INTERPRET_LIBRARY) -> None:
    """`value` is on a CUDA device (the others are checked to be on its device),
    or on the CPU under TK_MLIR_INTERPRET=1 (the CPU interpreter runs it).
    `on_cpu`: how the error for a CPU tensor goes on after "move it with .cuda()"."""
    if value.device.type == "cpu":
        from tk_mlir.kernel import _interpret_all
        if _interpret_all():
            return
    if value.device.type != "cuda":
        also = on_cpu if value.device.type == "cpu" else ""
        raise ValueError(f"{fn}: {name} must be on a CUDA device, got {value.device} "
                         f"(the kernel runs on the GPU): move it with .cuda(){also}")


def like(fn: str, name: str, value, ref_name: str, ref, *, dtype: bool = True) -> None:
    """`value` is on `ref`'s device and, with `dtype`, has its dtype."""
    if dtype and value.dtype != ref.dtype:
        raise TypeError(f"{fn}: {name} must have {ref_name}'s dtype {ref.dtype}, "
                        f"got {value.dtype}")
    if value.device != ref.device:
        raise ValueError(f"{fn}: {name} must be on {ref_name}'s device {ref.device}, "
                         f"got {value.device}")


def shape(fn: str, name: str, value, expected: tuple, why: str) -> None:
    """`value` has shape `expected`; `why` says where the shape comes from."""
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{fn}: {name} must have shape {tuple(expected)} ({why}), "
                         f"got {tuple(value.shape)}")


def companion(fn: str, name: str, value, ref_name: str, ref, expected: tuple, why: str, *,
              dtypes) -> None:
    """`value` goes with `ref` (a gradient, a saved output, a state): a tensor of
    one of `dtypes` (tensor), on ref's device (like) and of shape `expected`
    (shape, with `why`)."""
    tensor(fn, name, value, dtypes=dtypes)
    like(fn, name, value, ref_name, ref, dtype=False)
    shape(fn, name, value, expected, why)


def number(fn: str, name: str, value) -> float:
    """`value` as a float, for a scalar kernel parameter such as eps: any real
    number (an int, a float, a numpy scalar as torch's functions take it),
    not a bool."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {name} must be a real number (an int or a float), got "
                        f"{type(value).__name__}")
    return float(value)


def finite(x) -> bool:
    """Whether the number x is finite, in arithmetic a compiler can trace
    (torch.compile hands a symbolic float, which math.isfinite refuses):
    x - x is 0 but for inf and NaN."""
    return x - x == 0


def describe(value) -> str:
    """A tensor's shape, dtype, device and, when not dense, layout (or the type
    of a non-tensor), for messages."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        layout = str(getattr(value, "layout", "torch.strided"))
        sparse = "" if layout == "torch.strided" else f" ({layout}: not dense)"
        kind = type(value)
        # an array of another library (numpy's) is named: its shape reads like a tensor's
        what = "" if kind.__module__.startswith("torch") else \
            f"a {kind.__module__.split('.')[0]}.{kind.__name__} of "
        return (f"{what}shape {tuple(value.shape)} {value.dtype} on "
                f"{getattr(value, 'device', '?')}{sparse}")
    return type(value).__name__


def _contiguous_rows(t) -> bool:
    """t is contiguous, 16-byte aligned, its rows whole 16-byte vectors: what
    most operands are, per operand per call, in three cheap reads."""
    return t.is_contiguous() and not t.data_ptr() & 15 and not t.shape[-1] * t.element_size() & 15


def readable(t) -> bool:
    """Whether kernels read (and write) t as it lies: runtime.arguments'
    vector_rows."""
    if _contiguous_rows(t):
        return True
    from tk_mlir.runtime.arguments import vector_rows
    return vector_rows(t.shape, t.stride(), t.element_size(), t.data_ptr())


def kernel_operand(t, dtype=None):
    """t as the kernels read a tensor: of `dtype` (default its own), last dim
    contiguous, base and row strides 16-byte aligned, and no dim overlapping
    another (no stride-0 expanded dims): t itself when it is, else a
    contiguous copy. For tensors autograd hands a backward, which may be
    expanded (the gradient of y.sum()), f32, or views at any offset (the
    gradient of a torch.cat's part)."""
    import torch
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if _contiguous_rows(t):
        return t
    size = t.element_size()
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and not overlapping(t)
    ok = ok and all(s * size % 16 == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n != 1)
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def laid_out_as_given(t, given, used):
    """t, an output computed from `used` (`given` itself, or the copy of it
    kernel_operand made), laid out as torch.empty_like(given) lays it out
    (an op's fake does): a copy only where `used` was a copy of another
    layout."""
    if used is given:
        return t
    import torch
    want = torch.empty_like(given)
    return t if want.stride() == t.stride() else want.copy_(t)


def as_rows(t, view: bool = False):
    """t (..., D) as (rows, D): its leading dims flattened, a view where the
    strides allow (an output must be one: view=True), else a copy; an input
    the kernels cannot read as it lies (a transposed last dim, a misaligned
    view) through an aligned copy (kernel_operand)."""
    if view:
        return t if t.dim() == 2 else t.view(-1, t.shape[-1])
    t = kernel_operand(t)
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def rows_as_they_lie(t) -> bool:
    """Whether as_rows(t) is t itself, and as_rows(out, view=True) out for an
    out like t (2-D, and read as it lies): for every tensor of t's shape,
    strides and alignment, so a planned launch decides it once."""
    return t.dim() == 2 and kernel_operand(t) is t


def written_in_place(fn: str, name: str, t) -> None:
    """Refuse an output the caller gives whose elements share memory (an
    expanded or self-overlapping view): one result could not be written into
    it, and the GPU's writes to it would race."""
    if overlapping(t):
        raise ValueError(f"{fn}: {name} is written in place and must not have elements that "
                         f"share memory (an expanded or overlapping view), got shape "
                         f"{tuple(t.shape)} with strides {tuple(t.stride())}")


def output_outside_autograd(fn: str, name: str, out) -> None:
    """Refuse an output to write into that requires grad while grad mode is
    on: it would be overwritten behind autograd's back (torch refuses out=
    tensors that require grad too)."""
    import torch
    if out is not None and getattr(out, "requires_grad", False) and torch.is_grad_enabled():
        raise RuntimeError(f"{fn}: {name} (the output to write into) requires grad, and an "
                           f"output written in place does not take part in autograd; pass one "
                           f"that does not (e.g. {name}.detach()), or call under "
                           f"torch.no_grad()")


def flags(fn: str, **named) -> None:
    """Each named option is a bool (not 1, not "yes"), else a TypeError naming
    it and what it got."""
    for name, value in named.items():
        if not isinstance(value, bool):
            raise TypeError(f"{fn}: {name} must be a bool, got {value!r}")


# FlashAttention's names of options the attention functions spell otherwise,
# and those options' defaults there (a value other than it was given).
FLASH_NAMES = {"softmax_scale": "scale", "window_size": "window",
               "return_softmax_lse": "return_lse"}
_DEFAULTS = {"scale": None, "window": (-1, -1), "return_lse": False}


def flash_names(fn: str, ours: dict, theirs: dict) -> tuple:
    """The values of `ours` (name -> value), in its order, with each of
    FlashAttention's spellings in `theirs` (name -> value, None when not
    given) taken in its place, so code written for flash_attn switches by its
    import; both spellings of one option at once is a TypeError."""
    out = dict(ours)
    for name, value in theirs.items():
        if value is not None:
            mine = FLASH_NAMES[name]
            if ours[mine] != _DEFAULTS[mine]:
                raise TypeError(f"{fn}: {name} is FlashAttention's name for {mine}; give one of "
                                f"them, got both ({name}={value!r}, {mine}={ours[mine]!r})")
            if isinstance(_DEFAULTS[mine], bool):      # (checked in the caller's spelling)
                flags(fn, **{name: value})
            out[mine] = value
    return tuple(out.values())


def written_apart(fn: str, name: str, out, in_place: tuple[str, ...] = (), **inputs) -> None:
    """Refuse an output the caller gives that may share memory with an input
    it is computed from: the kernels read the input while they write the
    output (a race: a wrong result, as torch.mm(a, b, out=a) gives), unless
    the input is named in `in_place` and out is exactly it (the same view: a
    row-wise kernel reads each row before writing it). Checked on every
    call (two calls of one signature may alias differently), so kept to a
    few attribute reads. Arguments that are not tensors are left to the
    type checks."""
    if not hasattr(out, "data_ptr"):
        return
    lo, hi = _span(out)
    for other, t in inputs.items():
        if other in in_place and hasattr(t, "data_ptr") and t.data_ptr() == out.data_ptr() \
                and t.shape == out.shape and t.stride() == out.stride():
            continue
        if hasattr(t, "data_ptr"):
            t_lo, t_hi = _span(t)
            if lo < t_hi and t_lo < hi and _share_an_element(out, t):
                raise ValueError(f"{fn}: {name} is written while {other} is read and must not "
                                 f"share memory with it (their bytes overlap); write into a "
                                 f"separate tensor")


def _share_an_element(a, b) -> bool:
    """Whether a and b, whose spans meet, may share an element: exactly for
    two views of one layout (shape, strides, element size) at element-aligned
    offsets, such as the halves of a packed K/V cache or of a row (b's first
    element d elements on is a's element at index i - j for some i, j within
    the shape: with each stride past the reach of those below, each dim's
    step is d's quotient rounded down or up); otherwise (True) as the spans
    say."""
    size = a.element_size()
    if a.shape != b.shape or a.stride() != b.stride() or size != b.element_size() or \
            (b.data_ptr() - a.data_ptr()) % size or overlapping(a):
        return True
    dims = sorted(((s, n) for n, s in zip(a.shape, a.stride()) if n != 1), reverse=True)

    def reaches(d: int, k: int) -> bool:
        if k == len(dims):
            return d == 0
        step, n = dims[k]
        return any(abs(m) < n and reaches(d - m * step, k + 1)
                   for m in {d // step, -(-d // step)})
    return reaches((b.data_ptr() - a.data_ptr()) // size, 0)


def _span(t) -> tuple[int, int]:
    """The addresses from t's first byte to one past its last (empty for an
    empty t; interleaved views' spans meet, a conservative answer)."""
    first = t.data_ptr()
    if t.is_contiguous():
        return first, first + t.nbytes
    if not t.numel():
        return first, first
    return first, first + t.element_size() * (1 + sum((n - 1) * s for n, s in
                                                      zip(t.shape, t.stride())))


def overlapping(t) -> bool:
    """Whether two elements of t may share memory: its dims (of more than one
    element) taken by stride, one steps no further than the dims below it
    reach (an expanded, stride-0 dim, or interleaved ones). Dims out of
    row-major order do not overlap (a permuted view: the kernels take any
    strides)."""
    reach = 0
    for step, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if step <= reach:
            return True
        reach += step * (n - 1)
    return False


def int32_table(t):
    """An int32 table (lengths, page tables) as a kernel argument: rows of
    whole 16-byte vectors, as every tensor argument's (the kernels read it an
    element at a time; the padding is never read): t itself when its rows
    already are, else a copy padded with zeros to a multiple of 4 columns."""
    import torch
    if t.shape[-1] % 4 == 0:
        return kernel_operand(t)
    return torch.nn.functional.pad(t, (0, 4 - t.shape[-1] % 4))


def int32_vectors(*tables) -> tuple:
    """Kernel operands of 1-D int32 tables (cu_seqlens) as int32_table makes
    them (rows of whole 16-byte vectors), those that need padding copied by
    one launch: a cat into one buffer, each table's copy on a 16-byte
    boundary, its padding left unwritten (for kernels that read a table's
    own entries only); a table passed twice is copied once. An eager call
    pays ~8 µs of host time per launch, and F.pad is two (a fill, a copy)."""
    import torch
    padded = {id(t): t for t in tables if len(t) % 4}
    if not padded:
        return tuple(kernel_operand(t) for t in tables)
    pieces, at, fill = [], {}, {}
    for key, t in padded.items():
        extra = -len(t) % 4
        if extra not in fill:
            fill[extra] = t.new_empty(extra)
        at[key] = sum(map(len, pieces))
        pieces += [t, fill[extra]]
    whole = torch.cat(pieces)
    return tuple(whole[at[id(t)]:at[id(t)] + len(t) + -len(t) % 4] if id(t) in at
                 else kernel_operand(t) for t in tables)


def attention_scale(fn: str, value, d: int) -> float:
    """An attention's scale argument: 1/sqrt(d) for None, else a positive
    finite number."""
    import math
    if value is None:
        return 1.0 / math.sqrt(d)
    value = number(fn, "scale", value)
    if not (finite(value) and value > 0):
        raise ValueError(f"{fn}: scale must be a positive finite number, got {value!r}")
    return value


def window(fn: str, value, reach: int) -> tuple[int, int]:
    """A window=(left, right) argument (FlashAttention's window_size): two
    ints >= -1, -1 for no bound on that side. A side of at least `reach` (more
    than any distance between a query and a key of the call) bounds nothing
    and comes back as -1, so the kernels' 32-bit position sums cannot wrap."""
    import numbers
    rule = (f"{fn}: window must be (left, right), two ints >= -1 (-1: no bound on that side), "
            f"got {value!r}")
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and
            all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                for w in value)):          # (numpy's ints too, as eps and scale take them)
        raise TypeError(rule)              # (a wrong kind of value)
    if not all(w >= -1 for w in value):
        raise ValueError(rule)
    left, right = (-1 if w >= reach else int(w) for w in value)
    return left, right


# The largest softcap the kernels take: their tanh(x) = 1 - 2 / (exp(2x) + 1)
# is off by ~1e-7 near 0, an error softcap times larger in the capped scores
# (1e-3 here; at 1e6 attention came out 0.1 off, at 1e8 near uniform).
MAX_SOFTCAP = 1e4


def softcap(fn: str, value) -> float:
    """A softcap argument: a finite number >= 0 (0: none), at most MAX_SOFTCAP."""
    value = nonnegative(fn, "softcap", value, " (0: none)")
    if value > MAX_SOFTCAP:
        raise ValueError(f"{fn}: softcap must be at most {MAX_SOFTCAP:g} (the kernels' tanh "
                         f"loses precision near 0, visible in scores capped by more; a cap "
                         f"that large caps nothing: pass softcap=0.0), got {value!r}")
    return value


def nonnegative(fn: str, name: str, value, note: str = "") -> float:
    """`value` as a finite float >= 0 (eps, softcap); `note` follows the rule."""
    value = number(fn, name, value)
    if not (finite(value) and value >= 0):
        raise ValueError(f"{fn}: {name} must be a finite number >= 0{note}, got {value!r}")
    return value


def attention_options(fn: str, d: int, reach: int, scale, window_, softcap_):
    """(scale, left, right, softcap) of an attention call with head dim d,
    each checked (attention_scale, window with its `reach`, softcap)."""
    left, right = window(fn, window_, reach)
    return attention_scale(fn, scale, d), left, right, softcap(fn, softcap_)


def warn_no_gradient(fn: str, instead: str, *tensors) -> None:
    """Warn (once per call site, Python's default) when autograd would record
    a call of `fn`, an inference function whose outputs carry no gradient:
    a loss through them would silently miss its inputs' share."""
    import torch
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        import warnings
        from tk_mlir.errors import user_stacklevel
        warnings.warn(f"{fn} returns no gradient (it is for inference), and an input requires "
                      f"grad: call it under torch.no_grad(), or {instead} to train",
                      stacklevel=user_stacklevel())
