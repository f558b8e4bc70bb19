"""The consumers' skip rules (kernels/sparse/consumer_rules.py) on logits built so that the rules
disagree, and Model-Optimizer's own flash_skip_softmax on random causal logits."""
import math

import pytest
import torch

from sparsecal.kernels.sparse import consumer_rules as cr

LOW = -20.0


def causal_logits(rng, nq, nk, heads=2, sink=16.0, local=8.0, width=64):
    """Random logits [1, heads, nq, nk] with an attention sink at key 0 and a local band near the
    diagonal (so that tiles far from both skip), future keys finfo.min (Hugging Face's eager mask)."""
    x = torch.randn(1, heads, nq, nk, generator=rng)
    i = torch.arange(nq).unsqueeze(1) + (nk - nq)
    j = torch.arange(nk).unsqueeze(0)
    x = x + sink * (j == 0) + local * ((i - j >= 0) & (i - j < width))
    return x.masked_fill(j > i, torch.finfo(x.dtype).min)


def modelopt_method(t):
    """Model-Optimizer's FlashSkipSoftmax with one threshold for both phases."""
    mo = pytest.importorskip("modelopt.torch.sparsity.attention_sparsity.methods.flash_skip_softmax")
    return mo.FlashSkipSoftmax({"thresholds": {"prefill": [t], "decode": [t]}, "br": 128, "bc": 128,
                                "backend": "pytorch", "is_causal": True})


@pytest.mark.parametrize("n", [300, 640, 1000])
@pytest.mark.parametrize("t", [1e-3, 3e-2])
def test_modelopt_hf_matches_modelopt(rng, n, t):
    """Same kept blocks and the same dense-block count as calc_correction_factor_and_p."""
    scores = causal_logits(rng, n, n)
    mask, stats = modelopt_method(t).calc_correction_factor_and_p(scores, "prefill")
    theirs = mask[:, :, ::128, ::128]                       # the element mask, one entry per block
    ours = cr.modelopt_hf(scores, lam=t)
    assert torch.equal(ours.kept, theirs)
    assert ours.skipped < ours.total and (ours.skipped > 0 or n < 640)
    assert ours.total - ours.skipped == int(theirs.sum())
    assert stats["sparsity"][0] == 1.0 - (ours.total - ours.skipped) / ours.total


@pytest.mark.parametrize("n", [300, 1000])
def test_modelopt_hf_decode_matches_modelopt(rng, n):
    scores = causal_logits(rng, n, n)[:, :, -1:, :]
    mask, stats = modelopt_method(1e-2).calc_correction_factor_and_p(scores, "decode")
    ours = cr.modelopt_hf(scores, lam=1e-2)
    assert torch.equal(ours.kept, mask[:, :, :, ::128])
    assert ours.total == 2 * math.ceil(n / 128) and 0 < ours.skipped
    assert stats["sparsity"][0] == 1.0 - (ours.total - ours.skipped) / ours.total


def sink_then_low(nq, nk):
    """[1, 1, nq, nk]: every row puts 10 on key 0 and LOW elsewhere."""
    x = torch.full((1, 1, nq, nk), LOW)
    x[..., 0] = 10.0
    return x


def test_modelopt_hf_skips_the_diagonal_and_everything_at_lambda_one():
    scores = sink_then_low(256, 256)
    d = cr.modelopt_hf(scores, lam=0.01)
    assert d.kept[0, 0].tolist() == [[True, False], [True, False]]   # diagonal block (1, 1) skipped
    assert (d.skipped, d.total) == (1, 3)
    for lam in (1.0, 4.0):
        d = cr.modelopt_hf(scores, lam=lam)
        assert not d.kept.any() and (d.skipped, d.total) == (3, 3)


def test_modelopt_hf_padded_rows_keep_the_last_block_row():
    """Nq = Nk = 200: rows 200..255 of the last query block are padding (finfo.min) and keep every
    block of that row for lambda < 1; the Triton kernel lets padding rows abstain."""
    scores = sink_then_low(200, 200)
    d = cr.modelopt_hf(scores, lam=0.01)
    assert d.kept[0, 0].tolist() == [[True, False], [True, True]]
    assert (d.skipped, d.total) == (0, 3)
    assert cr.modelopt_hf(scores, lam=1.0).skipped == 3
    full = cr.modelopt_hf(sink_then_low(256, 256), lam=0.01)          # no padding: diagonal skipped
    assert full.kept[0, 0, 1, 1].item() is False
    tri = cr.modelopt_triton(scores, lam=0.01, block_m=128, block_n=128)
    assert tri.kept[0, 0, 1].tolist() == [True, False] and (tri.skipped, tri.total) == (1, 3)


