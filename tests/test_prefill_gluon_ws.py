"""The warp-specialized Gluon prefill kernel (kernels/sparse/prefill_gluon_ws.py) on a machine without a GPU.

Gluon does not run in Triton's interpreter: its numbers are checked against the reference on the GPU
by bench/prefill_gluon.py (``--variants gluon_ws``). Here: the kernel builds for sm_90 with this
machine's Triton, through ptxas, for every method and head dim it takes and both of its forms (a
producer warp or not), and the build is the one the design relies on: TMA copies, async wgmma,
warp-specialized partitions with register reallocation, no register spills, no serialized wgmma
(ptxas warning C7514), and registers and shared memory that let the intended programs share an SM.
"""
from __future__ import annotations

import pytest
import torch
from gluon_build import build

from sparsecal.kernels.sparse import prefill_gluon_ws as pw

H100_SMEM_PER_SM = 228 * 1024  # bytes; each resident program also reserves 1 KiB
H100_REGS_PER_SM = 64 * 1024
# head dim, method (dense, BSFA, BLASST, window), producer warp
CASES = [(d, m, pw.PRODUCER[d]) for d in (64, 128) for m in (0, 1, 2, 3)] + [(128, m, True) for m in (0, 1, 2, 3)]


def programs_per_sm(d: int, producer: bool) -> int:
    """What the configuration is for: two programs per SM, except D = 128 with a producer warp (one,
    with a deep ring: its consumers need 128 registers, which two programs cannot give them)."""
    return 1 if (d, producer) == (128, True) else 2


@pytest.fixture(scope="module")
def builds():
    return build([{"key": f"{d}-{m}-{int(p)}", "module": pw.__name__, "kernel": "_ws_fwd_kernel", "d": d, "method": m,
                   "q_rows": 64, "launch": pw.ws_config(d, p, late=pw.late_for(d, m, p))} for d, m, p in CASES])


@pytest.mark.parametrize("d,method,producer", CASES, ids=[f"d{d}-{m}-{'prod' if p else 'inline'}" for d, m, p in CASES])
def test_builds_for_hopper_warp_specialized(builds, d, method, producer):
    got = builds[f"{d}-{method}-{int(producer)}"]
    assert got["tma"], "K/V/Q should arrive by TMA"
    assert got["wgmma"], "Q.K^T and P.V should be warpgroup MMAs"
    assert got["setmaxnreg"], "the partitions should reallocate registers"
    assert got["cubin"], "ptxas should have assembled the kernel"
    assert got["spills"] == 0, got
    assert not [w for w in got["warnings"] if "C7514" in w or "wgmma" in w.lower()], got["warnings"]
    # 2 consumer warpgroups, plus the producer warp's warpgroup (padded to 4 warps) when there is one
    assert got["warps"] == (12 if producer else 8), got["warps"]
    n = programs_per_sm(d, producer)
    assert n * (got["shared"] + 1024) <= H100_SMEM_PER_SM, got["shared"]
    assert n * got["regs"] * got["warps"] * 32 <= H100_REGS_PER_SM, got["regs"]


MEETS = [(d, m, meet) for d in (64, 128) for m in (1, 2) for meet in (0, 2) if meet != pw.MEET[d]]


@pytest.fixture(scope="module")
def meet_builds():
    return build([{"key": f"{d}-{m}-{meet}", "module": pw.__name__, "kernel": "_ws_fwd_kernel", "d": d, "method": m,
                   "q_rows": 64, "launch": pw.ws_config(d, meet=meet)} for d, m, meet in MEETS])


@pytest.mark.parametrize("d,method,meet", MEETS, ids=[f"d{d}-{m}-meet{x}" for d, m, x in MEETS])
def test_every_way_to_agree_builds_as_the_default(meet_builds, builds, d, method, meet):
    """Votes and an mbarrier (0), one barrier with an OR (2): the same registers, no spills, the same programs an
    SM as the default form of the head dim. The barrier with an OR is where form 2 meets: both warpgroups' 256
    threads at named barrier 15."""
    got, default = meet_builds[f"{d}-{method}-{meet}"], builds[f"{d}-{method}-{int(pw.PRODUCER[d])}"]
    assert got["cubin"] and got["spills"] == 0, got
    assert got["regs"] == default["regs"] and got["warps"] == default["warps"], (got, default)
    assert programs_per_sm(d, pw.PRODUCER[d]) * (got["shared"] + 1024) <= H100_SMEM_PER_SM, got["shared"]
    assert got["bar_red"] == (meet == 2) and got["vote"] == (meet != 2), got
    assert got["bar_red_at"] == {0: [], 2: [[15, 256]]}[meet], got


@pytest.mark.parametrize("d,method", [(d, m) for d in (64, 128) for m in (0, 1, 2, 3)])
def test_the_default_decides_as_its_head_dim_was_measured_fastest(builds, d, method):
    """Both head dims decide at one barrier with an OR (``bar.red.or.pred``, no vote; D = 128 since s50), both
    warpgroups' 256 threads at named barrier 15; the methods without a decision (dense, window) have neither."""
    got = builds[f"{d}-{method}-{int(pw.PRODUCER[d])}"]
    decides = method in (1, 2)
    assert got["bar_red"] == (decides and pw.MEET[d] == 2), got
    assert got["bar_red_at"] == ([[15, 256]] if decides and pw.MEET[d] == 2 else []), got
    assert got["vote"] == (decides and pw.MEET[d] != 2), got


