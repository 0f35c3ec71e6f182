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