def test_modelopt_triton_lambda_above_one_keeps_rising_tiles():
    """No cap at lambda >= 1: a tile less than ln(lambda) above the running max is skipped, one more
    above it is kept; the first tile never is."""
    x = torch.full((1, 1, 1, 96), LOW)
    x[..., 0], x[..., 32], x[..., 64] = 0.0, 0.5, 3.0                  # tiles of 32 keys
    d = cr.modelopt_triton(x, lam=math.e)                             # ln lambda = 1
    assert d.kept[0, 0, 0].tolist() == [True, False, True] and (d.skipped, d.total) == (1, 3)
    assert cr.modelopt_vllm_threshold(1000.0, 1000) is None              # vLLM turns it off instead
    assert cr.modelopt_vllm_threshold(1000.0, 500) is None
    assert cr.modelopt_vllm_threshold(1000.0, 4000) == 0.25
    assert cr.modelopt_vllm_threshold(1000.0, 0) is None


def warp_vs_tile_scores():
    """[1, 1, 128, 384]: the 128 rows are positions 256..383. Tile 0 holds every row's max (10);
    in tile 1 the rows of warp 0 (rows 0..15) reach 5 (gap -5 < ln 0.01) and the others 9 (gap -1);
    tile 2 (the diagonal) is LOW everywhere."""
    x = torch.full((1, 1, 128, 384), LOW)
    x[..., 0] = 10.0
    x[..., :16, 200] = 5.0
    x[..., 16:, 200] = 9.0
    return x


def test_trtllm_gen_warp_vote_and_tile_vote_differ():
    d = cr.trtllm_gen(warp_vs_tile_scores(), lam=0.01, warp_rows=16)
    warps, tiles = d["warps"], d["tiles"]
    assert warps.kept.shape == (1, 1, 1, 8, 3)
    assert warps.kept[0, 0, 0, :, 1].tolist() == [False] + [True] * 7    # warp 0 zeroes its P
    assert not warps.kept[0, 0, 0, :, 2].any()
    assert (warps.skipped, warps.total) == (9, 24)
    assert tiles.kept[0, 0, 0].tolist() == [True, True, False]           # V skipped on tile 2 only
    assert (tiles.skipped, tiles.total) == (1, 3)
    one = cr.trtllm_gen(warp_vs_tile_scores(), lam=0.01, warp_rows=128)  # one vote per tile: same tiles
    assert (one["warps"].skipped, one["tiles"].skipped) == (1, 1)
    hop = cr.hopper_prefill(warp_vs_tile_scores(), lam=0.01, head_dim=128)   # 64-row warpgroups
    assert hop.kept.shape == (1, 1, 2, 3) and (hop.skipped, hop.total) == (2, 6)   # tile 2 twice
    assert hop.kept[0, 0, :, 1].tolist() == [True, True]


def test_hopper_tiles_by_dtype_and_head_dim():
    assert [cr.hopper_kv_step("bf16", d) for d in (64, 128, 256)] == [256, 128, 64]
    assert [cr.hopper_kv_step("e4m3", d) for d in (64, 128, 256)] == [256, 256, 128]
    x = torch.full((1, 1, 64, 512), LOW)
    x[..., 0] = 10.0
    fp8 = cr.fp8_hopper_prefill(x, lam=0.01, head_dim=128)
    bf16 = cr.hopper_prefill(x, lam=0.01, head_dim=128)
    assert (fp8.skipped, fp8.total) == (1, 2) and (bf16.skipped, bf16.total) == (3, 4)


def decode_steps():
    """[1, 1, 1, 512]: tile maxima 10, 2, 1, 0.5 (tiles of 128 keys)."""
    x = torch.full((1, 1, 1, 512), LOW)
    for k, v in enumerate((10.0, 2.0, 1.0, 0.5)):
        x[..., 128 * k + 5] = v
    return x


def test_split_kv_chunk_restart_changes_the_decision():
    lam = math.exp(-3.0)
    one = cr.split_kv_decode(decode_steps(), lam=lam, chunks=1)
    assert one.kept[0, 0].tolist() == [True, False, False, False] and (one.skipped, one.total) == (3, 4)
    two = cr.split_kv_decode(decode_steps(), lam=lam, chunks=2)              # tiles 0, 1 | 2, 3
    assert two.kept[0, 0].tolist() == [True, False, True, True] and two.skipped == 1
    inter = cr.split_kv_decode(decode_steps(), lam=lam, chunks=2, layout="interleaved")   # 0, 2 | 1, 3
    assert inter.kept[0, 0].tolist() == [True, True, False, True] and inter.skipped == 1
    gen = cr.trtllm_gen(decode_steps(), lam=lam, kv_chunk_tiles=2)["tiles"]
    assert gen.kept[0, 0, 0].tolist() == [True, False, True, True]


