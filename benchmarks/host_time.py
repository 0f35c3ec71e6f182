"""Eager host time per call of each tk_mlir.kernels function against its torch
peer (issue 23), with the same tensors on every call and with 32 rotating
tensor sets (as in a model: new activations, many weights); and the first
eager call's cost in a fresh process.

    python benchmarks/host_time.py [--calls 10000] [--quick] [--only NAME[,NAME]]
                                   [--out-dir benchmarks/results]
    python benchmarks/host_time.py --first-call [--only NAME[,NAME]]
    python benchmarks/host_time.py --list          # the names --only takes

Calls are timed in rounds of 200 between device syncs (protocol.host_us_per_call),
so the launch queue never fills and the time per call is the host's even
where the GPU work is longer: what the Python entry point costs. Each
function and its peer run on bit-identical inputs; every tensor set is
checked once against the peer before timing (relative error of each output,
and of the in-place form into a NaN-poisoned output where the API has one).
A wrong or failing implementation marks its row; the run goes on.

Functions (names for --only) and peers:
- matmul_64x256x256, matmul_16x4096x4096 (the split-K plan): `a @ b.T`;
- rms_norm: `F.rms_norm`; layer_norm: `F.layer_norm` (16 x 4096 bf16);
- fused_add_rms_norm: h = x + residual and rms_norm(h), against `h = x + r`
  then `F.rms_norm(h)` (16 x 4096 bf16);
- attention_fwd: 1x8x128x128 bf16 causal, against SDPA (is_causal=True);
- attention_fwd_bwd: the same, forward then `torch.autograd.grad` with a
  given output gradient, against SDPA's;
- attention_varlen_fwd, attention_varlen_fwd_bwd: 4 packed sequences of
  100/37/128/64 tokens x 8 heads x 128 bf16 causal, the offsets one tensor
  for every set (a batch's, shared by a model's layers), against SDPA over
  a jagged nested tensor of the same sequences;
- scaled_matmul: fp8 e4m3 64x2048x2048, per-tensor scales, against
  `torch._scaled_mm` (use_fast_accum=True) with the same scales;
- grouped_matmul: 8 x (128 x 1024 x 1024), sizes on the device (all 128
  rows), against `torch.bmm` of the same sizes;
- swiglu: 16 x 14336 bf16, against `F.silu(gate) * up`;
- rotary_embedding: x 1x128x32x128 bf16, cos/sin (128, 64) f32, against a
  transformers-style `x * cos + rotate_half(x) * sin` (cos and sin repeated
  to D and broadcast over the heads, as a model keeps them);
- gemm_launch: the GEMM's launch rows at --size^3: `matmul(a, b, c)`,
  `torch.mm(a, b.T, out=c)`, `gemm_kernel[grid]` (autotuned dispatch) and the
  tuned kernel launched directly with its config (no dispatch). The bare
  cuLaunchKernel floor of a tiny kernel is benchmarks/launch_overhead.py's.

The table: host µs per call, tk_mlir / peer, same tensors and rotating, and
the ratio tk_mlir / peer (issue 23's goal: <= 1, aim 0.8). Written as
host_time.json (+ .png) by protocol.write_results: one row per function,
implementation and mode (impl "tk same", "tk rotating", "peer same", "peer
rotating"; name: the peer's), the GEMM launch rows, and the table itself in
meta["table"].

`--first-call`: per function (tk_mlir and peer), a fresh process
(sys.executable) imports torch, loads the function's module, makes its
inputs (CUDA context up, synced), then times the first eager call to its
sync. Each is run twice and the second run reported (the first warms the
disk cache, TK_MLIR_CACHE_DIR or the default). Reported: seconds of the
first call (beyond importing torch and loading the module), of the second
call, of the imports, and whether `torch._dynamo` / `torch._inductor` are in
sys.modules before and after the call. Written as host_time_first_call.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

# Nothing heavy at import: a --first-call child imports this file after
# timing `import torch`, and must load only the function's own module.
ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
SETS = 32           # rotating tensor sets
DEVICE = "cuda"     # where inputs are made (a CPU dry run of the script's logic sets "cpu")


# --- the functions and their peers ------------------------------------------

class Case:
    """One library function and its peer on one shape.

    make(g): one tensor set (a tuple) from a torch.Generator on cuda;
    tk(*set), peer(*set): the outputs (a tensor or a tuple of tensors);
    inplace(*set): optional, tk_mlir's in-place form into NaN-poisoned
    outputs, returning them (checked against the peer too); api: the
    function's name in tk_mlir.kernels."""

    def __init__(self, name, function, peer_name, shape, api, make, tk, peer,
                 inplace=None, tol=2e-2):
        self.name, self.function, self.peer_name, self.shape = name, function, peer_name, shape
        self.api = api          # its name in tk_mlir.kernels: what a --first-call child loads
        self.make, self.tk, self.peer, self.inplace, self.tol = make, tk, peer, inplace, tol


