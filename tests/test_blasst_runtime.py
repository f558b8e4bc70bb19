"""BLASST at and past lambda = 1: the analysis counts exactly what the sparse kernels skip (every
candidate once ln(lambda) > 0), and the runtime policy never lets a saturated target skip every
candidate (sparsify runs dense there and below the validated lengths)."""
import json
import math

import numpy as np
import polars as pl
import pytest
import torch

import sparsecal
from sparsecal.analysis.blasst import skipped
from sparsecal.analysis.fit import FitRequest, fit_run
from sparsecal.formats.exports import (
    blasst_dense_below,
    blasst_min_length,
    blasst_runtime_lambda,
    load_blasst,
    write_blasst,
)
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.sparse.reference import sparse_attention, sparse_decode

from helpers import NOOP_BLASST_FACTOR, cli, make_checkpoint, write_prompts

BM = BN = 16       # small tiles: a random model's rows rarely set a new max late in a long scan
DECODE_ROWS = 16
ORDER = "forward"


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, module_seed):
    """A tiny random Llama captured at 256 and 512 tokens (two prompts each, 16 x 16 tiles), fitted
    at target 0.1: 256 tokens cannot reach it at lambda = 1, so the a/L law fitted at 512 gives
    lambda > 1 at 256 (saturated)."""
    base = tmp_path_factory.mktemp("sat")
    path = make_checkpoint(base / "tiny", module_seed, heads=4, kv_heads=2, layers=2, context=1024)
    prompts = write_prompts(base / "p.jsonl", [256, 256, 512, 512], module_seed)
    res = cli("capture", "--model", path, "--prompts-file", prompts, "--out", base / "run", "--block-m", BM,
              "--block-n", BN, "--orders", ORDER, "--decode-rows", DECODE_ROWS, "--k", "1,2")
    assert res.exit_code == 0, res.output
    store = RunStore.open(base / "run")
    doc = fit_run(store, FitRequest(targets=[0.1], holdout=0.5, order=ORDER), warn=lambda line: None)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
    return store, doc, model, path


