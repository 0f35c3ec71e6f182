"""A compiled kernel's summary: the facts a kernel author checks first.

Registers and spills (ptxas, as in `compiled.info`), static and dynamic
shared memory, named barriers, how many blocks fit on an SM and what limits
them, a static instruction mix from the SASS, its loops that issue MMAs or
spill (instructions, moves, LDL/STL per loop), and ptxas's performance
warnings (the C75xx lines: an ignored setmaxnreg, serialized wgmma, ...).

Blocks per SM come from the driver when a GPU is here
(cuOccupancyMaxActiveBlocksPerMultiprocessor, asked through
CompiledKernel.occupancy_from_driver: this module needs no GPU and imports
no driver), else from the target's per-SM limits (target.py), computed as
the CUDA occupancy calculator does.
"""
from __future__ import annotations

import re
from collections import Counter

from . import source_map, target as targets

# The instructions a kernel author looks for, in the order shown: tensor
# cores (Hopper's wgmma; Blackwell's tcgen05 MMAs, commits and tensor-memory
# loads and stores), TMA, mbarriers, math, sync, shuffles, memory, local memory.
KEY_OPCODES = ("HGMMA", "QGMMA", "HMMA", "UTCHMMA", "UTCQMMA", "UTCBAR", "LDTM", "STTM",
               "UTMALDG", "UTMASTG", "UTMAPF", "SYNCS", "MUFU",
               "FFMA", "FMUL", "FADD", "HFMA2", "BAR", "SHFL", "LDS", "STS", "LDSM",
               "LDG", "STG", "LDL", "STL")
ALWAYS_SHOWN = ("LDL", "STL")     # zero local-memory traffic is itself the news

# nvdisasm: an address comment, an optional dual-issue brace, an optional
# predicate, then the opcode (its first dotted part is the instruction).
_SASS_OPCODE = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+(?:\{\s*)?(?:@!?U?P(?:T|\d+)\s+)?"
                          r"([A-Z][A-Z0-9_]*)", re.M)
_PTXAS_WARNING = re.compile(r"^.*(?:\(C\d{4}\)|warning).*$", re.M | re.I)


def instruction_counts(sass: str) -> Counter:
    """How many times each SASS instruction appears in the listing (static
    counts: an instruction in a loop counts once)."""
    return Counter(_SASS_OPCODE.findall(sass))


def instruction_mix(sass: str) -> dict[str, int]:
    """The KEY_OPCODES present in `sass` (and LDL/STL always), and the total."""
    counts = instruction_counts(sass)
    mix = {op: counts[op] for op in KEY_OPCODES if counts[op] or op in ALWAYS_SHOWN}
    mix["total"] = sum(counts.values())
    return mix


_SASS_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_BRANCH_TARGET = re.compile(r"\bBRA\b[^`\n]*`\(\.(L_x_\d+)\)")
_PREDICATE = re.compile(r"^(\{\s*)?(@!?U?P(T|\d+)\s+)?")
_MMA_OPCODES = ("HGMMA", "QGMMA", "HMMA", "UTCHMMA", "UTCQMMA")
_MOVES = ("MOV", "IMAD.MOV")


def loop_bodies(sass: str) -> list[list[tuple[str, tuple[str, int] | None]]]:
    """The SASS's innermost loops (a branch back to a label above it, holding
    no such loop of its own) that issue MMAs or touch local memory, in code
    order: each as its instructions (the text after the address, predicate
    dropped) with the (file, line) nvdisasm -g puts them under. A branch back
    over an unconditional EXIT is not a loop: ptxas places slow paths (an
    mbarrier wait's retry) after the kernel's end and jumps back from them."""
    labels, code, exits = {}, [], []
    for raw, where in zip(sass.split("\n"), source_map.sass_line_owners(sass)):
        if m := _SASS_LABEL.match(raw):
            labels[m[1]] = len(code)
        elif _SASS_OPCODE.match(raw):
            text = raw.split("*/", 1)[1].strip()
            if text.startswith("EXIT"):              # (unpredicated: the path ends here)
                exits.append(len(code))
            code.append((_PREDICATE.sub("", text), where))
    spans = []
    for end, (text, _) in enumerate(code):
        m = _BRANCH_TARGET.search(text)
        if m and labels.get(m[1], end + 1) <= end and \
                not any(labels[m[1]] <= x <= end for x in exits) and any(
                t.startswith(_MMA_OPCODES + ("LDL", "STL")) for t, _ in code[labels[m[1]]:end + 1]):
            spans.append((labels[m[1]], end))
    return [code[a:b + 1] for a, b in sorted(spans)
            if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]


def loops(sass: str, most: int = 8) -> list[str]:
    """loop_bodies(sass), at most `most`, as one line each: its Python lines
    (in the file most of its instructions name), instructions, MMAs, register
    moves and LDL/STL (static counts: a branch inside counts whole). Many
    moves in a loop of MMAs are accumulators copied out of and back into their
    registers every iteration (ptxas parks a carried accumulator whose MMA
    comes after others in the body: issue it first)."""
    out = []
    for body in loop_bodies(sass)[:most]:
        lines = Counter((w[0].rsplit("/", 1)[-1], w[1]) for _, w in body if w)
        file = Counter(f for f, _ in lines.elements()).most_common(1)[0][0] if lines else None
        nums = sorted(n for f, n in lines if f == file)
        at = f"{file}:{nums[0]}-{nums[-1]}" if nums else "(no line)"
        text = [t for t, _ in body]
        out.append(f"{at}: {len(text)} instructions, "
                   f"{sum(t.startswith(_MMA_OPCODES) for t in text)} MMA, "
                   f"{sum(t.startswith(_MOVES) for t in text)} moves, "
                   f"{sum(t.startswith(('LDL', 'STL')) for t in text)} LDL/STL")
    return out