def _u(g, *shape, dtype=None, scale=1.0):
    import torch
    t = torch.empty(*shape, dtype=torch.float32, device=DEVICE).uniform_(-scale, scale,
                                                                          generator=g)
    return t.to(dtype or torch.bfloat16)


def _matmul_case(m, n, k):
    def make(g):
        return _u(g, m, k), _u(g, n, k)

    def tk(a, b):
        from tk_mlir.kernels import matmul
        return matmul(a, b)

    def inplace(a, b):
        import torch
        from tk_mlir.kernels import matmul
        c = torch.full((m, n), float("nan"), dtype=a.dtype, device=a.device)
        matmul(a, b, c)
        return c

    return Case(f"matmul_{m}x{n}x{k}", f"matmul {m}x{n}x{k}", "a @ b.T",
                f"{m}x{n}x{k} bf16", "matmul", make, tk,
                lambda a, b: a @ b.T, inplace)


def _norm_case(which, rows=16, d=4096):
    def make(g):
        x = _u(g, rows, d, scale=2.0)
        w = _u(g, d) + 1
        return (x, w) if which == "rms_norm" else (x, w, _u(g, d))

    def tk(*s):
        from tk_mlir.kernels import layer_norm, rms_norm
        return rms_norm(*s, 1e-6) if which == "rms_norm" else layer_norm(*s, 1e-5)

    def peer(*s):
        import torch.nn.functional as F
        if which == "rms_norm":
            return F.rms_norm(s[0], (d,), s[1], 1e-6)
        return F.layer_norm(s[0], (d,), s[1], s[2], 1e-5)

    def inplace(*s):
        import torch
        from tk_mlir.kernels import layer_norm, rms_norm
        out = torch.full_like(s[0], float("nan"))
        if which == "rms_norm":
            rms_norm(*s, 1e-6, out=out)
        else:
            layer_norm(*s, 1e-5, out=out)
        return out

    return Case(which, f"{which} {rows}x{d}", f"F.{which}", f"{rows}x{d} bf16", which,
                make, tk, peer, inplace)


def _fused_add_case(rows=16, d=4096):
    def make(g):
        return _u(g, rows, d, scale=2.0), _u(g, rows, d), _u(g, d) + 1

    def tk(x, r, w):
        from tk_mlir.kernels import fused_add_rms_norm
        return fused_add_rms_norm(x, r, w, 1e-6)

    def peer(x, r, w):
        import torch.nn.functional as F
        h = x + r
        return F.rms_norm(h, (d,), w, 1e-6), h

    return Case("fused_add_rms_norm", f"fused_add_rms_norm {rows}x{d}", "x + r, F.rms_norm",
                f"{rows}x{d} bf16", "fused_add_rms_norm", make, tk, peer)


def _qkv(g, backward: bool, *shape) -> tuple:
    """An attention case's set: q, k, v of `shape`, and with `backward` also
    the output's gradient (q, k, v requiring grad)."""
    q, k, v = (_u(g, *shape) for _ in range(3))
    if not backward:
        return q, k, v
    return (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), _u(g, *shape))