def _counting_attention(xs: list[float], counts: dict):
    """An attention function that returns dense attention (so every layer sees the inputs capture
    saw) and counts, per (layer, head) and ln(lambda) in ``xs``, the candidate tiles the reference
    sparse kernels skip: prefill over the whole prompt, decode for each of its last rows."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer, n = module.layer_idx, query.shape[2]
        for x in xs:
            _, c = sparse_attention(query, key, value, scaling, BM, BN, log_lambda=x, order=ORDER)
            counts[("prefill", x)][layer] += c.skipped.numpy()
            for r in range(n - DECODE_ROWS, n):
                _, d = sparse_decode(query[:, :, r:r + 1], key[:, :, :r + 1], value[:, :, :r + 1], scaling, BM, BN,
                                     log_lambda=x, order=ORDER)
                counts[("decode", x)][layer] += d.skipped.numpy()
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    return fn


def _kernel_counts(model, ids, xs) -> dict:
    from transformers import AttentionInterface

    cfg = model.config
    counts = {(m, x): np.zeros((cfg.num_hidden_layers, cfg.num_attention_heads)) for m in ("prefill", "decode")
              for x in xs}
    AttentionInterface.register("sparsecal_test_count", _counting_attention(xs, counts))
    model.set_attn_implementation("sparsecal_test_count")
    try:
        with torch.no_grad():
            model(torch.as_tensor(ids, dtype=torch.long)[None])
    finally:
        model.set_attn_implementation("sdpa")
    return counts


def test_held_out_sparsity_is_what_the_kernel_counts(real_run):
    """On every held-out sample and length, at ln(lambda) on bin edges (exact: the histogram counts
    gap < e_k exactly), at lambda = 1 (gap < 0; gap == 0 tiles kept) and at lambda = 2 (saturated:
    every candidate), per (layer, head) and per mode, the analysis's skipped tiles equal the reference
    kernel's count; at the fitted a/L itself the table's achieved sparsity equals the kernel's up to
    the tiles of the one bin holding ln(lambda) (the curve is linear inside a bin), exactly where
    a/L > 1 (saturated: the whole histogram)."""
    store, doc, model, _ = real_run
    cfg = StatsConfig.from_dict(store.manifest["config"])
    edges = cfg.gap_edges()
    ev = pl.read_parquet(store.root / "fit" / "blasst_eval.parquet").filter(pl.col("method") == "a/L")
    a = {c["mode"]: c["a"] for c in doc["blasst"]}
    saturated = 0
    for sid in doc["split"]["test"]:
        rec, arrays = store.load_sample(sid)
        n = rec["length"]
        law = {m: math.log(a[m] / n) for m in a}
        xs = [float(edges[k]) for k in (len(edges) - 61, len(edges) - 21, len(edges) - 2)] + [0.0, math.log(2.0)]
        counts = _kernel_counts(model, arrays["input_ids"].tolist(), xs + sorted(set(law.values())))
        for mode, prefix in (("prefill", ""), ("decode", "decode_")):
            hist = np.asarray(arrays[f"{prefix}gap_count"], np.float64)[:, :, 0]       # [L, H, NG]
            for x in xs:
                assert np.array_equal(skipped(hist, edges, x), counts[(mode, x)]), (sid, mode, x)
            assert np.array_equal(skipped(hist, edges, math.log(2.0)), hist.sum(-1))  # saturated: every candidate
            assert 0 < counts[(mode, 0.0)].sum() < counts[(mode, math.log(2.0))].sum()  # gap == 0 tiles exist
            row = ev.filter((pl.col("mode") == mode) & (pl.col("length") == n))  # one held-out sample per length
            got = float(row["achieved"][0])
            reach = float(arrays["reachable"].sum()) if mode == "prefill" else float(
                sum(r // BN + 1 for r in range(n - DECODE_ROWS, n)))
            kernel = counts[(mode, law[mode])].sum() / (reach * hist.shape[0] * hist.shape[1])
            k = int(np.searchsorted(edges, law[mode], side="right"))
            slack = 0.0 if law[mode] > 0 else hist.sum((0, 1))[min(k, len(edges) - 1)] / (
                reach * hist.shape[0] * hist.shape[1])
            assert abs(got - kernel) <= slack + 1e-12, (sid, mode, got, kernel, slack)
            saturated += law[mode] > 0
    assert saturated >= 1  # the 256-token sample runs past lambda = 1 under the a/L law


def test_deployed_rows_apply_the_runtime_policy(real_run):
    """The held-out table's ``deployed`` rows: dense (nothing skipped, all mass kept) below the
    shortest length the target was reached at and wherever a/L > 1; a/L itself elsewhere."""
    store, doc, _, _ = real_run
    ev = pl.read_parquet(store.root / "fit" / "blasst_eval.parquet")
    pre = next(c for c in doc["blasst"] if c["mode"] == "prefill")
    assert pre["deployed"]["min_length"] == 512 and pre["deployed"]["validated_lengths"] == [512]
    dep = ev.filter((pl.col("method") == "deployed") & (pl.col("mode") == "prefill"))
    raw = ev.filter((pl.col("method") == "a/L") & (pl.col("mode") == "prefill"))
    short = dep.filter(pl.col("length") == 256)
    assert short["dense"].all() and (short["achieved"] == 0).all() and (short["retained_mass"] == 1).all()
    sat = raw.filter(pl.col("length") == 256)
    assert sat["saturated"].all() and (sat["achieved_candidates"] == 1.0).all()   # the kernel would skip them all
    long = dep.filter(pl.col("length") == 512).sort("achieved")
    assert long["achieved"].to_list() == raw.filter(pl.col("length") == 512).sort("achieved")["achieved"].to_list()


def _saturating_export(out, factor: float, validity=None, layers=2, heads=4):
    out.mkdir()
    entry = {"target_sparsity": 0.5, "threshold_scale_factor": {"prefill": factor, "decode": factor}}
    if validity is not None:
        entry["validity"] = validity
    write_blasst(out, {"algorithm": "skip_softmax", **entry, "targets": [entry], "model": "tiny",
                       "num_layers": layers, "num_heads": heads, "q_block_size": 128, "k_block_size": 64,
                       "schema_version": 1})
    return out


def test_saturated_target_never_skips_every_candidate(tmp_path, seed):
    """L < a: a/L > 1, where the kernel would skip every candidate tile; sparsify runs dense
    instead (logits equal dense, nothing counted), prefill and decode, with or without validity."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 300, (1, 333), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        dense = model(ids).logits
    # validated up to 8192 tokens: a factor past every covered length would be refused (formats.exports)
    for name, validity in (("old", None), ("new", {"prefill": {"law": "a/L", "validated_lengths": [4096, 8192],
                                                               "min_length": 4096, "max_length": 8192}})):
        exp = _saturating_export(tmp_path / name, 5000.0, validity)
        sparsecal.sparsify(model, exp, method="blasst", backend="reference")
        with torch.no_grad():
            logits = model(ids).logits
            assert model.sparsecal_stats["skipped"].sum() == 0 and model.sparsecal_stats["reachable"].sum() > 0
            model.generate(ids[:, :300], max_new_tokens=2, do_sample=False)
            assert model.sparsecal_stats["skipped"].sum() == 0
        torch.testing.assert_close(logits, dense, atol=1e-4, rtol=1e-4)
        sparsecal.densify(model)


