"""``fit``'s BLASST decode under the group decision (analysis/blasst_group.py, issue 28 part 2) on a
real small capture of a random GQA Llama (reference backend): the group skips no more than its heads
at the head law's lambda and needs a larger lambda for the same target; with one query head per KV
head it is the per-head decision exactly; fit.json and the CLI summary carry it."""
import math

import numpy as np
import polars as pl
import pytest

from sparsecal.analysis.blasst import skipped
from sparsecal.analysis.fit import FitRequest, fit_run
from sparsecal.analysis.samples import decode_reachable, finished_records
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig

from helpers import cli, make_checkpoint, write_prompts

TARGET = 0.01  # a random model's prefill skips little (~0.016 at lambda = 1 here)
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")


def _fit(tmp_path, seed, kv_heads):
    model = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=kv_heads, layers=2)
    prompts = write_prompts(tmp_path / "p.jsonl", [300, 300, 420, 420], seed)
    res = cli("capture", "--model", model, "--prompts-file", prompts, "--out", tmp_path / "run",
              "--block-m", 64, "--block-n", 16, "--k", "1,2", "--decode-rows", 40)
    assert res.exit_code == 0, res.output
    store = RunStore.open(tmp_path / "run")
    doc = fit_run(store, FitRequest(targets=[TARGET], holdout=0.0), warn=lambda line: None)
    fit = store.root / "fit"
    return store, doc, pl.read_parquet(fit / "blasst_decode_group.parquet"), pl.read_parquet(fit / "blasst_lambda.parquet")


def test_the_group_skips_less_and_needs_a_larger_lambda(tmp_path, seed):
    store, doc, grp, lam = _fit(tmp_path, seed, kv_heads=1)  # 4 query heads share one KV head
    assert grp.height == 2 and set(grp["length"]) == {300, 420} and (grp["target"] == TARGET).all()
    head = lam.filter((pl.col("mode") == "decode") & (pl.col("order") == "forward")).sort("length")
    g = grp.sort("length")
    assert (g["lambda_group_best"] >= head["lambda_best"] - 1e-12).all() and (g["a_group"] > g["a_head"]).all()
    # from the samples' own histograms: the group's share at the head law's lambda (no more than the
    # heads' own there, less somewhere), and the target at the group's lambda_best
    cfg = StatsConfig.from_dict(store.manifest["config"])
    edges = cfg.gap_edges()
    less = False
    for row in g.iter_rows(named=True):
        recs = [r for r in finished_records(store, lambda line: None, False) if r["length"] == row["length"]]
        arrays = [store.load_sample(r["id"], keys=("decode_gap_count", "decode_group_gap_count"))[1] for r in recs]
        hist = {key: sum(np.asarray(a[key], np.float64)[:, :, 0].sum((0, 1)) for a in arrays)
                for key in ("decode_gap_count", "decode_group_gap_count")}
        assert hist["decode_group_gap_count"].sum() == hist["decode_gap_count"].sum()  # the same candidate tiles
        layers, heads = np.asarray(arrays[0]["decode_gap_count"]).shape[:2]  # sparsity: of the reachable tiles
        total = len(recs) * decode_reachable(row["length"], cfg) * layers * heads
        share = {k: float(skipped(c, edges, math.log(row["lambda_head"])) / total) for k, c in hist.items()}
        assert math.isclose(row["group_sparsity_at_head_lambda"], share["decode_group_gap_count"], abs_tol=1e-12)
        assert math.isclose(row["head_sparsity_at_head_lambda"], share["decode_gap_count"], abs_tol=1e-12)
        assert share["decode_group_gap_count"] <= share["decode_gap_count"] + 1e-12
        less |= share["decode_group_gap_count"] < 0.9 * share["decode_gap_count"]
        got = float(skipped(hist["decode_group_gap_count"], edges, math.log(row["lambda_group_best"])) / total)
        assert math.isclose(got, TARGET, abs_tol=1e-6)
    assert less  # G = 4 heads: the group keeps tiles some head would skip
    (entry,) = doc["blasst_decode_group"]
    assert entry["target"] == TARGET and math.isclose(entry["a_group"], g["a_group"][0])
    out = cli("fit", store.root, "--targets", str(TARGET), "--holdout", "0")
    assert out.exit_code == 0 and "group decision" in out.output


def test_one_head_per_kv_head_is_the_head_decision(tmp_path, seed):
    _, _, grp, lam = _fit(tmp_path, seed, kv_heads=4)
    head = lam.filter((pl.col("mode") == "decode") & (pl.col("order") == "forward")).sort("length")
    g = grp.sort("length")
    np.testing.assert_allclose(g["lambda_group_best"], head["lambda_best"], rtol=1e-12)
    assert np.allclose(g["a_group"], g["a_head"], rtol=1e-12)