def _run_attention(attn, q, k, v, do=None):
    """attn(q, k, v), and with `do` its gradients too: (o, dq, dk, dv)."""
    import torch
    o = attn(q, k, v)
    if do is None:
        return o
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


def _attention_case(backward, b=1, h=8, n=128, d=128):
    def make(g):
        return _qkv(g, backward, b, h, n, d)

    def tk(*s):
        from tk_mlir.kernels import attention
        return _run_attention(lambda q, k, v: attention(q, k, v, causal=True), *s)

    def peer(*s):
        import torch.nn.functional as F
        return _run_attention(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), *s)

    what = "fwd+bwd" if backward else "fwd"
    return Case(f"attention_{what.replace('+', '_')}", f"attention {what} {b}x{h}x{n}x{d} causal",
                f"SDPA {what}", f"{b}x{h}x{n}x{d} bf16 causal", "attention",
                make, tk, peer, tol=3e-2)


def _varlen_case(backward, lens=(100, 37, 128, 64), h=8, d=128):
    """attention_varlen over packed sequences, the offsets one tensor shared by
    every set (a model's layers share a batch's); the peer SDPA over a jagged
    nested tensor of the same sequences."""
    offsets = []

    def cu():
        import torch
        if not offsets:
            offsets.append(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                        dtype=torch.int32, device=DEVICE))
        return offsets[0]

    def make(g):
        return _qkv(g, backward, sum(lens), h, d)

    def tk(*s):
        from tk_mlir.kernels import attention_varlen
        return _run_attention(lambda q, k, v: attention_varlen(q, k, v, cu(), cu(), max(lens),
                                                               max(lens), causal=True), *s)

    def peer(*s):
        import torch
        import torch.nn.functional as F

        def nested(q, k, v):
            qn, kn, vn = (torch.nested.nested_tensor_from_jagged(
                t, cu().long(), min_seqlen=min(lens), max_seqlen=max(lens)).transpose(1, 2)
                for t in (q, k, v))
            return F.scaled_dot_product_attention(qn, kn, vn, is_causal=True).transpose(
                1, 2).values()
        return _run_attention(nested, *s)

    what = "fwd+bwd" if backward else "fwd"
    shape = f"{len(lens)} seqs {'/'.join(map(str, lens))} x {h} x {d} causal"
    return Case(f"attention_varlen_{what.replace('+', '_')}", f"attention_varlen {what} {shape}",
                f"SDPA nested {what}", f"{shape} bf16", "attention_varlen", make, tk, peer,
                tol=3e-2)


def _scaled_case(m=64, n=2048, k=2048):
    def make(g):
        import torch
        a = _u(g, m, k, dtype=torch.float32, scale=4.0).to(torch.float8_e4m3fn)
        bt = _u(g, n, k, dtype=torch.float32, scale=4.0).to(torch.float8_e4m3fn)
        sa = torch.tensor(0.5, device=DEVICE)
        sb = torch.tensor(0.25, device=DEVICE)
        return a, bt.t(), sa, sb       # b: K x N column-major, as torch._scaled_mm takes it

    def tk(a, b, sa, sb):
        import torch
        from tk_mlir.kernels import scaled_matmul
        return scaled_matmul(a, b, sa, sb, torch.bfloat16)

    def peer(a, b, sa, sb):
        import torch
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    return Case("scaled_matmul", f"scaled_matmul {m}x{n}x{k} fp8 e4m3", "torch._scaled_mm",
                f"{m}x{n}x{k} e4m3, per-tensor scales", "scaled_matmul",
                make, tk, peer)


