"""bench/grid_tail.py: the grid order it simulates is the one ``prefill_gluon_ws._program`` launches,
the scheduler and the per-block costs are what they say, and the chunked order shortens the tail on
the benchmark's own input (the model behind ``grid_chunk``)."""
import subprocess
import sys

import pytest
import torch

from sparsecal.bench import grid_tail as gt


def _program_twin(pid0: int, pid1: int, programs: int, chunk: int) -> tuple[int, int]:
    """``_program``'s arithmetic in Python: (rank, b * H + h) of program ids (pid0, pid1)."""
    if chunk == 1:
        return programs - 1 - pid0, pid1
    return programs - 1 - pid0 // chunk, pid1 * chunk + pid0 % chunk


@pytest.mark.parametrize("heads,programs,chunk", [(8, 5, 1), (8, 5, 4), (32, 3, 8), (6, 4, 2)])
def test_the_order_is_the_kernels_and_visits_every_program_once(heads, programs, chunk):
    order = gt.grid_order(heads, programs, chunk)
    twin = [_program_twin(p0, p1, programs, chunk)[::-1] for p1 in range(heads // chunk)
            for p0 in range(programs * chunk)]
    assert order == twin
    assert sorted(order) == [(h, i) for h in range(heads) for i in range(programs)]
    assert order[:chunk] == [(h, programs - 1) for h in range(chunk)]  # the chunk's heaviest ranks first


def test_the_scheduler_on_hand_cases():
    cost = torch.tensor([[4.0, 1.0, 1.0, 1.0, 1.0]])
    order = [(0, i) for i in range(5)]
    assert gt.makespan(order, cost, 1) == 8.0          # one slot: the work
    assert gt.makespan(order, cost, 2) == 4.0          # the long one first, the rest beside it
    assert gt.makespan(order[::-1], cost, 2) == 6.0    # the long one last: a tail of 2


def test_costs_count_kept_diagonal_and_skipped_tiles(seed):
    bmax, gap = gt.block_tile_stats(1024, 32, 4, 2, seed)
    assert bmax.shape == gap.shape == (4, 8, 16)
    assert torch.isfinite(bmax[:, 3, :8]).all() and torch.isinf(bmax[:, 3, 8:]).all()   # block 3 reaches 8 tiles
    assert (gap[torch.isfinite(gap)] <= 0).all()
    dense = gt.block_costs(bmax, gap, 1024, "bsfa", 1e-9)
    assert torch.equal(dense, (2.0 * torch.arange(8) + 2).expand(4, 8))          # nothing skipped: reach
    half = gt.block_costs(bmax, gap, 1024, "bsfa", 0.5, skipped_cost=0.0)
    skipped = dense - half                                                         # skipped tiles per block
    assert torch.allclose(skipped, torch.round(0.5 * dense).clamp(max=2.0 * torch.arange(8)).expand(4, 8))
    blasst = gt.block_costs(bmax, gap, 1024, "blasst", 0.5, skipped_cost=0.0)
    assert abs(float((dense - blasst).sum() / dense.sum()) - 0.5) < 0.05


def test_chunked_heads_shorten_the_tail_on_the_bench_input():
    """16 heads, 4K tokens, BSFA at 50 %, 64 program slots (8 waves of the ws grid, about 16K's 15.5 on an
    H100 at 32 heads): one head after the other ends 5-15 % past the work's bound, 4 heads side by side
    within 1 %; the paired grid on half the slots alike."""
    bmax, gap = gt.block_tile_stats(4096, 64, 16, 1, 4096 + 64 + 1)
    cost = gt.block_costs(bmax, gap, 4096, "bsfa", 0.5)
    for slots, paired in ((64, False), (32, False), (32, True)):
        t = gt.tail_table(cost, slots, (1, 4), paired)
        assert t[4] <= t[1] and t[4] < 1.01, (slots, paired, t)
    assert gt.tail_table(cost, 64, (1,), False)[1] > 1.05 and gt.tail_table(cost, 32, (1,), True)[1] > 1.05


def test_bad_options_are_one_line_and_exit_code_2():
    for args in (["--chunks", "3"], ["--sparsity", "1.5"], ["--sms", "0"], ["--chunks", "a"]):
        r = subprocess.run([sys.executable, "-m", "sparsecal.bench.grid_tail", *args], check=False, capture_output=True,
                           text=True)
        assert r.returncode == 2 and r.stdout.startswith("error: ") and len(r.stdout.splitlines()) == 1, r
        assert "Traceback" not in r.stderr