def loop_mixes(sass: str, most: int = 8, top: int = 12) -> list[str]:
    """loops(sass, most), each followed by its `top` most frequent opcodes
    (full names, e.g. UIADD3.64, HGMMA.64x128x16.F32.BF16): where two kernels'
    loops differ, instruction by kind (python -m tk_mlir sass on a peer's
    cubin beside ours)."""
    out = []
    for line, body in zip(loops(sass, most), loop_bodies(sass)):
        counts = Counter(t.split()[0] for t, _ in body if t.split())
        out.append(line)
        out.append("    " + ", ".join(f"{op} {n}" for op, n in counts.most_common(top)))
    return out


def ptxas_warnings(log: str) -> list[str]:
    """ptxas's warning lines (C75xx performance advisories included), without
    the `ptxas info    :` prefix."""
    return [re.sub(r"^ptxas\s+\w+\s*:\s*", "", line).strip()
            for line in _PTXAS_WARNING.findall(log)]


def _log_number(log: str, pattern: str) -> int:
    m = re.search(pattern, log)
    return int(m.group(1)) if m else 0


def static_shared_bytes(log: str) -> int:
    return _log_number(log, r"(\d+) bytes smem")


def barriers(log: str) -> int:
    return _log_number(log, r"used (\d+) barriers")


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def blocks_per_sm_from_limits(registers: int, threads: int, shared_bytes: int,
                              arch: str | None = None) -> tuple[int, list[str]]:
    """(blocks per SM, what limits them) on the target, as the occupancy
    calculator counts: registers per warp and shared memory per block in the
    target's allocation units (shared memory plus the system's reserve),
    threads, blocks."""
    t = targets.named(arch)
    warps = -(-threads // 32)
    per_warp = _round_up(max(registers, 1) * 32, t.register_alloc_unit)
    shared = _round_up(shared_bytes + t.shared_reserved_bytes, t.shared_alloc_unit)
    limits = {
        "registers": t.registers_per_sm // (per_warp * warps),
        "shared memory": (t.shared_bytes_per_sm // shared
                          if shared_bytes <= t.max_shared_bytes else 0),
        "threads": t.max_threads_per_sm // (32 * warps),
        "blocks": t.max_blocks_per_sm,
    }
    blocks = min(limits.values())
    return blocks, [name for name, n in limits.items() if n == blocks]


def summary(compiled) -> dict:
    """The summary of `compiled` (a CompiledKernel) as a dict; see the module."""
    out = {"threads": compiled.num_threads,
           "dynamic shared memory (bytes)": compiled.smem_bytes}
    if compiled.cluster > 1:
        out["cluster"] = compiled.cluster
    if not compiled.assembled:
        out["note"] = "PTX only (no ptxas here): no registers, SASS or occupancy"
        return out
    info, log = compiled.info, compiled.ptxas_log
    static = static_shared_bytes(log)
    out = {"registers": info.get("registers"),
           "spill stores (bytes)": info.get("spill stores (bytes)", 0),
           "spill loads (bytes)": info.get("spill loads (bytes)", 0),
           **out,
           "static shared memory (bytes)": static,
           "barriers": barriers(log)}
    out.update(_occupancy(compiled, info.get("registers") or 0, static + compiled.smem_bytes))
    if "sass" in compiled.asm:
        out["instructions (SASS, static)"] = instruction_mix(compiled.asm["sass"])
        out["loops with MMAs or spills (SASS, static)"] = loops(compiled.asm["sass"])
    out["ptxas warnings"] = ptxas_warnings(log)
    return out


def _occupancy(compiled, registers: int, shared_bytes: int) -> dict:
    # A GPU that cannot run the kernel (not sm_90) or a driver that refuses
    # the query leaves the limits, with the reason on the page.
    blocks, note = compiled.occupancy_from_driver()     # note: the GPU, or why not
    if blocks is not None:
        return {"blocks per SM": blocks, "occupancy from": f"the driver ({note})"}
    blocks, limited_by = blocks_per_sm_from_limits(registers, compiled.num_threads, shared_bytes,
                                                   compiled.arch)
    return {"blocks per SM": blocks, "limited by": ", ".join(limited_by),
            "occupancy from": f"{compiled.arch} limits ({note})"}


def summary_text(facts: dict) -> str:
    """`facts` (summary's dict) as aligned plain-text lines."""
    width = max(map(len, facts), default=0)
    lines = []
    for key, value in facts.items():
        if isinstance(value, dict):
            value = "  ".join(f"{k} {v:,}" for k, v in value.items())
        elif isinstance(value, list):
            value = "\n".join([str(len(value)), *(f"{'':{width}}  {v}" for v in value)]
                              ) if value else "none"
        elif isinstance(value, int):
            value = f"{value:,}"
        lines.append(f"{key:{width}}  {value}")
    return "\n".join(lines)