@pytest.mark.parametrize("d,method,producer", CASES, ids=[f"d{d}-{m}-{'prod' if p else 'inline'}" for d, m, p in CASES])
def test_dense_d128_issues_its_copies_under_the_wgmma(builds, d, method, producer):
    """Warpgroup 0 of the D = 128 form without a producer warp issues K and V while a wgmma of its own runs in a
    dense call, and before or after them in a call that decides (or windows); a producer warp's form never does."""
    got = builds[f"{d}-{method}-{int(producer)}"]
    assert (got["copies_under_mma"] > 0) == (d == 128 and method == 0 and not producer), got["copies_under_mma"]


def test_late_for_is_dense_d128_without_a_producer_only():
    assert pw.late_for(128, 0) and not pw.late_for(128, 0, producer=True)
    assert not any(pw.late_for(128, m) for m in (1, 2, 3)) and not any(pw.late_for(64, m) for m in (0, 1, 2, 3))
    assert pw.ws_config(128, late=True)["LATE"] is True
    with pytest.raises(ValueError, match="late copies"):
        pw.ws_config(64, late=True)


def test_config_is_the_one_each_head_dim_runs():
    """D = 64 gets a producer warp and 4 slots at 80 launch registers (104 + 112 + 24 after
    setmaxnreg: two programs per SM); D = 128 runs without one (128 registers, 2 slots)."""
    common = {"PRODUCER_REGS": 24, "CHUNK": 1, "LATE": False, "num_warps": 4}
    assert pw.ws_config(64) == {"NBUF": 4, "PRODUCER": True, "WORKER_REGS": 112, "maxnreg": 80, "MEET": 2, **common}
    assert pw.ws_config(128) == {"NBUF": 2, "PRODUCER": False, "WORKER_REGS": 128, "maxnreg": 128, "MEET": 2,
                                 **common}
    assert pw.ws_config(64, meet=0)["MEET"] == 0 and pw.ws_config(128, meet=0)["MEET"] == 0
    for gone in (1, 3):  # removed: votes at a named barrier (s47), the own rows first (s51)
        with pytest.raises(ValueError, match="meet is 0"):
            pw.ws_config(64, meet=gone)
    assert "maxnreg" not in pw.ws_config(128, producer=True) and pw.ws_config(128, True, nbuf=3)["NBUF"] == 3


def test_takes_only_the_calls_the_gluon_kernel_takes(seed):
    q = torch.randn(1, 2, 256, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="Gluon prefill kernel does not take this call"):
        pw.sparse_attention_gluon_ws(q, q, q, 0.125, 128, 64, thresholds=torch.zeros(2, 2))


def test_heads_go_side_by_side_only_where_it_was_measured_ahead():
    """``grid_chunk``: 4 heads side by side up to N x D = 32K x 64 (D = 64 16K-32K, D = 128 16K measured
    ahead), one head after the other beyond (D = 64 64K and D = 128 32K measured behind) and where 4
    does not divide the heads; the paired kernel up to 16K only."""
    from sparsecal.kernels.sparse import prefill_gluon_pair as pp

    assert [pw.grid_chunk(n, 64, 32) for n in (4096, 16384, 32768, 65536)] == [4, 4, 4, 1]
    assert [pw.grid_chunk(n, 128, 32) for n in (16384, 32768)] == [4, 1]
    assert pw.grid_chunk(16384, 64, 6) == 1 and pw.grid_chunk(16384, 64, 8) == 4
    assert [pw.grid_chunk(n, 64, 32, pp.CHUNK_UP_TO) for n in (16384, 32768)] == [4, 1]


def test_the_chunked_grid_is_the_rule_unless_told_and_only_where_the_chunk_divides_the_heads():
    q = torch.empty(2, 32, 16384, 64, device="meta")
    assert pw.chunked_grid((128, 64), q, None) == ((512, 16), 4)
    assert pw.chunked_grid((128, 64), q, 1) == ((128, 64), 1)
    assert pw.chunked_grid((128, 64), torch.empty(2, 6, 16384, 64, device="meta"), 4) == ((128, 64), 1)
    assert pw.chunked_grid((128, 64), torch.empty(1, 32, 65536, 64, device="meta"), None) == ((128, 64), 1)


@pytest.fixture(scope="module")
def chunk_builds():
    return build([{"key": f"{d}-{m}", "module": pw.__name__, "kernel": "_ws_fwd_kernel", "d": d, "method": m,
                   "q_rows": 64, "launch": pw.ws_config(d, chunk=4)} for d in (64, 128) for m in (1, 2)])


@pytest.mark.parametrize("d,method", [(d, m) for d in (64, 128) for m in (1, 2)])
def test_the_chunked_grid_builds_as_the_default(chunk_builds, builds, d, method):
    """Heads side by side change only the program's (block, head): the same registers, shared memory and
    warps as the default build, without spills."""
    got, ref = chunk_builds[f"{d}-{method}"], builds[f"{d}-{method}-{int(pw.PRODUCER[d])}"]
    assert got["spills"] == 0
    assert (got["regs"], got["shared"], got["warps"]) == (ref["regs"], ref["shared"], ref["warps"])

