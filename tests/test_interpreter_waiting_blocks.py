"""Blocks that wait for other blocks in the CPU interpreter (tk.wait_signal):
a stalled block sleeps until something it waits on is written, rather than
being resumed whenever any other block moves (machine.run_blocks)."""
from __future__ import annotations

import warnings

import torch

import tk_mlir as tk
from tk_mlir.interpreter import machine


@tk.kernel(num_warps=1)
def chain(F: tk.gl["i32"]):
    """Block i signals F[i] once block i + 1 has signalled F[i + 1]: every
    block but the last waits until all have started, then they finish last
    to first."""
    i, n = tk.block_id(0), tk.grid_dim(0)
    if tk.thread_id() == 0:
        if i < n - 1:
            tk.wait_signal(F, (i + 1,), 1, scope="gpu")
        tk.signal(F, (i,), scope="gpu")


def test_a_chain_of_waiting_blocks_resumes_each_block_a_few_times(monkeypatch):
    """Each block of the chain is resumed a few times, however long the
    chain: its scheduler steps (Block.fire_due, once a step) stay a constant
    per block. Re-polling every stalled block whenever another moved cost
    ~n/2 steps per block (n = 200: 60k steps, against 800 now; 2000 blocks
    took minutes)."""
    steps = [0]
    fire_due = machine.Block.fire_due

    def counted(self):
        steps[0] += 1
        return fire_due(self)
    monkeypatch.setattr(machine.Block, "fire_due", counted)
    n = 200
    flags = torch.zeros(n, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tk.TkLintWarning)
        chain.interpret[(n,)](flags)
    assert (flags == 1).all()
    assert steps[0] <= 8 * n, steps[0]
