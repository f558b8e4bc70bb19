"""The dense group decode with per-shape launches (kernels/sparse/decode_group_dense.py) against the
reference (TRITON_INTERPRET=1): every kind of launch (tensor-core and CUDA-core products, loop tiles
16..128, evict-first loads, the fused merge, wave-fitted and per-SM splits, 1 / 3 / the launch's own
splits) on ragged batches (lengths 1, awkward, a page multiple, longer), contiguous and paged,
GQA 1 / 4 / 8, D 64 / 128; the table lookup; the committed table against the H100 sweep's JSONs."""
import json
import math

import pytest
import torch

from sparsecal.kernels.sparse.decode_group import group_decode_triton
from sparsecal.kernels.sparse.decode_group_dense import (
    ATTEND,
    DENSE_DEFAULT,
    DENSE_TABLE,
    DenseLaunch,
    buckets,
    launch_for,
    loop_tile,
)
from sparsecal.kernels.sparse.reference import sparse_decode_ragged

from helpers import INTERPRETER_WARNINGS, ROOT, TOL

pytestmark = INTERPRETER_WARNINGS
SWEEPS = [ROOT / "data" / "bench" / f"decode-sweep{s}-h100-d{d}.json"   # the sweeps DENSE_TABLE is from, oldest first:
          for s in ("4", "5-b1", "6-b16", "7-b16", "8-b16", "10-b16") for d in (128, 64)]  # b16, b1, b16 G 4/8
# 16K-32K, b16 (fused merge), b16 (TMA loads), b16 (s42: TMA sparse launches; the dense candidates as sweep 8)

LENGTHS = [1, 37, 64, 203]
CASES = [  # (H, Hkv, D, page, dtype)
    (2, 2, 64, 32, torch.bfloat16),    # G = 1
    (4, 1, 128, 64, torch.float16),    # G = 4, D = 128
    (8, 1, 64, 32, torch.float32),     # G = 8
]
LAUNCHES = [DenseLaunch(block_n=32, dot=False, fuse=True, evict=True, waves=2),
            DenseLaunch(block_n=128, stages=2, fuse=True),
            DenseLaunch(block_n=16, warps=8, waves=1),
            DenseLaunch(block_n=32, fuse=True, tma=True)]


def paged(k, v, lens, page, g):
    """Page pools [P, Hkv, page, D] holding the rows of k/v [B, Hkv, Lmax, D] in shuffled pages and
    the block table [B, max_pages] int32 (unused slots -1)."""
    n_pages = [-(-n // page) for n in lens]
    pk = torch.zeros(sum(n_pages) + 1, *k.shape[1:2], page, k.shape[3], dtype=k.dtype)
    pv = torch.zeros_like(pk)
    table = torch.full((len(lens), max(n_pages)), -1, dtype=torch.int32)
    order = torch.randperm(pk.shape[0], generator=g).tolist()
    for i, n in enumerate(n_pages):
        for j in range(n):
            p = table[i, j] = order.pop()
            stop = min((j + 1) * page, lens[i])
            pk[p, :, : stop - j * page], pv[p, :, : stop - j * page] = k[i, :, j * page: stop], v[i, :, j * page: stop]
    return pk, pv, table


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"G{c[0] // c[1]}-D{c[2]}-{str(c[4])[6:]}")
def test_dense_launches_match_reference(case, rng):
    """Every launch, contiguous ragged and paged, several split counts: the reference's outputs,
    zero counts of the right shapes."""
    h, hkv, d, page, dtype = case
    b, lmax = len(LENGTHS), max(LENGTHS)
    q = torch.randn(b, h, 1, d, generator=rng).to(dtype)
    k, v = (torch.randn(b, hkv, lmax, d, generator=rng).to(dtype) for _ in range(2))
    k[:, :, 0] += 4.0 * q[:, ::h // hkv, 0]                      # a sink key per row
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    pk, pv, table = paged(k, v, LENGTHS, page, rng)
    want, *_ = sparse_decode_ragged(q, k, v, lens, d ** -0.5, 32, 16, log_lambda=-math.inf)
    for cfg in LAUNCHES:
        for splits, (kk, vv, bt) in ((None, (k, v, None)), (3, (pk, pv, table)), (1, (k, v, None))):
            got, sk, vsk = group_decode_triton(q, kk, vv, d ** -0.5, 32, 16, dense=True, lengths=lens, block_table=bt,
                                               splits=splits, dense_launch=cfg)
            torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype][0], rtol=TOL[dtype][1])
            assert sk.shape == (b, h) and vsk.shape == (b, hkv) and not sk.any() and not vsk.any()


