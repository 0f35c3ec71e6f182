"""Task schedules for persistent kernels: which tasks each block runs.

A persistent kernel launches one block per SM and walks a list of tasks. A
fixed stride (block b runs tasks b, b + grid, ...) balances tasks of one
size; tasks of many sizes (causal attention's query blocks see 1 to N/BN key
blocks) leave some SMs working while the rest wait. `table` assigns tasks in
the order given (the order that keeps what runs together sharing L2) to the
block with the least work so far (greedy longest-processing-time), the
schedule a dynamic atomic-counter scheduler would make, computed once per
shape on the host.

The table the kernel reads (i32, one dim, length a multiple of 4: rows of
whole 16-byte vectors): entries 0..grid are offsets into it, block b's tasks
are the entries offsets[b] .. offsets[b + 1] - 1, each a task id the kernel
decodes. A kernel walks its block's part with `block_tasks`:

    first, end, task = schedule.block_tasks(TASKS)
    for slot in range(first, end):
        ... task ...                                 # decode and run it
        task = tk.load(TASKS, (slot + 1,))           # the next id, read ahead
"""
from __future__ import annotations

import heapq

import tk_mlir as tk


@tk.func
def block_tasks(TASKS):
    """(first slot, end slot, first task id) of this block's part of the
    schedule table TASKS: its tasks are TASKS[first:end]."""
    first = tk.load(TASKS, (tk.block_id(0),))
    return first, tk.load(TASKS, (tk.block_id(0) + 1,)), tk.load(TASKS, (first,))


def head_groups(heads: int, per_group: int, block_order, blocks: int):
    """Task ids head·blocks + block in groups of `per_group` heads (the last
    group may be short), each group walking its blocks in `block_order`,
    heads inner: the tasks running together read the data of one group's
    heads, which the caller sized to fit in L2. A numpy array."""
    import numpy as np
    block_order = np.asarray(block_order)
    return np.concatenate([
        (np.arange(g, min(g + per_group, heads))[None, :] * blocks + block_order[:, None]).ravel()
        for g in range(0, heads, per_group)])


def table(ids, costs, grid: int):
    """The schedule table for tasks `ids` taken in that order, each costing
    `costs` (any unit), over `grid` blocks: each task goes to the block with
    the least total cost so far (the lowest index on ties, so tasks of one
    cost go round-robin). A block's tasks keep the given order. Returns a
    numpy array."""
    import numpy as np
    ids, costs = np.asarray(ids, np.int64), np.asarray(costs, np.float64)
    if ids.shape != costs.shape or ids.ndim != 1:
        raise ValueError(f"schedule.table: ids and costs must be 1-D of one length, got "
                         f"{ids.shape} and {costs.shape}")
    if grid < 1:
        raise ValueError(f"schedule.table: grid must be at least 1, got {grid}")
    owner = np.empty(len(ids), np.int64)
    loads = [(0.0, b) for b in range(grid)]
    for i, cost in enumerate(costs.tolist()):
        load, b = heapq.heappop(loads)
        owner[i] = b
        heapq.heappush(loads, (load + cost, b))
    by_block = np.argsort(owner, kind="stable")          # each block's tasks, in order
    counts = np.bincount(owner, minlength=grid)
    offsets = grid + 1 + np.concatenate(([0], np.cumsum(counts)))
    out = np.concatenate((offsets, ids[by_block]))
    if out.max(initial=0) >= 2**31:
        raise ValueError("schedule.table: task ids and offsets must fit in 32 bits")
    return np.pad(out, (0, -len(out) % 4)).astype(np.int32)


_TABLES: dict = {}
_MAX_TABLES = 256


# Tables a captured CUDA graph reads, by identity: never freed, whatever cache
# or plan drops them later (a graph keeps their addresses, not the tensors).
_CAPTURED: dict = {}


def pin_if_capturing(table):
    """`table`, kept alive for good when the current stream is capturing a
    CUDA graph (which will read it at every replay). For a table a plan
    hands its launches: the plan, and the cache the table came from, may
    drop it later."""
    import torch
    if table.is_cuda and torch.cuda.is_current_stream_capturing():
        _CAPTURED[id(table)] = table
    return table


def on_device(key: tuple, make, device):
    """The table `make()` returns, as an i32 torch tensor on `device`, made
    once per (key, device) and kept (at most _MAX_TABLES, oldest dropped
    first: a model's shapes recur; one a captured graph reads, never). `key`
    must say everything `make` reads."""
    key = (key, str(device))
    t = _TABLES.get(key)
    if t is None:
        import torch
        if _capturing(device):
            raise RuntimeError(
                "a persistent kernel's first call with these shapes ran under CUDA graph "
                "capture, which cannot copy its task schedule to the GPU: call it once with "
                "these shapes before capturing")
        t = torch.from_numpy(make()).to(device)
        _remember(_TABLES, key, t)
    return pin_if_capturing(t)