def test_the_known_group_law_of_a_synthetic_run(tmp_path, seed):
    """bench/synthetic.py draws the group gap as head 0's + ln 1.5 (whole 0.05 bins: + 0.40): the group's
    lambda_best is exp(0.40) times the per-head one at every length, so a_group / a_head = 1.49."""
    from sparsecal.bench.synthetic import write_synthetic_run

    store = write_synthetic_run(tmp_path / "run", [1024, 2048, 4096], 3, layers=1, heads=1, a=300.0, a_decode=30.0,
                                target=0.5, seed=seed)
    doc = fit_run(store, FitRequest(targets=[0.5], holdout=0.0), warn=lambda line: None)
    g = pl.read_parquet(store.root / "fit" / "blasst_decode_group.parquet").sort("length")
    head = pl.read_parquet(store.root / "fit" / "blasst_lambda.parquet").filter(
        (pl.col("mode") == "decode") & (pl.col("order") == "forward")).sort("length")
    np.testing.assert_allclose(g["lambda_group_best"] / head["lambda_best"], math.exp(0.40), rtol=0.02)
    (entry,) = doc["blasst_decode_group"]
    assert math.isclose(entry["a_group"] / entry["a_head"], math.exp(0.40), rel_tol=0.02)
    assert (g["group_sparsity_at_head_lambda"] < 0.5).all()


def test_the_group_law_travels_from_fit_to_export_to_sparsify(tmp_path, seed):
    """blasst.json carries the target's ``decode_group`` (factor and validated lengths); sparsify's
    group decision runs decode at that law, the head decision at the per-head one; an eval method
    ``blasst:T:group`` runs it, and is refused for an export without the group law; a damaged
    ``decode_group`` is refused in one line."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    import sparsecal
    from sparsecal.evaluation.inputs import check_methods, load_export
    from sparsecal.evaluation.methods import parse_methods
    from sparsecal.formats.errors import UserError
    from sparsecal.formats.exports import load_blasst
    from sparsecal.integrations.sparsify import call_args

    store, doc, grp, _ = _fit(tmp_path, seed, kv_heads=1)
    out = cli("export", store.root, "--out", tmp_path / "exp")
    assert out.exit_code == 0, out.output
    blasst = load_blasst(tmp_path / "exp")
    (entry,) = doc["blasst_decode_group"]
    law = blasst["decode_group"]
    assert law["threshold_scale_factor"] == entry["a_group"] and law["validity"] == entry["validity"]
    assert blasst["targets"][0]["decode_group"] == law and blasst["threshold_scale_factor"]["decode"] == entry["a_head"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", attn_implementation="sdpa").eval()
    n = law["validity"]["min_length"]
    for decision, a in (("head", entry["a_head"]), ("group", entry["a_group"])):
        sparsecal.sparsify(model, tmp_path / "exp", method="blasst", target=TARGET, decode_decision=decision,
                           dispatch=False)
        got = call_args(model._sparsecal_state, 0, "decode", n, "cpu")
        assert math.isclose(got["log_lambda"], math.log(a / n), rel_tol=1e-12), decision
    ids = torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    st = model.sparsecal_stats  # a decode step under the group law: every head of the group skips alike
    assert st["reachable"].sum() > 0 and torch.equal(st["skipped"], st["skipped"][:, :1].expand_as(st["skipped"]))
    sparsecal.densify(model)
    (m,) = parse_methods(f"blasst:{TARGET:g}:group")
    assert m.label == f"blasst:{TARGET:g}:group" and m.sparsify_kwargs["decode_decision"] == "group"
    info = load_export(tmp_path / "exp", {"id": blasst["model"], "num_layers": 2, "num_heads": 4})
    check_methods([m], info)
    path = tmp_path / "exp" / "blasst.json"
    raw = json.loads(path.read_text())
    for e in [raw] + raw["targets"]:
        e.pop("decode_group")
    path.write_text(json.dumps(raw))
    with pytest.raises(UserError, match="no decode law of the group decision"):
        check_methods([m], load_export(tmp_path / "exp", {"id": blasst["model"], "num_layers": 2, "num_heads": 4}))
    raw["decode_group"] = dict(law, threshold_scale_factor=-1.0)
    path.write_text(json.dumps(raw))
    with pytest.raises(UserError, match="decode_group must hold a finite positive"):
        load_blasst(tmp_path / "exp")