def test_min_length_runs_dense_below_and_sparse_from_it(tmp_path, seed):
    """Decode at 451 keys with factor 451 (lambda = 1 exactly: the tiles below the running max are
    skipped, gap == 0 ones kept) skips when the law was validated from 400 tokens on, and runs dense
    when it was validated only from 500 on; the 450-token prefill (lambda > 1) runs dense in both."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 300, (1, 450), generator=torch.Generator().manual_seed(seed))
    for min_length, skips in ((500, False), (400, True)):
        v = {"law": "a/L", "validated_lengths": [min_length, 1024], "min_length": min_length, "max_length": 1024}
        exp = _saturating_export(tmp_path / f"m{min_length}", 451.0, {"prefill": v, "decode": v})
        sparsecal.sparsify(model, exp, method="blasst", backend="reference")
        with torch.no_grad():
            model(ids)
            assert model.sparsecal_stats["skipped"].sum() == 0          # prefill: 451 / 450 > 1
            model.generate(ids, max_new_tokens=2, do_sample=False)      # the last forward: decode at 451 keys
        assert (model.sparsecal_stats["skipped"].sum() > 0) == skips
        sparsecal.densify(model)


def test_runtime_lambda_policy():
    assert blasst_runtime_lambda(300.0, 600) == 0.5
    assert blasst_runtime_lambda(300.0, 300) == 1.0            # lambda = 1: gap < 0 skipped, gap == 0 kept
    assert blasst_runtime_lambda(300.0, 299) is None           # lambda > 1 would skip every candidate
    assert blasst_runtime_lambda(300.0, 1000, min_length=2048) is None
    assert blasst_runtime_lambda(None, 1000) is None
    assert blasst_runtime_lambda(NOOP_BLASST_FACTOR, 10) == NOOP_BLASST_FACTOR / 10
    assert blasst_dense_below(3616.0, 2048) == 3616 and blasst_dense_below(300.0, 2048) == 2048


@pytest.mark.parametrize("where", ["data/calibration/smollm2-1k-8k/export", "data/fixture/export",
                                   "data/exports/smollm2-engine/export"])
def test_committed_exports_without_validity_derive_it(where):
    """Exports written before ``validity`` existed load, and their min_length comes from the
    per_length rows with in_fit (the shortest length each target was reached at)."""
    from pathlib import Path

    doc = load_blasst(Path(__file__).parent.parent / where)
    for entry in doc["targets"]:
        for mode, f in entry["threshold_scale_factor"].items():
            if f is None:
                continue
            fitted = [p["length"] for p in entry["per_length"] if p["mode"] == mode and p["in_fit"]]
            assert blasst_min_length(doc, mode, entry["target_sparsity"]) == min(fitted)


def test_bad_validity_is_refused(tmp_path):
    from sparsecal.formats.errors import UserError

    exp = _saturating_export(tmp_path / "e", 100.0, {"prefill": {"validated_lengths": [2048, 1024],
                                                                  "min_length": 2048, "max_length": 1024}})
    with pytest.raises(UserError, match="validity"):
        load_blasst(exp)
    doc = json.loads((exp / "blasst.json").read_text())
    assert doc["target_sparsity"] == 0.5
