"""Task tables for persistent kernels (tk_mlir/kernels/schedule.py): every
task runs once, tasks of one cost go round-robin, tasks of many costs are
balanced, and a table is made once per shape."""
from __future__ import annotations

import numpy as np
import pytest

from tk_mlir.kernels import schedule


def _blocks(table: np.ndarray, grid: int) -> list[list[int]]:
    return [table[table[b]:table[b + 1]].tolist() for b in range(grid)]


def test_equal_costs_go_round_robin():
    table = schedule.table(np.arange(10), np.ones(10), 4)
    assert _blocks(table, 4) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert table.dtype == np.int32 and len(table) % 4 == 0


def test_costs_are_balanced_and_order_kept():
    rng = np.random.default_rng(0)
    costs = np.sort(rng.integers(1, 64, 2000))[::-1]       # longest first, as attention's
    ids = rng.permutation(2000)
    table = schedule.table(ids, costs, 132)
    blocks = _blocks(table, 132)
    assert sorted(sum(blocks, [])) == sorted(ids.tolist())
    cost_of = dict(zip(ids.tolist(), costs.tolist()))
    loads = [sum(cost_of[t] for t in b) for b in blocks]
    assert max(loads) - min(loads) <= costs.max()
    position = {t: i for i, t in enumerate(ids.tolist())}
    assert all(sorted(b, key=position.get) == b for b in blocks)


def test_fewer_tasks_than_blocks_leave_blocks_idle():
    assert _blocks(schedule.table(np.arange(2), np.ones(2), 4), 4) == [[0], [1], [], []]


@pytest.mark.parametrize("ids, costs, grid, rule", [
    (np.arange(3), np.ones(2), 4, "one length"),
    (np.arange(3), np.ones(3), 0, "grid must be at least 1"),
    (np.array([2**31]), np.ones(1), 1, "32 bits"),
])
def test_bad_input_is_named(ids, costs, grid, rule):
    with pytest.raises(ValueError, match=rule):
        schedule.table(ids, costs, grid)


def test_a_table_is_made_once_per_key():
    pytest.importorskip("torch")
    made = []

    def make():
        made.append(1)
        return schedule.table(np.arange(5), np.ones(5), 2)

    a = schedule.on_device(("test", 5), make, "cpu")
    b = schedule.on_device(("test", 5), make, "cpu")
    assert a is b and len(made) == 1
    assert a.tolist() == schedule.table(np.arange(5), np.ones(5), 2).tolist()


def test_head_groups_walk_blocks_in_order_heads_inner():
    ids = schedule.head_groups(5, 2, [2, 1, 0], 3)      # the last group holds one head
    assert ids.tolist() == [2, 5, 1, 4, 0, 3, 8, 11, 7, 10, 6, 9, 14, 13, 12]


def test_kept_for_reuses_a_table_while_its_tensors_are_unwritten():
    torch = pytest.importorskip("torch")
    made = []

    def make():
        made.append(1)
        return torch.arange(4, dtype=torch.int32)

    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    a = schedule.kept_for((cu,), ("k", 1), make)
    assert schedule.kept_for((cu,), ("k", 1), make) is a and len(made) == 1
    assert schedule.kept_for((cu,), ("k", 2), make) is not a     # another key
    cu.add_(1)                                                   # written: made anew
    b = schedule.kept_for((cu,), ("k", 1), make)
    assert b is not a and len(made) == 3
    key = next(k for k in schedule._FOR_TENSORS if k[0] == (id(cu),) and k[1] == ("k", 1))
    del cu                                                       # gone: its tables dropped
    assert key not in schedule._FOR_TENSORS
    with torch.inference_mode():                                 # no version counter: not kept
        cu = torch.zeros(3, dtype=torch.int32)
        assert schedule.kept_for((cu,), ("k", 1), make) is not \
            schedule.kept_for((cu,), ("k", 1), make)


@pytest.mark.gpu
def test_gpu_a_captured_graph_keeps_the_tables_it_reads(monkeypatch):
    """A persistent kernel's table kept before capture and read by the graph
    stays alive when the caches drop it (here at once: one table kept, and
    every remembered eager plan forgotten), so a replay after other shapes'
    calls and fresh allocations is right."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tk_mlir.kernels import attention
    monkeypatch.setattr(schedule, "_MAX_TABLES", 1)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.rand(2, 4, 1000, 128, device="cuda", generator=g).bfloat16() - 0.5
               for _ in range(3))
    attention(q, k, v, causal=True)                  # its table made before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = attention(q, k, v, causal=True)
    from tk_mlir.kernels import eager
    eager.forget_all()                               # the plans that held it
    for n in (256, 512, 768):                        # other shapes' tables push it out
        attention(*(t[:, :, :n] for t in (q, k, v)), causal=True)
    junk = [torch.full((n,), -(1 << 30), dtype=torch.int32, device="cuda")
            for n in (64, 128, 256, 512, 1024, 2048) for _ in range(16)]   # freed memory: these
    o.fill_(float("nan"))
    graph.replay()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=True)
    assert ((o.float() - ref).norm() / ref.norm()).item() < 1e-2
    del junk