def _grouped_case(groups=8, m=128, n=1024, k=1024):
    def make(g):
        import torch
        sizes = torch.full((groups,), m, dtype=torch.int32, device=DEVICE)
        return _u(g, groups, m, k), _u(g, groups, n, k), sizes

    def tk(a, b, sizes):
        from tk_mlir.kernels import grouped_matmul
        return grouped_matmul(a, b, sizes)

    def peer(a, b, sizes):
        import torch
        return torch.bmm(a, b.transpose(1, 2))

    def inplace(a, b, sizes):
        import torch
        from tk_mlir.kernels import grouped_matmul
        c = torch.full((groups, m, n), float("nan"), dtype=a.dtype, device=a.device)
        grouped_matmul(a, b, sizes, c)
        return c

    return Case("grouped_matmul", f"grouped_matmul {groups}x({m}x{n}x{k})", "torch.bmm",
                f"G={groups}, {m}x{n}x{k} bf16, device sizes", "grouped_matmul",
                make, tk, peer, inplace)


def _swiglu_case(rows=16, d=14336):
    def make(g):
        return _u(g, rows, d, scale=3.0), _u(g, rows, d)

    def tk(gate, up):
        from tk_mlir.kernels import swiglu
        return swiglu(gate, up)

    def peer(gate, up):
        import torch.nn.functional as F
        return F.silu(gate) * up

    return Case("swiglu", f"swiglu {rows}x{d}", "F.silu(gate) * up", f"{rows}x{d} bf16",
                "swiglu", make, tk, peer)