def test_tma_reads_only_the_rows_keys(rng):
    """TMA launches (``tma``): the keys past a row's length, in the cache and in a page's unused rows,
    hold NaN and change nothing; k/v whose strides a TMA descriptor cannot take run the per-thread
    loads (the same result)."""
    from sparsecal.kernels.sparse.decode_group_dense import _kv_args

    h, hkv, d, page = 4, 2, 64, 32
    lens = [5, 37, 64, 70]
    q = torch.randn(len(lens), h, 1, d, generator=rng).to(torch.bfloat16)
    k, v = (torch.randn(len(lens), hkv, 96, d, generator=rng).to(torch.bfloat16) for _ in range(2))
    want, *_ = sparse_decode_ragged(q, k, v, torch.tensor(lens), d ** -0.5, 32, 16, log_lambda=-math.inf)
    pk, pv, table = paged(k, v, lens, page, rng)
    for i, n in enumerate(lens):
        k[i, :, n:], v[i, :, n:] = float("nan"), float("nan")
        last = int(table[i, (n - 1) // page])
        if n % page:
            pk[last, :, n % page:], pv[last, :, n % page:] = float("nan"), float("nan")
    cfg = DenseLaunch(block_n=32, tma=True)
    odd = torch.randn(len(lens), hkv, 96, d + 4, generator=rng).to(torch.bfloat16)[..., :d]   # 136-byte rows
    odd.copy_(k)
    assert _kv_args(k, v, cfg, 32)[2] and not _kv_args(odd, v, cfg, 32)[2]
    for kk, vv, bt in ((k, v, None), (pk, pv, table), (odd, v, None)):
        got, *_ = group_decode_triton(q, kk, vv, d ** -0.5, 32, 16, dense=True, lengths=torch.tensor(lens),
                                      block_table=bt, splits=2, dense_launch=cfg)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[torch.bfloat16][0], rtol=TOL[torch.bfloat16][1])


def test_fused_merge_leaves_counters_zero(rng):
    """Two fused calls in a row on one contiguous row (one length): equal outputs (the group counters
    were reset by the merging program), equal to the attend pass's dense output."""
    q = torch.randn(1, 4, 1, 64, generator=rng)
    k, v = torch.randn(1, 2, 150, 64, generator=rng), torch.randn(1, 2, 150, 64, generator=rng)
    cfg = DenseLaunch(block_n=16, fuse=True)
    first, *_ = group_decode_triton(q, k, v, 0.125, 32, 16, dense=True, splits=4, dense_launch=cfg)
    second, *_ = group_decode_triton(q, k, v, 0.125, 32, 16, dense=True, splits=4, dense_launch=cfg)
    old, *_ = group_decode_triton(q, k, v, 0.125, 32, 16, dense=True, splits=4, dense_launch="attend")
    assert torch.equal(first, second)
    torch.testing.assert_close(first, old, atol=2e-5, rtol=1e-5)


def test_fused_merge_over_several_chunks(rng):
    """The fused merge takes MERGE_CHUNK splits at a time: 19 splits (3 chunks, the last partial) on a
    ragged batch whose short rows leave most splits empty, contiguous and paged: the reference's
    output, the unfused merge's within rounding, the same bits on a second call."""
    from sparsecal.kernels.sparse.decode_group_dense import MERGE_CHUNK

    lens_l = [1, 37, 300]
    q = torch.randn(3, 8, 1, 64, generator=rng)
    k, v = (torch.randn(3, 1, 300, 64, generator=rng) for _ in range(2))
    lens = torch.tensor(lens_l, dtype=torch.int32)
    pk, pv, table = paged(k, v, lens_l, 32, rng)
    want, *_ = sparse_decode_ragged(q, k, v, lens, 0.125, 32, 16, log_lambda=-math.inf)
    fused, plain = DenseLaunch(block_n=16, fuse=True), DenseLaunch(block_n=16)
    assert 2 * MERGE_CHUNK < 19
    for kk, vv, bt in ((k, v, None), (pk, pv, table)):
        got, *_ = group_decode_triton(q, kk, vv, 0.125, 32, 16, dense=True, lengths=lens, block_table=bt, splits=19,
                                      dense_launch=fused)
        again, *_ = group_decode_triton(q, kk, vv, 0.125, 32, 16, dense=True, lengths=lens, block_table=bt, splits=19,
                                        dense_launch=fused)
        unfused, *_ = group_decode_triton(q, kk, vv, 0.125, 32, 16, dense=True, lengths=lens, block_table=bt,
                                          splits=19, dense_launch=plain)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got, unfused, atol=2e-6, rtol=1e-6)
        assert torch.equal(got, again)


def test_table_lookup_and_loop_tile():
    """Buckets of G, length and batch, the table's entry or the default, the page-fitted loop tile."""
    assert buckets(64, 1, 16384) == (64, 1, 16384, 16) and buckets(128, 3, 30000, 1) == (128, 4, 32768, 1)
    assert buckets(64, 7, 90000, 2) == (64, 8, 65536, 1) and buckets(64, 16, 4096, 3) == (64, 16, 16384, 16)
    assert buckets(128, 4, 100000) == (128, 4, 131072, 16)
    assert launch_for(64, 8, 65536) is DENSE_TABLE[(64, 8, 65536, 16)]
    assert launch_for(128, 8, 65536, 1) != launch_for(128, 8, 65536, 16)
    DENSE_TABLE[(32, 4, 16384, 16)] = cfg = DenseLaunch(block_n=32)
    try:
        assert launch_for(32, 2, 20000, 8) is cfg and launch_for(32, 2, 30000) is DENSE_DEFAULT
        assert launch_for(32, 2, 20000, 1) is DENSE_DEFAULT
    finally:
        del DENSE_TABLE[(32, 4, 16384, 16)]
    assert loop_tile(DenseLaunch(block_n=128), 32) == 32 and loop_tile(DenseLaunch(block_n=64), 0) == 64
    with pytest.raises(ValueError, match="loop tile"):
        loop_tile(DenseLaunch(block_n=64), 24)