def xqa_scores(group=4):
    """[1, group, 1, 640]: every head peaks on key 0 (8); tile 5 (keys 320..383) reaches 7.5 in head 1
    only; the rest is LOW."""
    x = torch.full((1, group, 1, 640), LOW)
    x[..., 0] = 8.0
    x[0, 1, 0, 330] = 7.5
    return x


def test_xqa_length_rule_and_group_vote():
    off = cr.xqa_decode(xqa_scores(), 1000.0, group=4)                 # kv_len 640 < factor: off
    assert off.kept.all() and (off.skipped, off.total) == (0, 0)
    on = cr.xqa_decode(xqa_scores(), 100.0, group=4)                   # lambda 0.156: 64-token tiles
    assert on.kept.shape == (1, 1, 10)
    assert on.kept[0, 0].tolist() == [True] + [False] * 4 + [True] + [False] * 4   # head 1 keeps tile 5
    assert (on.skipped, on.total) == (8, 10)
    per_head = cr.xqa_decode(xqa_scores(), 100.0, group=1)             # heads alone: 3 of 4 skip tile 5
    assert (per_head.skipped, per_head.total) == (4 * 9 - 1, 40)
    edge = cr.xqa_decode(xqa_scores(), 640.0, group=4)                 # lambda = 1 exactly stays on:
    assert (edge.skipped, edge.total) == (9, 10)                       # tile 5 (gap -0.5 < 0) skips too
    multi = cr.xqa_decode(xqa_scores(), 100.0, group=4, sub_seqs=3)   # sub-sequences 0,3,6,9 | 1,4,7 | 2,5,8:
    assert multi.kept[0, 0].tolist() == [True, True, True, False, True, True, False, True, True, False]  # sink's only
    assert (multi.skipped, multi.total) == (3, 10)


def test_lambda_arguments_are_checked():
    x = sink_then_low(8, 8)
    with pytest.raises(ValueError, match="exactly one"):
        cr.modelopt_triton(x, 1.0, lam=0.1)
    with pytest.raises(ValueError, match="> 0"):
        cr.trtllm_gen(x, lam=0.0)
    with pytest.raises(ValueError, match="one query row"):
        cr.split_kv_decode(x, lam=0.1, chunks=2)


@pytest.mark.parametrize("t", [1e-3, 3e-2])
def test_hf_block_rule_and_triton_tile_rule_agree_on_whole_blocks(rng, t):
    """For lambda < 1 and lengths that fill the 128 x 128 blocks, the HF rule (inclusive cummax, any
    row above) and the kernel rule (exclusive running max, all valid rows below) make the same
    decision on every block the kernel visits."""
    scores = causal_logits(rng, 640, 640)
    hf = cr.modelopt_hf(scores, lam=t)
    tri = cr.modelopt_triton(scores, lam=t, block_m=128, block_n=128)
    lower = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(hf.kept & lower, tri.kept & lower)
    assert (hf.skipped, hf.total) == (tri.skipped, tri.total) and hf.skipped > 0


def test_running_max_over_kept_or_all_tiles_differs_only_above_one(rng):
    """Below lambda = 1 a skipped tile lies under every row's running max, so updating the max with
    it changes nothing; above 1 it does."""
    scores = causal_logits(rng, 512, 512)
    for lam in (1e-3, 0.5):
        kept = cr.modelopt_triton(scores, lam=lam, block_m=128, block_n=128)
        every = cr.modelopt_triton(scores, lam=lam, block_m=128, block_n=128, calibration=True)
        assert torch.equal(kept.kept, every.kept) and kept.skipped == every.skipped > 0
    x = torch.full((1, 1, 1, 96), LOW)
    x[..., 0], x[..., 32], x[..., 64] = 0.0, 0.8, 1.7           # 32-key tiles; ln lambda = 1
    kept = cr.modelopt_triton(x, lam=math.e)                     # max stays 0: 1.7 - 0 > 1, kept
    every = cr.modelopt_triton(x, lam=math.e, calibration=True)  # max moves to 0.8: 1.7 - 0.8 < 1
    assert kept.kept[0, 0, 0].tolist() == [True, False, True]
    assert every.kept[0, 0, 0].tolist() == [True, False, False]
