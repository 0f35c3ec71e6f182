"""The arith ops the frontend emits, per warp on 32-lane (or uniform) values.

Run-time ints are i32 and wrap as on the GPU (numpy int32, overflow
warnings off while the interpreter runs). Where a signed add, subtract or
multiply wraps (a silent wrong offset, if the value is used), the
interpreter warns at the op's line, once per op ([overflow], a
TkLintWarning): not an error, since a value computed but not taken (an
arm of `x if c else y`, which evaluates both) may wrap harmlessly; an int
division by zero warns the same way ([zero-division]). Floats are f32.
"""
from __future__ import annotations

import numpy as np

from ..errors import warn_at_line
from .rules import interprets

# MLIR scalar type -> the numpy type that holds its values.
SCALAR_TYPES = {"i1": np.bool_, "i32": np.int32, "i64": np.int64, "index": np.int64,
                "f32": np.float32}


def holder(t: str) -> type:
    """The numpy type of a scalar MLIR type, given as its text ("i32")."""
    return SCALAR_TYPES[t]


def _same(fn):
    return lambda op, num_warps: lambda w, *operands: fn(*operands)


def _trunc_div(a, b):
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(np.result_type(a, b))


_SAME_TYPE = {
    "maxsi": np.maximum, "minsi": np.minimum,
    "andi": np.bitwise_and, "ori": np.bitwise_or, "xori": np.bitwise_xor,
    "shli": np.left_shift, "shrsi": np.right_shift,
    "addf": np.add, "subf": np.subtract, "mulf": np.multiply, "divf": np.divide,
    "maximumf": np.maximum, "minimumf": np.minimum, "negf": np.negative,
}
for _name, _fn in _SAME_TYPE.items():
    interprets(f"arith.{_name}")(_same(_fn))

_I32 = np.iinfo(np.int32)


def _first_active(w, bad, shape: tuple):
    """The index, in `shape` (the lanes' or a uniform value's), of the first
    active lane where `bad` (a lane array or one uniform bool) holds; None
    where none does."""
    if w.mask is not None and np.ndim(bad):
        bad = bad & w.mask
    if not np.any(bad):
        return None
    return np.flatnonzero(np.broadcast_to(bad, shape))[0] if shape else ()


def _checked(fn, sign: str):
    """An i32 add/subtract/multiply computed in 64 bits and wrapped to 32, as
    the GPU's; the first time an active lane's result leaves [-2**31, 2**31),
    a warning at the op naming the operands (i64 and index ops compute as
    they are)."""
    def factory(op, num_warps):
        if op.result_type != "i32":
            return lambda w, a, b: fn(a, b)
        warned = []

        def run(w, a, b):
            wide = fn(np.asarray(a, np.int64), np.asarray(b, np.int64))
            out = wide.astype(np.int32)
            at = None if warned else _first_active(w, (wide < _I32.min) | (wide > _I32.max),
                                                      np.shape(wide))
            if at is not None:
                warned.append(True)
                x, y, z = (int(np.broadcast_to(v, np.shape(wide))[at]) for v in (a, b, wide))
                warn_at_line(*op.loc, "overflow",
                             f"int overflow: {x} {sign} {y} = {z} does not fit in 32 bits; "
                             f"run-time ints are i32 and the GPU wraps it to "
                             f"{int(np.int64(z).astype(np.int32))} (split the offset, or "
                             f"keep it a compile-time value, tk.constexpr)")
            return out
        return run
    return factory


for _name, (_fn, _sign) in {"addi": (np.add, "+"), "subi": (np.subtract, "-"),
                            "muli": (np.multiply, "*")}.items():
    interprets(f"arith.{_name}")(_checked(_fn, _sign))


def _divided(fn, sign: str):
    """An int division or remainder: numpy's result, and the first time an
    active lane divides by zero, a warning at the op ([zero-division]): the
    GPU's result is then undefined where the interpreter's is 0 (a warning,
    as for overflow: `x // y if y else 0` computes the arm not taken too)."""
    def factory(op, num_warps):
        warned = []

        def run(w, a, b):
            if not warned:
                shape = np.broadcast_shapes(np.shape(a), np.shape(b))
                at = _first_active(w, np.asarray(b) == 0, shape)
                if at is not None:
                    warned.append(True)
                    warn_at_line(*op.loc, "zero-division",
                                 f"int division by zero: {int(np.broadcast_to(a, shape)[at])} "
                                 f"{sign} 0; the GPU's result is undefined (the interpreter's "
                                 f"is 0)")
            return fn(a, b)
        return run
    return factory


for _name, (_fn, _sign) in {"floordivsi": (np.floor_divide, "//"), "divsi": (_trunc_div, "/"),
                            "remsi": (np.fmod, "%")}.items():
    interprets(f"arith.{_name}")(_divided(_fn, _sign))


@interprets("arith.constant")
def _constant(op, num_warps):
    value = holder(op.result_type)(op.value)
    return lambda w: value


@interprets("arith.select")
def _select(op, num_warps):
    return lambda w, c, a, b: np.where(c, a, b)


@interprets("arith.extui", "arith.extsi", "arith.trunci", "arith.index_cast",
            "arith.sitofp")
def _cast(op, num_warps):
    to = holder(op.result_type)
    return lambda w, x: np.asarray(x).astype(to)


@interprets("arith.uitofp")
def _uitofp(op, num_warps):
    src = {np.int32: np.uint32, np.int64: np.uint64}.get(holder(op.operand_types[0]))
    return lambda w, x: (np.asarray(x).view(src) if src else np.asarray(x)).astype(np.float32)


# arith.CmpIPredicate / CmpFPredicate by number. Floats: ordered compares are
# false on NaN (numpy's), unordered ones true (not of the opposite ordered).
_CMPI = {0: np.equal, 1: np.not_equal, 2: np.less, 3: np.less_equal, 4: np.greater,
         5: np.greater_equal}
_UNSIGNED = {6: np.less, 7: np.less_equal, 8: np.greater, 9: np.greater_equal}
_CMPF = {1: np.equal, 2: np.greater, 3: np.greater_equal, 4: np.less, 5: np.less_equal,
         13: np.not_equal}


@interprets("arith.cmpi")
def _cmpi(op, num_warps):
    p = op.predicate
    if p in _UNSIGNED:
        fn = _UNSIGNED[p]
        return lambda w, a, b: fn(np.asarray(a).astype(np.uint64) & 0xFFFFFFFF,
                                  np.asarray(b).astype(np.uint64) & 0xFFFFFFFF)
    return lambda w, a, b: _CMPI[p](a, b)


@interprets("arith.cmpf")
def _cmpf(op, num_warps):
    p = op.predicate
    if p not in _CMPF:
        return None
    return lambda w, a, b: _CMPF[p](a, b)