NEAR = 0.005   # a table entry is at most this much slower than the shape's fastest checked launch


def test_committed_table_holds_near_winners_of_the_sweep():
    """Every DENSE_TABLE entry is, at each swept shape of its key (batch 16 and batch 1; a shape swept
    again: its latest sweep), a launch the sweep built and checked (every ragged/paged check row of
    its name ok, its timed row ok) whose median is within NEAR of the shape's fastest checked launch
    (DENSE_DEFAULT among them); and every swept shape has an entry."""
    latest = {}
    for path in SWEEPS:
        sweep = json.loads(path.read_text())
        checked = {r["config"] for r in sweep["check"]} - {r["config"] for r in sweep["check"] if not r["ok"]}
        for shape in sweep["shapes"]:
            latest[(shape["d"], shape["group"], shape["length"], shape["batch"])] = (shape, checked)
    assert len(latest) == 18 + 24  # batch 16: D 64/128 x G 1/4/8 x 16K-64K; batch 1: the same x 16K-128K
    for shape, checked in latest.values():
        rows = {r["variant"]: r for r in shape["rows"] if r["kind"] == "dense" and r.get("ok") and r.get("ms")}
        key = buckets(shape["d"], shape["group"], shape["length"], shape["batch"])
        cfg = DENSE_TABLE[key]
        name = cfg if cfg == ATTEND else cfg.name()
        row = rows[f"dense_{name}"]
        assert name in checked, key
        assert row["ms"] <= (1 + NEAR) * min(r["ms"] for r in rows.values()), (key, name)


def _build_case(key: str, d: int, cfg: DenseLaunch, group: int) -> dict:
    """The dense kernel as a contiguous bf16 launch of ``cfg`` builds it (the GPU's specialization:
    16-divisible pointers and strides)."""
    from sparsecal.kernels.jit import next_pow2

    kv = f"tensordesc<bf16[1, 1, {cfg.block_n}, {d}]>" if cfg.tma else "*bf16"
    ptrs = {"Q": "*bf16", "K": kv, "V": kv, "BT": "*i32", "LENS": "*i32", "ACC": "*fp32", "M": "*fp32",
            "LS": "*fp32", "CNT": "*i64", "VCNT": "*i64", "CTR": "*i32", "O": "*bf16"}
    ints = ["sq_b", "sq_h", "sk_b", "sk_h", "sk_n", "sv_b", "sv_h", "sv_n", "s_bt", "so_b", "so_h", "length",
            "tiles_per_split", "n_split", "num_heads", "group"]
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), "qk_scale": "fp32", "softcap": "fp32"}
    consts = {"HEAD_DIM": d, "BLOCK_N": cfg.block_n, "GP": next_pow2(group, 16 if cfg.dot else 1), "PAGE": 1,
              "PAGED": False, "RAGGED": False, "USE_DOT": cfg.dot, "EVICT": cfg.evict, "DIRECT": False,
              "FUSE": cfg.fuse, "TMA": cfg.tma, "SOFTCAP": False, "PREC": None, "UPCAST": False}
    return {"key": key, "module": "sparsecal.kernels.sparse.decode_group_dense", "kernel": "_group_dense_kernel",
            "signature": sig, "constexprs": consts, "divisible": [p for p in ptrs if ptrs[p][0] == "*"] + ints[:11],
            "options": {"num_warps": cfg.warps, "num_stages": cfg.stages}}


def test_the_tables_launches_build_for_sm90_without_spills():
    """Every distinct launch of DENSE_TABLE at batch 16 (and the fused merge at the same launch), built
    for sm_90 through ptxas with this machine's Triton: no register spills, one SM's shared memory.
    The GPU runs another Triton (3.6 on the project's H100s), so this is a guard, not its build."""
    from triton_build import build

    cases = []
    for (d, g, _, batch), cfg in DENSE_TABLE.items():
        if batch == 16 and isinstance(cfg, DenseLaunch):
            for c in (cfg, DenseLaunch(**{**cfg.as_dict(), "fuse": True})):
                cases.append(_build_case(f"D{d}-G{g}-{c.name()}", d, c, g))
    same = lambda c: json.dumps([c["constexprs"], c["options"]], sort_keys=True)   # waves, pps: not the build
    cases = list({same(c): c for c in cases}.values())
    got = build(cases)
    assert set(got) == {c["key"] for c in cases} and len(got) >= 6
    for key, r in got.items():
        assert r["spills"] == 0 and r["regs"] <= 255 and 0 < r["shared"] <= 232448, (key, r)
