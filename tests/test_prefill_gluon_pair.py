"""The paired Gluon prefill kernel (kernels/sparse/prefill_gluon_pair.py) on a machine without a GPU.

Gluon does not run in Triton's interpreter: its outputs and skip counts are checked against the
reference on the GPU by bench/prefill_gluon.py (``--variants gluon_pair``; ragged lengths with odd
and even block counts, windows, GQA 1/4/8). Here: the kernel builds for sm_90 with this machine's
Triton, through ptxas, for every method, and the build is the one the design relies on: TMA copies,
async wgmma, three partitions with register reallocation, no spills, no serialized wgmma, and one
program per SM; and it refuses the geometry it was not written for.
"""
from __future__ import annotations

import pytest
import torch
from gluon_build import build

from sparsecal.kernels.sparse import prefill_gluon_pair as pp

H100_SMEM_PER_SM = 228 * 1024  # bytes; each resident program also reserves 1 KiB
H100_REGS_PER_SM = 64 * 1024
METHODS = (0, 1, 2, 3)  # dense, BSFA, BLASST, window


CASES = [(m, False) for m in METHODS] + [(m, True) for m in (1, 2)]  # (method, two decided tiles a decision)


@pytest.fixture(scope="module")
def builds():
    return build([{"key": f"{m}-{int(two)}", "module": pp.__name__, "kernel": "_pair_fwd_kernel", "d": pp.HEAD_DIM,
                   "method": m, "q_rows": 128, "launch": pp.pair_config(two=two)} for m, two in CASES])


@pytest.mark.parametrize("method,two", CASES, ids=[f"{m}{'-two' if two else ''}" for m, two in CASES])
def test_builds_for_hopper_two_blocks_a_program(builds, method, two):
    """Both forms, one decided tile a decision or two (both score tiles then live: 64 + 64 + the
    accumulator's 64 registers a thread, within the consumers' 240)."""
    got = builds[f"{method}-{int(two)}"]
    assert got["tma"] and got["wgmma"] and got["cubin"], got
    assert got["setmaxnreg"], "the partitions should reallocate registers"
    assert got["spills"] == 0, got
    assert not [w for w in got["warnings"] if "C7514" in w or "wgmma" in w.lower()], got["warnings"]
    assert got["warps"] == 12, got["warps"]  # 2 consumer warpgroups + the producer warp's (padded) warpgroup
    assert got["shared"] + 1024 <= H100_SMEM_PER_SM, got["shared"]
    assert got["regs"] * got["warps"] * 32 <= H100_REGS_PER_SM, got["regs"]


def test_config_gives_each_consumer_a_whole_block():
    """240 registers for each consumer warpgroup (S and the accumulator of 128 rows: 64 + 64 a
    thread), 24 for the producer, within one SM's registers at 168 a thread for 12 warps."""
    cfg = pp.pair_config()
    assert cfg["WORKER_REGS"] == 240 and cfg["PRODUCER_REGS"] == 24 and cfg["num_warps"] == 4
    default = cfg["maxnreg"] * 12 * 32 // 128 - cfg["WORKER_REGS"] - cfg["PRODUCER_REGS"]
    assert default >= 240 and cfg["maxnreg"] * 12 * 32 <= H100_REGS_PER_SM
    assert pp.pair_config(6)["NBUF"] == 6 and not cfg["TWO"] and pp.pair_config(two=True)["TWO"]


def test_the_chunked_grid_builds_as_the_default(builds):
    """Heads side by side (``chunk``, what calls up to CHUNK_UP_TO get) change only the program's (pair,
    head): the same registers, shared memory and warps as the default build, without spills."""
    got = build([{"key": f"{m}", "module": pp.__name__, "kernel": "_pair_fwd_kernel", "d": pp.HEAD_DIM, "method": m,
                  "q_rows": 128, "launch": pp.pair_config(two=True, chunk=4)} for m in (1, 2)])
    for m in (1, 2):
        ref = builds[f"{m}-1"]
        assert got[f"{m}"]["spills"] == 0
        assert (got[f"{m}"]["regs"], got[f"{m}"]["shared"], got[f"{m}"]["warps"]) == (ref["regs"], ref["shared"],
                                                                                      ref["warps"])


@pytest.mark.parametrize("d,block_n", [(128, 64), (64, 128)])
def test_refuses_other_geometry(d, block_n, seed):
    q = torch.randn(1, 2, 256, d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="head dim 64 and block_n 64 only"):
        pp.sparse_attention_gluon_pair(q, q, q, 0.125, 128, block_n, dense=True)