def _capturing(device) -> bool:
    """Whether torch's current stream on `device` is capturing a CUDA graph."""
    import torch
    return str(device).startswith("cuda") and torch.cuda.is_current_stream_capturing()


def _remember(cache: dict, key, value) -> None:
    """value kept under key, the oldest entry dropped past _MAX_TABLES (a
    model's shapes recur)."""
    if len(cache) >= _MAX_TABLES:          # (pop: a weakref callback may have dropped it)
        cache.pop(next(iter(cache)), None)
    cache[key] = value


def sorted_table(costs, heads: int, grid: int):
    """The schedule table, made on the GPU without reading `costs` on the
    host, for tasks head·blocks + block whose cost (a torch tensor of
    `blocks` entries on the GPU) depends on the block only: blocks in
    decreasing cost, heads inner, dealt to the grid's blocks in a snake (0 ..
    grid-1, then grid-1 .. 0, ...), which balances tasks sorted by cost nearly
    as `table`'s greedy assignment does. An i32 torch tensor, unpadded: the
    caller pads it (a kernel reads one entry past its block's last)."""
    import torch
    blocks = costs.numel()
    offsets, order = _dealt(blocks * heads, grid, costs.device)
    by_cost = torch.argsort(costs.to(torch.int32), descending=True, stable=True)  # (narrow)
    ids = (torch.arange(heads, device=costs.device)[None, :] * blocks + by_cost[:, None]).view(-1)
    return torch.cat((offsets, ids[order])).to(torch.int32)


# paired_table's tasks per block below which sorted_table's table is used: its
# ~55 small torch ops (~10 for sorted_table) cost host time an eager call and
# ~190 µs of GPU time in a CUDA graph (H100), which the better order repays only
# on long walks (the measured cases had 33-62 tasks a block); with fewer than
# two a block, dealing whole pairs would idle blocks.
PAIRED_MIN_TASKS = 16