def _rotary_case(b=1, n=128, h=32, d=128):
    def make(g):
        import torch
        angles = torch.rand(n, d // 2, generator=g, device=DEVICE) * 6
        full = torch.cat((angles, angles), -1)[None, :, None]      # the peer's (1, N, 1, D)
        return (_u(g, b, n, h, d), angles.cos(), angles.sin(), full.cos().to(torch.bfloat16),
                full.sin().to(torch.bfloat16))

    def tk(x, cos, sin, cos_full, sin_full):
        from tk_mlir.kernels import rotary_embedding
        return rotary_embedding(x, cos, sin)

    def peer(x, cos, sin, cos_full, sin_full):
        import torch
        half = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
        return x * cos_full + half * sin_full

    return Case("rotary_embedding", f"rotary_embedding {b}x{n}x{h}x{d}",
                "x * cos + rotate_half(x) * sin", f"{b}x{n}x{h}x{d} bf16", "rotary_embedding",
                make, tk, peer)


def cases() -> dict[str, Case]:
    all_cases = [_matmul_case(64, 256, 256), _matmul_case(16, 4096, 4096),
                 _norm_case("rms_norm"), _norm_case("layer_norm"), _fused_add_case(),
                 _attention_case(False), _attention_case(True),
                 _varlen_case(False), _varlen_case(True),
                 _scaled_case(), _grouped_case(), _swiglu_case(), _rotary_case()]
    return {c.name: c for c in all_cases}


GEMM_LAUNCH = "gemm_launch"


def _names() -> list[str]:
    return [*cases(), GEMM_LAUNCH]


# --- checks and timing --------------------------------------------------------

def _outputs(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def rel_err(got, want) -> float:
    """The largest relative error (Frobenius) over the outputs; inf for a
    shape mismatch or a non-finite output where the reference is finite."""
    got, want = _outputs(got), _outputs(want)
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for x, y in zip(got, want):
        if tuple(x.shape) != tuple(y.shape):
            return math.inf
        x, y = x.detach().float(), y.detach().float()
        if not bool(x.isfinite().all()) and bool(y.isfinite().all()):
            return math.inf
        worst = max(worst, ((x - y).norm() / y.norm().clamp_min(1e-30)).item())
    return worst


def check_case(case: Case, sets: list) -> tuple[float | None, str | None, str | None]:
    """(worst relative error, tk_mlir's failure, the peer's failure) over
    every tensor set, tk_mlir against the peer. A failure is None or a short
    line. tk_mlir is unchecked (error None) when the peer fails."""
    from protocol import first_line
    worst, tk_fail, peer_fail = 0.0, None, None
    for i, s in enumerate(sets):
        try:
            want = case.peer(*s)
        except Exception as e:
            return None, "unchecked: the peer failed", first_line(e)
        try:
            forms = [("", case.tk)] + ([(" (in place, poisoned out)", case.inplace)]
                                       if case.inplace and i == 0 else [])
            for label, fn in forms:
                err = rel_err(fn(*s), want)
                worst = max(worst, err)
                if not err <= case.tol:
                    tk_fail = tk_fail or f"wrong{label}: rel err {err:.2e} on set {i}"
        except Exception as e:
            return None, first_line(e), peer_fail
    import torch
    torch.cuda.synchronize()
    return worst, tk_fail, peer_fail


def time_pair(fn, sets: list, calls: int) -> tuple[float, float]:
    """(same-tensor µs, rotating µs) per call of fn."""
    from protocol import host_us_per_call
    s0 = sets[0]
    same = host_us_per_call(lambda: fn(*s0), calls)
    nxt = itertools.cycle(sets).__next__
    rot = host_us_per_call(lambda: fn(*nxt()), calls)
    return same, rot


def measure(case: Case, calls: int) -> tuple[dict, list[dict]]:
    """(the table's row, the JSON's rows: one per implementation and mode)."""
    import torch
    from protocol import first_line
    row = {"function": case.function, "peer": case.peer_name, "status": "ok"}
    long = []
    try:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        sets = [case.make(g) for _ in range(SETS)]
    except Exception as e:
        row["status"] = f"inputs failed: {first_line(e)}"
        return row, long
    err, tk_fail, peer_fail = check_case(case, sets)
    row["rel_err"] = err
    notes = []
    for impl, fn, fail in (("tk", case.tk, tk_fail), ("peer", case.peer, peer_fail)):
        name = "tk_mlir" if impl == "tk" else case.peer_name
        if fail and not fail.startswith("unchecked"):
            notes.append(f"{name}: {fail}")
            long.append({"op": case.name, "shape": case.shape, "impl": f"{impl} same",
                         "name": name, "status": fail})
            continue
        if fail:
            notes.append(f"{name}: {fail}")
        try:
            same, rot = time_pair(fn, sets, calls)
        except Exception as e:
            notes.append(f"{name} timing: {first_line(e)}")
            continue
        row[f"{impl}_same"], row[f"{impl}_rot"] = same, rot
        for mode, us in (("same", same), ("rotating", rot)):
            long.append({"op": case.name, "shape": case.shape, "impl": f"{impl} {mode}",
                         "name": name, "us": us, "rel_err": err, "status": fail or "ok"})
    for mode in ("same", "rot"):
        if row.get(f"tk_{mode}") and row.get(f"peer_{mode}"):
            row[f"ratio_{mode}"] = row[f"tk_{mode}"] / row[f"peer_{mode}"]
    if notes:
        row["status"] = "; ".join(notes)
    print(f"  {case.function}: tk {row.get('tk_same', math.nan):.1f} / "
          f"{row.get('tk_rot', math.nan):.1f} µs, {case.peer_name} "
          f"{row.get('peer_same', math.nan):.1f} / {row.get('peer_rot', math.nan):.1f} µs, "
          f"err {err if err is not None else math.nan:.1e}  {row['status']}", flush=True)
    return row, long


def gemm_launch_rows(n: int, calls: int) -> list[dict]:
    """The GEMM's launch rows (the user-kernel launch, with and without the
    autotuned dispatch) at n^3 bf16, after a correctness check."""
    import torch
    from protocol import host_us_per_call
    from tk_mlir.kernels import matmul
    from tk_mlir.kernels.device import num_sms
    from tk_mlir.kernels.gemm import gemm_kernel, plan
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.empty(n, n, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1, generator=g)
    b = torch.empty(n, n, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1, generator=g)
    c = torch.full((n, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    matmul(a, b, c)
    ref = a.float() @ b.float().T
    err = ((c.float() - ref).norm() / ref.norm()).item()
    status = "ok" if err < 1e-2 else f"wrong: rel err {err:.2e}"
    grid = (num_sms(a.get_device()),)
    chosen = plan(n, n, n, grid[0])
    # The kernel matmul launches: the autotuned one's chosen config, or the plan's tile
    if chosen.kernel == "tiles":
        config, kw = chosen.why, dict(chosen.config)
    else:
        config = gemm_kernel.best_config(a, b, c)
        kw = config.all_kwargs()
    direct = gemm_kernel.kernel[grid]
    compiled = gemm_kernel.kernel.compile(a, b, c, **kw)
    print(f"gemm launch: {n}^3 bf16, {compiled.name}, relative error {err:.1e}, {config!r}")
    shape = f"{n}^3 bf16"
    impls = [("tk_mlir matmul(a, b, c)", lambda: matmul(a, b, c)),
             ("torch.mm(a, b.T, out=c)", lambda: torch.mm(a, b.T, out=c)),
             ("tk_mlir gemm_kernel[grid](a, b, c) (autotuned dispatch)",
              lambda: gemm_kernel[grid](a, b, c)),
             (f"tk_mlir gemm_kernel.kernel[grid](a, b, c, **{kw}) (no dispatch)",
              lambda: direct(a, b, c, **kw))]
    return [{"op": "gemm launch", "shape": shape, "impl": name, "rel_err": err,
             "status": status, "us": host_us_per_call(fn, calls)} for name, fn in impls]


TABLE = [("function", "function"), ("peer", "peer"),
         ("tk_same", "same µs tk"), ("peer_same", "same µs peer"),
         ("tk_rot", "rotating µs tk"), ("peer_rot", "rotating µs peer"),
         ("ratio_same", "tk/peer same"), ("ratio_rot", "tk/peer rotating"),
         ("rel_err", "rel err"), ("status", "status")]


# --- the first call in a fresh process -----------------------------------------

def first_call_child(name: str, impl: str) -> None:
    """Run in a fresh process (main's --first-call): times, after `import
    torch` and loading the function's module, the first eager call to its
    sync; prints one JSON line."""
    t0 = time.perf_counter()
    import importlib

    import torch
    t1 = time.perf_counter()
    case = cases()[name]
    if impl == "tk":     # the module, and custom_ops registered as any use of the name does
        getattr(importlib.import_module("tk_mlir.kernels"), case.api)
    t2 = time.perf_counter()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    s = case.make(g)
    torch.cuda.synchronize()
    mods = lambda: {m: m in sys.modules for m in ("torch._dynamo", "torch._inductor")}  # noqa
    before = mods()
    fn = case.tk if impl == "tk" else case.peer
    t3 = time.perf_counter()
    fn(*s)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    fn(*s)
    torch.cuda.synchronize()
    t5 = time.perf_counter()
    print("FIRST_CALL " + json.dumps({
        "import_torch_s": t1 - t0, "load_module_s": t2 - t1, "inputs_s": t3 - t2,
        "first_call_s": t4 - t3, "second_call_s": t5 - t4,
        "dynamo_before": before["torch._dynamo"], "inductor_before": before["torch._inductor"],
        **{k.replace("torch._", "") + "_after": v for k, v in mods().items()}}), flush=True)


def run_first_call(name: str, impl: str, timeout: float = 600) -> dict:
    code = (f"import sys; sys.path.insert(0, {str(BENCH)!r}); import host_time; "
            f"host_time.first_call_child({name!r}, {impl!r})")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout, cwd=str(ROOT), env=os.environ.copy())
    for line in p.stdout.splitlines():
        if line.startswith("FIRST_CALL "):
            return json.loads(line[len("FIRST_CALL "):])
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return {"status": f"exit {p.returncode}: {tail}"}


def first_calls(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        case = cases()[name]
        for impl in ("tk", "peer"):
            label = "tk_mlir" if impl == "tk" else case.peer_name
            warm = run_first_call(name, impl)      # warms the disk cache (and the OS's)
            r = run_first_call(name, impl)
            row = {"op": case.function, "shape": case.shape, "impl": label,
                   "cold_or_warming_first_call_s": warm.get("first_call_s"), **r}
            row.setdefault("status", "ok")
            if "first_call_s" in r:
                row["s"] = r["first_call_s"]
            rows.append(row)
            print(f"  {case.function} {label}: first call {r.get('first_call_s', math.nan):.3f} s "
                  f"(warming run {warm.get('first_call_s', math.nan):.3f} s), second "
                  f"{r.get('second_call_s', math.nan):.4f} s, dynamo after: "
                  f"{r.get('dynamo_after')}, inductor after: {r.get('inductor_after')}  "
                  f"{row['status']}", flush=True)
    return rows


FIRST_TABLE = [("op", "function"), ("impl", "impl"), ("first_call_s", "first call s"),
               ("cold_or_warming_first_call_s", "warming run s"), ("second_call_s", "second s"),
               ("import_torch_s", "import torch s"), ("load_module_s", "load module s"),
               ("dynamo_after", "_dynamo after"), ("inductor_after", "_inductor after"),
               ("dynamo_before", "_dynamo before"), ("status", "status")]


# --- main ----------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                 epilog="functions: " + ", ".join(_names()))
    ap.add_argument("--calls", type=int, default=10000,
                    help="calls per implementation and mode (rounds of 200)")
    ap.add_argument("--quick", action="store_true", help="fewer calls (1000)")
    ap.add_argument("--only", default="", help="NAME[,NAME]: these functions only")
    ap.add_argument("--size", type=int, default=256, help="gemm_launch's n (n^3)")
    ap.add_argument("--first-call", action="store_true",
                    help="time the first eager call in fresh processes instead")
    ap.add_argument("--list", action="store_true", help="print the function names and exit")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    names = _names()
    if args.list:
        print("\n".join(names))
        return 0
    only = [n.strip() for n in args.only.split(",") if n.strip()] or names
    unknown = [n for n in only if n not in names]
    if unknown:
        ap.error(f"--only: unknown {', '.join(unknown)}; known: {', '.join(names)}")
    calls = 1000 if args.quick else args.calls

    sys.path.insert(0, str(BENCH))
    from protocol import markdown_table, require_cuda, run_meta, write_results
    require_cuda()
    import torch
    if args.first_call:
        rows = first_calls([n for n in only if n != GEMM_LAUNCH])
        print(markdown_table(rows, FIRST_TABLE))
        write_results("host_time_first_call", rows,
                      run_meta() | {"metric": "s",
                                    "cache_dir": os.environ.get("TK_MLIR_CACHE_DIR")},
                      out_dir=args.out_dir)
        return 0

    table, rows = [], []
    all_cases = cases()
    print(f"{torch.cuda.get_device_name()}: {calls} calls per implementation and mode, "
          f"{SETS} rotating sets", flush=True)
    for name in only:
        if name == GEMM_LAUNCH:
            continue
        row, long = measure(all_cases[name], calls)
        table.append(row)
        rows += long
    if "matmul_16x4096x4096" in only:
        try:
            from tk_mlir.kernels.device import num_sms
            from tk_mlir.kernels.gemm import plan
            p = plan(16, 4096, 4096, num_sms(torch.cuda.current_device()))
            print(f"matmul 16x4096x4096 plan: {p.kernel} ({p.why})")
        except Exception as e:
            print(f"matmul 16x4096x4096 plan: unknown ({type(e).__name__}: {e})")
    launch_rows = []
    if GEMM_LAUNCH in only:
        try:
            launch_rows = gemm_launch_rows(args.size, calls)
        except Exception as e:
            from protocol import first_line
            launch_rows = [{"op": "gemm launch", "shape": f"{args.size}^3 bf16",
                            "impl": "tk_mlir", "status": first_line(e)}]
        rows += launch_rows
    if table:
        print(markdown_table(table, TABLE))
    if launch_rows:
        print(markdown_table(launch_rows, [("impl", "call"), ("us", "host µs / call"),
                                           ("status", "status")]))
    write_results("host_time", rows, run_meta() | {
        "metric": "us", "calls": calls, "rotating_sets": SETS, "size": args.size,
        "table": table}, out_dir=args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
