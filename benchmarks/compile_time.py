"""How long a kernel's first compile takes, and where the time goes.

Each sample is a new Python process with an empty TK_MLIR_CACHE_DIR, as a user
meets it: import tk_mlir and the kernel's module, then `kernel.compile(...)` (frontend,
tk passes, lowering, LLVM -> PTX, ptxas, every stage kept for the cache).
Then, per kernel:

- cold compile: wall and CPU seconds of that call (CPU includes ptxas, a
  child process), median over the samples;
- split: the same compile in processes with hooks on the pipeline's parts
  (MLIR imported first and timed apart); parts overlap where the compiler
  overlaps them (the stages are kept as bytecode while ptxas runs), so "waiting
  for ptxas" is what ptxas adds on top;
- warm: a new process compiling again with the cache the cold one filled;
- ptxas alone: ptxas -v on the same PTX, the peer the goal is set against
  (issue 7: the GEMM's first compile <= 3x ptxas alone).

    python benchmarks/compile_time.py [--samples 7] [--repo PATH] [--compare PATH]
                                      [--out benchmarks/results]

--repo measures another checkout of tk_mlir; --compare adds the cold compile
of a second checkout (e.g. `git archive OLD | tar -x -C DIR`), its samples
interleaved with --repo's so both see the same load. The split needs this
tree's pipeline hooks and is skipped where they are missing. Timing on a shared machine is noisy: the medians and
the machine's load average are in the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

KERNELS = {
    "gemm": (".", "tk_mlir.kernels.gemm",
             "spec = tk.spec((4096, 4096), tk.bf16)\n"
             "compile_ = lambda: module.gemm_kernel.compile(spec, spec, spec, config=0)"),
    "softmax (quickstart)": ("examples", "quickstart",
                             "spec = tk.spec((1000, 512), tk.f32)\n"
                             "compile_ = lambda: module.softmax.compile(spec, spec, ROWS=4, N=512)"),
}

# Runs in the sample's process. Prints one JSON line.
CHILD = r'''
import importlib, json, resource, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {folder!r})
import tk_mlir as tk
module = importlib.import_module({module!r})
t_import = time.perf_counter() - t0
{setup}
out = {{"import": t_import}}
split = {split!r}
if split:
    import collections
    parts = collections.defaultdict(float)
    t = time.perf_counter()
    from tk_mlir import frontend, stages, toolchain
    from tk_mlir.lowering import pipeline
    out["mlir imports"] = time.perf_counter() - t

    def timed(owner, attr, part):
        real = getattr(owner, attr)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                parts[part(*args) if callable(part) else part] += time.perf_counter() - t
        setattr(owner, attr, wrapper)

    tk_passes = {{name for name, _ in pipeline.TK_PASSES}}
    def stage_part(self, name, *rest):
        if name in tk_passes:
            return "tk passes"
        if name == pipeline.TO_BINARY:
            return "LLVM -> PTX"
        return "lowering (tk-to-gpu, upstream passes)"
    timed(frontend, "build_kernel", "frontend")
    timed(pipeline._Stages, "run", stage_part)
    timed(stages.StageStore, "snapshot", "stage snapshots")
    timed(stages._Snapshot, "text", "stage text")
    timed(stages._Snapshot, "stored", "stage bytecode")
    timed(toolchain.PtxasJob, "result", "waiting for ptxas")
    real_init = toolchain.PtxasJob.__init__
    def init(self, *args, **kwargs):
        self._started = time.perf_counter()
        real_init(self, *args, **kwargs)
    real_result = toolchain.PtxasJob.result
    def result(self):
        try:
            return real_result(self)
        finally:
            parts["ptxas (in parallel)"] += time.perf_counter() - self._started
    toolchain.PtxasJob.__init__, toolchain.PtxasJob.result = init, result
cpu0, kids0 = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
t = time.perf_counter()
compiled = compile_()
out["compile"] = time.perf_counter() - t
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
out["compile cpu"] = (time.process_time() - cpu0 + kids.ru_utime - kids0.ru_utime
                      + kids.ru_stime - kids0.ru_stime)
if split:
    out["parts"] = dict(parts)
if {ptx_path!r}:
    open({ptx_path!r}, "w").write(compiled.asm["ptx"])
print(json.dumps(out))
'''


def sample(repo: Path, kernel: str, cache: str, split: bool = False, ptx_path: str = "") -> dict:
    folder, module, setup = KERNELS[kernel]
    code = CHILD.format(folder=str(repo / folder), module=module, setup=setup, split=split,
                        ptx_path=ptx_path)
    env = {**os.environ, "TK_MLIR_CACHE_DIR": cache, "PYTHONPATH": str(repo)}
    for var in ("TK_MLIR_ALWAYS_COMPILE", "TK_MLIR_DUMP_DIR", "TK_MLIR_DEBUG"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"sample failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ptxas_alone(ptx_path: str, samples: int) -> list[float]:
    from tk_mlir.toolchain import find_tool
    tool = find_tool("ptxas")
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(samples):
            t = time.perf_counter()
            subprocess.run([tool, "-arch=sm_90a", "-v", ptx_path, "-o", f"{tmp}/k.cubin"],
                           check=True, capture_output=True)
            times.append(time.perf_counter() - t)
    return times


def has_split_hooks(repo: Path) -> bool:
    """Whether `repo` (this checkout or one compared with) has what the split
    times, where the child looks for it."""
    store, tools = repo / "tk_mlir" / "stages.py", repo / "tk_mlir" / "toolchain.py"
    return (store.is_file() and "class _Snapshot" in store.read_text()
            and tools.is_file() and "PtxasJob" in tools.read_text())


def measure(repo: Path, kernel: str, samples: int, compare: Path | None = None) -> dict:
    med = statistics.median
    cold, warm, splits, other = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="tk_mlir_bench_") as tmp:
        ptx_path = f"{tmp}/kernel.ptx"
        for i in range(samples):
            if compare is not None:
                other.append(sample(compare, kernel, tempfile.mkdtemp(dir=tmp)))
            cache = tempfile.mkdtemp(dir=tmp)
            cold.append(sample(repo, kernel, cache, ptx_path=ptx_path if i == 0 else ""))
            warm.append(sample(repo, kernel, cache))
        if has_split_hooks(repo):
            splits = [sample(repo, kernel, tempfile.mkdtemp(dir=tmp), split=True)
                      for _ in range(samples)]
        peer = ptxas_alone(ptx_path, samples)
    row = {"kernel": kernel, "samples": samples,
           "import tk_mlir + example (s)": med(s["import"] for s in cold),
           "cold compile (s)": med(s["compile"] for s in cold),
           "cold compile min (s)": min(s["compile"] for s in cold),
           "cold compile cpu (s)": med(s["compile cpu"] for s in cold),
           "warm hit (s)": med(s["compile"] for s in warm),
           "ptxas alone (s)": med(peer)}
    row["cold / ptxas"] = row["cold compile (s)"] / row["ptxas alone (s)"]
    if other:
        row["compared checkout"] = str(compare)
        row["compared: cold compile (s)"] = med(s["compile"] for s in other)
        row["compared: cold compile min (s)"] = min(s["compile"] for s in other)
        row["compared: cold compile cpu (s)"] = med(s["compile cpu"] for s in other)
        row["compared: import tk_mlir + example (s)"] = med(s["import"] for s in other)
    if splits:
        row["split (s)"] = {"MLIR imports": med(s["mlir imports"] for s in splits),
                            **{p: med(s["parts"].get(p, 0.0) for s in splits)
                               for p in sorted({p for s in splits for p in s["parts"]})},
                            "compile after imports": med(s["compile"] for s in splits)}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--repo", type=Path, default=REPO, help="the tk_mlir checkout to measure")
    ap.add_argument("--compare", type=Path, help="a second checkout, measured interleaved")
    ap.add_argument("--kernel", choices=list(KERNELS), action="append")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--name", default="compile_time", help="the JSON's file name (no .json)")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    compare = args.compare.resolve() if args.compare else None
    rows = [measure(args.repo.resolve(), k, args.samples, compare) for k in args.kernel or KERNELS]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
            "load average before/after": [load_before, os.getloadavg()],
            "python": platform.python_version(), "repo": str(args.repo.resolve()),
            "command": " ".join([Path(sys.executable).name, *sys.argv])}
    for row in rows:
        print(f"\n{row['kernel']} ({row['samples']} samples, medians)")
        for k, v in row.items():
            if isinstance(v, float):
                print(f"  {k:40s} {v:7.3f}")
        for k, v in row.get("split (s)", {}).items():
            print(f"    {k:38s} {v:7.3f}")
    print(f"\nload average before/after: {meta['load average before/after']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