def paired_table(costs, heads: int, grid: int, cu, rows_per_task: int):
    """sorted_table's table for tasks over packed sequences (cu: their B+1
    offsets, a torch tensor on the GPU; task t covers rows t·rows_per_task
    onwards, belonging to the sequence holding its first own row) whose cost
    falls or rises along each sequence (causal): each sequence's tiles are
    paired with their mirrors (i with m-1-i of its m), a pair costing about
    the same wherever it sits, and the units (pair, head) dealt in a snake
    by decreasing pair cost, then sequence, head and pair. The tasks running
    together then read one sequence's one head's K/V, not one tile's of
    many sequences (sorted_table), which keeps them in L2: 10-24% faster
    on the H200 (BENCHMARKS.md). Below PAIRED_MIN_TASKS a block it is
    sorted_table's. No host sync; every task exactly once whatever `cu`
    holds (offsets that are not the rows' only weaken the pairing)."""
    import torch
    dev = costs.device
    blocks, sequences = costs.numel(), len(cu) - 1           # (cu holds B + 1 >= 2)
    if blocks * heads < PAIRED_MIN_TASKS * grid:
        return sorted_table(costs, heads, grid)
    # Sequence s's tiles [first[s], first[s+1]): offsets that are not the rows'
    # own (unsorted, out of range) are made a partition of 0 .. blocks-1 first.
    first = ((cu.to(dev, torch.long) + (rows_per_task - 1)) // rows_per_task).clamp_(0, blocks)
    first = first.cummax(0).values
    first[:1].fill_(0)                  # (fill_, not first[0] = 0: an item set from the
    first[-1:].fill_(blocks)            # host is a copy, which CUDA-graph capture refuses)
    t = torch.arange(blocks, device=dev)
    seq = torch.searchsorted(first[1:], t, right=True)
    partner = (first[:-1] + first[1:] - 1)[seq] - t         # tile i's mirror, m-1-i of m
    lead = t <= partner                                     # a unit's first (or only) tile
    pair_cost = costs + costs[partner] * (partner != t)
    # Entries (task ids head·blocks + tile) by pair cost, highest first, then by
    # sequence, head, pair, lead first: one sort (sorts are most of the
    # table's GPU time) of an i32 key, made per tile plus the head's term,
    # where it holds the order and some cost classes (a radix sort's passes go
    # by the key's bits): the costs furthest below the highest then share a
    # class (the cheapest units, dealt last, keep their order by sequence,
    # head and pair).
    span = 2 * sequences * heads * blocks              # the order after the cost, below it
    classes = (2**31 - 1) // span
    below = pair_cost.max() - pair_cost
    if classes >= 2:
        below = below.clamp_(max=classes - 1)
    per_tile = below * span + seq * (2 * heads * blocks) + \
        (torch.minimum(t, partner) - first[seq]) * 2 + (t > partner)
    key = per_tile[None, :] + 2 * blocks * torch.arange(heads, device=dev)[:, None]
    key, order = torch.sort(key.view(-1).to(torch.int32) if classes >= 2 else key.view(-1),
                            stable=True)
    # Each entry's unit (the lead entries so far; a key's lowest bit is 0 for a
    # lead), dealt in a snake.
    rank = ((~key & 1).cumsum(0) - 1).clamp_(min=0)
    place = rank % grid
    owner = torch.where((rank // grid) & 1 == 1, grid - 1 - place, place)
    owner, by_block = torch.sort(owner.to(torch.int16 if grid < 2**15 else torch.int32),
                                 stable=True)
    offsets = torch.searchsorted(owner, torch.arange(grid + 1, device=dev, dtype=owner.dtype))
    return torch.cat((offsets + (grid + 1), order[by_block])).to(torch.int32)


# Schedules kept per offsets tensors (kept_for): a model's layers share one
# batch's cu_seqlens, so its first layer makes the table and the rest reuse it.
_FOR_TENSORS: dict = {}


def kept_for(tensors: tuple, key: tuple, make):
    """make()'s schedule, or the one it made last for the same `tensors` (the
    same objects, none written since as torch's version counters see it),
    `key` (which must say everything else `make` reads) and stream (a table
    is used on the stream that made it). Only for schedules: a
    table says which block runs which task, and holds every task once
    whatever the tensors held, so one kept past a write torch cannot see
    (through a raw pointer) costs balance, never a result. Under CUDA-graph
    capture always made anew and not kept: the graph owns its table, and a
    replay after the offsets change makes the replay's own. Inference
    tensors, which count no versions, are not kept either."""
    import weakref
    import torch
    device = tensors[0].device
    if _capturing(device) or any(t.is_inference() for t in tensors):
        return make()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (tuple(id(t) for t in tensors), key, str(device), stream)
    versions = tuple(t._version for t in tensors)
    kept = _FOR_TENSORS.get(key)
    if kept is not None and kept[1] == versions and \
            all(ref() is t for ref, t in zip(kept[0], tensors)):
        return kept[2]
    table = make()
    def drop(_ref, key=key):                # a tensor gone: its table is no one's
        _FOR_TENSORS.pop(key, None)
    _remember(_FOR_TENSORS, key, (tuple(weakref.ref(t, drop) for t in tensors), versions,
                                  table))
    return table


_SNAKES: dict = {}


def _dealt(tasks: int, grid: int, device):
    """_snake's deal, kept per (tasks, grid, device) (at most _MAX_TABLES, the
    oldest dropped first): made on the GPU, so keeping it only saves its
    launches. Not kept when made during CUDA-graph capture (its memory
    belongs to the graph; one a captured graph reads is never dropped)."""
    key = (tasks, grid, str(device))
    dealt = _SNAKES.get(key)
    if dealt is None:
        dealt = _snake(tasks, grid, device)
        if not _capturing(device):
            _remember(_SNAKES, key, dealt)
    else:
        for t in dealt:
            pin_if_capturing(t)
    return dealt


def _snake(tasks: int, grid: int, device):
    """The snake deal of `tasks` positions over `grid` blocks, made on `device`
    with no copy from the host (so no synchronisation, and CUDA-graph
    capture works): (offsets as `table`'s, the positions in block order).
    Position p goes to block p % grid in even rounds (p // grid) and to
    grid - 1 - p % grid in odd ones, so block b's k-th position is
    k·grid + (b if k is even else grid - 1 - b)."""
    import torch
    rounds, rest = divmod(tasks, grid)
    b = torch.arange(grid, device=device)
    # the last, partial round reaches blocks 0.. (even) or ..grid-1 (odd)
    extra = (b < rest) if rounds % 2 == 0 else (b >= grid - rest)
    counts = rounds + extra.long()
    ends = torch.cumsum(counts, 0)
    offsets = torch.cat((torch.zeros(1, dtype=torch.long, device=device), ends)) + grid + 1
    e = torch.arange(tasks, device=device)
    owner = torch.searchsorted(ends, e, right=True)
    k = e - (ends[owner] - counts[owner])
    return offsets, k * grid + torch.where(k % 2 == 0, owner, grid - 1 - owner)
