"""`sparsecal eval --time`: every curve point's speed is timed on the very configuration its
accuracy rows ran (same method, value, decode mode, dispatch, same counted tiles); a point whose
timing came from another configuration loses its speedup; bench rows join only the same
configuration at the same sparsity; a --speed-only evaluation labels its accuracy meaningless.

A tiny random Llama (2 layers, 4 heads) with a byte-level tokenizer of its own (the task prompts
need one; 256 byte tokens and an EOS), the dispatch export of tests/helpers.py (BSFA k=1 skips
every candidate; at 256 tokens the dispatch record runs layer 1 dense), timed on the CPU."""
import json
import shutil

import polars as pl
import pytest

from sparsecal.evaluation.methods import DISPATCH_TAG
from sparsecal.formats.errors import UserError

from helpers import assert_user_error, cli, dispatch_export, make_checkpoint

TIMING = ["--time", "--rounds", "1", "--reps", "1", "--warmup", "0", "--decode-steps", "1", "--no-graph"]


def _byte_tokenizer(folder):
    """A byte-level BPE without merges (every byte one token) and an EOS, saved into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[])
    t = Tokenizer(bpe)
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>").save_pretrained(folder)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, module_seed):
    """(eval dir, checkpoint, export) of dense and bsfa:1 with and without dispatch, text at 256
    tokens, accuracy rows then the timing phase."""
    from sparsecal.capture.models import resolve_model

    root = tmp_path_factory.mktemp("speed")
    ck = make_checkpoint(root / "ck", module_seed, heads=4, kv_heads=2, layers=2, context=512)
    _byte_tokenizer(ck)
    export = dispatch_export(root / "export", model=resolve_model(str(ck)).model_id)
    out = root / "ev"
    res = cli("eval", export, "--out", out, "--model", ck, "--tasks", "text", "--lengths", "256",
              "--methods", "dense,bsfa:1", "--dispatch", "both", *TIMING)
    assert res.exit_code == 0, res.output
    return out, ck, export


def test_every_speed_point_is_the_evaluated_configuration(evaluated):
    from sparsecal.evaluation.methods import Method
    from sparsecal.evaluation.summary import own_speed
    from sparsecal.evaluation.timing import SPARSITY_TOL, method_record

    out = evaluated[0]
    rows = pl.read_parquet(out / "data" / "rows.parquet").to_dicts()
    timing = pl.read_parquet(out / "data" / "timing.parquet")
    curves = pl.read_parquet(out / "curves.parquet")
    assert sorted(timing["label"]) == ["bsfa:1", "bsfa:1+dispatch", "dense"]  # the floors are not timed
    assert set(timing["speed_device"]) == {"cpu"}
    for rec in timing.to_dicts():
        mine = [r for r in rows if r["label"] == rec["label"] and r["length"] == rec["length"]]
        assert mine and {(r["method"], r["config"]) for r in mine} == {(rec["method"], rec["config"])}
        assert rec["dispatch"] == rec["label"].endswith(DISPATCH_TAG)
        row = next(r for r in mine if r["sample_id"] == rec["prompt"])  # timed on one of its own prompts
        assert rec["prefill_reachable"] == row["prefill_reachable"]
        assert abs(rec["sparsity"] - rec["point_sparsity"]) <= SPARSITY_TOL and rec["sparsity_match"]
        assert rec["ttft_ms"] > 0 and rec["tpot_ms"] > 0 and rec["sdpa_ttft_backend"] == "sdpa"
        assert rec["decode_cache"] == "in_place"   # the decode steps append as serving does (kv_append)
        point = curves.filter((pl.col("label") == rec["label"]) & (pl.col("length") == rec["length"])).to_dicts()[0]
        assert point["speedup"] == point["speedup_ttft"] == rec["speedup_ttft"]
        assert point["accuracy_rel_dense"] is not None and point["accuracy_meaningful"]
    by = {r["label"]: r for r in timing.to_dicts()}
    # the two deployable forms are told apart by their counts: dispatch ran layer 1 dense at 256 tokens
    assert by["bsfa:1+dispatch"]["sparse_layers"] == 1 and by["bsfa:1"]["sparse_layers"] == 2
    assert by["bsfa:1+dispatch"]["prefill_reachable"] * 2 == by["bsfa:1"]["prefill_reachable"]
    # timings of the other configuration put on a point: no match, no speedup on that point
    t = {k: [by["bsfa:1"][k]] for k in ("prefill_skipped", "prefill_reachable", "decode_skipped",
                                          "decode_reachable", "sparse_layers")}
    t.update(ttft_ms=by["bsfa:1"]["ttft_rounds_ms"], tpot_ms=by["bsfa:1"]["tpot_rounds_ms"])
    base = {m: {"best": "sdpa", "ms": 1.0, "rest": 0.5, "share": 0.5} for m in ("ttft_ms", "ttft_graph_ms", "tpot_ms")}
    wrong = method_record(Method("bsfa", 1, None, True), 256, t, base, by["bsfa:1+dispatch"]["prompt"], rows)
    assert wrong["sparsity_match"] is False
    assert own_speed(pl.DataFrame([wrong]).with_columns(pl.lit("cpu").alias("speed_device")))["speedup_ttft"][0] is None
    assert all(rec["speedup_ttft_lo"] is None for rec in timing.to_dicts())   # one round: no interval


def test_each_speedup_has_the_interval_of_its_rounds(capsys):
    """method_record: with 5 rounds of the configuration and of the best SDPA, each speedup gets the
    exact interval of speed_stats.ratio_interval from exactly those rounds; the graph rounds are kept;
    a measure with a missing round (a graph that did not capture) has none; own_speed keeps an
    interval only where it keeps the speedup."""
    from sparsecal.evaluation.methods import Method
    from sparsecal.evaluation.speed_stats import ratio_interval
    from sparsecal.evaluation.summary import own_speed
    from sparsecal.evaluation.timing import method_record, print_speed, speed_line

    mine = {"ttft_ms": [10.0, 10.4, 9.9, 10.1, 10.2], "tpot_ms": [2.0, 2.1, 2.05, 1.95, 2.02],
            "ttft_graph_ms": [9.0, 9.1, 9.2, 8.9, 9.05], "tpot_graph_ms": [1.5, None, 1.52, 1.49, 1.5]}
    theirs = {"ttft_ms": [12.0, 12.2, 11.9, 12.5, 12.1], "tpot_ms": [2.2, 2.3, 2.25, 2.2, 2.28],
              "ttft_graph_ms": [11.0, 11.2, 10.9, 11.1, 11.0], "tpot_graph_ms": [1.6, 1.61, 1.59, 1.62, 1.6]}
    base = {m: {"best": "sdpa", "ms": sorted(v)[2], "rest": None, "share": None, "rounds": v} for m, v in theirs.items()}
    rec = method_record(Method("bsfa", 1, None, True), 256, mine, base, None, [])
    for name, m in (("speedup_ttft", "ttft_ms"), ("speedup_tpot", "tpot_ms"), ("speedup_ttft_graph", "ttft_graph_ms")):
        want = ratio_interval(theirs[m], mine[m])
        assert (rec[f"{name}_lo"], rec[f"{name}_hi"]) == (want["lo"], want["hi"]) and want["lo"] < want["hi"]
    assert rec["speedup_ttft_lo"] > 1.0   # 10.1 against 12.1 ms in every round: faster, and the interval says so
    assert rec["speedup_tpot_graph_lo"] is None and rec["tpot_graph_rounds_ms"] == mine["tpot_graph_ms"]
    line = speed_line(256, "bsfa:1", rec)   # the printed line: each interval it has, "-" / nothing where none
    for name in ("speedup_ttft", "speedup_tpot"):
        assert f"{rec[name]:.3f}x [{rec[name + '_lo']:.3f}, {rec[name + '_hi']:.3f}]" in line
    assert "(graph -x )" in line
    frame = pl.DataFrame([rec, {**rec, "label": "other", "sparsity_match": False}]).with_columns(
        pl.lit("cpu").alias("speed_device"))
    kept = own_speed(frame).to_dicts()
    assert kept[0]["speedup_ttft_lo"] == rec["speedup_ttft_lo"] and kept[1]["speedup_ttft_lo"] is None
    assert kept[1]["speedup_tpot_lo"] == rec["speedup_tpot_lo"]   # its decode still matched
    # the summary lines: the intervals each point keeps
    print_speed(own_speed(frame).with_columns(pl.lit(0.5).alias("sparsity"), pl.lit(0.5).alias("timed_sparsity")), True)
    got = capsys.readouterr().out.splitlines()
    lo, hi = rec["speedup_ttft_lo"], rec["speedup_ttft_hi"]
    tpot = f"TPOT {rec['speedup_tpot']:.3f}x [{rec['speedup_tpot_lo']:.3f}, {rec['speedup_tpot_hi']:.3f}]"
    assert len(got) == 2 and all(tpot in line and "(graph -x )" in line for line in got)
    assert f"TTFT {rec['speedup_ttft']:.3f}x [{lo:.3f}, {hi:.3f}]" in got[0] and "TTFT -x  (graph -x " in got[1]


def _bench(path, rows):
    path.write_text(json.dumps({"kind": "sparsecal-bench", "rows": rows, "provenance": {"gpu": "test"}}))
    return path


def test_bench_join_only_for_the_same_configuration(evaluated, tmp_path):
    from sparsecal.evaluation.command import finish
    from sparsecal.evaluation.store import EvalStore

    out = tmp_path / "ev"
    shutil.copytree(evaluated[0], out)
    store = EvalStore.open(out)
    s = {r["label"]: r["sparsity"] for r in store.rows}
    same = {"method": "bsfa", "config": "k=1", "length": 256, "speedup": 1.5, "task": "kernel", "dispatch": True,
            "sparsity": s["bsfa:1+dispatch"]}
    written = finish(store, [_bench(tmp_path / "ok.json", [same])])
    cur = pl.read_parquet(written["curves"]).filter(pl.col("label") == "bsfa:1+dispatch").to_dicts()[0]
    assert cur["bench_speedup_kernel"] == 1.5 and cur["speedup"] == cur["speedup_ttft"]  # its own speed first
    for bad, why in ((dict(same, sparsity=s["bsfa:1+dispatch"] + 0.05), "ran sparsity"),
                     (dict(same, config="k=2"), "has no evaluated configuration"),
                     ({k: v for k, v in same.items() if k != "sparsity"}, "records no sparsity"),
                     (dict(same, speedup=-2.0), "column speedup must be finite and > 0; row 0 holds -2.0"),
                     (dict(same, sparsity=float("nan")), "column sparsity must be in [0, 1]"),
                     (dict(same, speedup="fast"), "column speedup is not numeric")):
        with pytest.raises(UserError) as e:
            finish(store, [_bench(tmp_path / "bad.json", [bad])])
        assert why in str(e.value) and "\n" not in str(e.value)
    res = cli("eval", evaluated[2], "--out", out, "--bench", _bench(tmp_path / "bad.json", [dict(same, length=512)]))
    last = res.stderr.strip().splitlines()[-1]  # the progress lines first, then the refusal in one line
    assert res.exit_code == 2 and last.startswith("error: ") and "bsfa k=1 dispatch @ 512" in last, res.output


def test_speed_only_labels_accuracy_meaningless(evaluated, tmp_path):
    _, ck, export = evaluated
    out = tmp_path / "speed"
    res = cli("eval", export, "--out", out, "--model", ck, "--lengths", "256", "--methods", "bsfa:1",
              "--speed-only", *TIMING[1:])
    assert res.exit_code == 0, res.output
    assert not (out / "data" / "rows.parquet").exists()
    doc = json.loads((out / "results.json").read_text())
    assert doc["accuracy_meaningful"] is False and doc["timing"] is True
    assert {r["label"] for r in doc["rows"]} == {"dense", "bsfa:1"}
    assert all(r["accuracy_rel_dense"] is None and r["speedup_ttft"] > 0 for r in doc["rows"])
    cur = pl.read_parquet(out / "curves.parquet")
    assert not cur["accuracy_meaningful"].any() and cur["timed_sparsity"].is_not_null().all()
    assert "accuracy: meaningless" in res.output
    assert_user_error(cli("eval", export, "--out", tmp_path / "x", "--model", ck, "--lengths", "256",
                          "--methods", "bsfa:1", "--dispatch", "sometimes"), "--dispatch 'sometimes'")


@pytest.mark.parametrize("damage,needle", [
    ("bytes", "is not readable"),
    ("nan", "column speedup_tpot holds a value that is not a finite positive number"),
    ("crossed", "speedup_ttft_lo exceeds speedup_ttft_hi"),
    ("column", "lacks columns speed_device"),
    ("sparsity", "column sparsity must be in [0, 1]; row 0 holds 1.5"),
    ("count", "column decode_skipped must be finite and >= 0; row 0 holds -3"),
    ("text", "column speedup_ttft is String, not numeric"),
])
def test_a_damaged_timing_table_is_one_line(evaluated, tmp_path, damage, needle):
    """timing.parquet is checked when read: a file that is not Parquet, a speedup that is not a
    finite positive number, an interval whose ends cross, a missing column: one line, exit 2."""
    out = tmp_path / "ev"
    shutil.copytree(evaluated[0], out)
    path = out / "data" / "timing.parquet"
    t = pl.read_parquet(path)
    if damage == "bytes":
        path.write_bytes(b"PAR1 not a table")
    elif damage == "nan":
        t.with_columns(pl.lit(float("nan")).alias("speedup_tpot")).write_parquet(path)
    elif damage == "sparsity":
        t.with_columns(pl.lit(1.5).alias("sparsity")).write_parquet(path)
    elif damage == "count":
        t.with_columns(pl.lit(-3).alias("decode_skipped")).write_parquet(path)
    elif damage == "text":
        t.with_columns(pl.lit("fast").alias("speedup_ttft")).write_parquet(path)
    elif damage == "crossed":
        t.with_columns(pl.lit(1.2).alias("speedup_ttft_lo"), pl.lit(1.1).alias("speedup_ttft_hi")).write_parquet(path)
    else:
        t.drop("speed_device").write_parquet(path)
    res = cli("eval", evaluated[2], "--out", out)
    last = res.stderr.strip().splitlines()[-1]  # the progress lines first, then the refusal in one line
    assert res.exit_code == 2 and last.startswith("error: ") and needle in last and "time again" in last, res.output


def test_timing_shares_outside_their_range_read_as_null(evaluated, tmp_path):
    """A table written before shares came from graph replays (a share of -0.13): read_timing keeps
    the times and speedups and reads that share, and the ideal derived from it, as null."""
    from sparsecal.evaluation.store import read_timing

    out = tmp_path / "ev"
    shutil.copytree(evaluated[0], out)
    path = out / "data" / "timing.parquet"
    t = pl.read_parquet(path)
    t.with_columns(pl.lit(-0.13).alias("attention_share_decode"), pl.lit(0.97).alias("ideal_tpot"),
                   pl.lit(0.2).alias("attention_share")).write_parquet(path)
    got = read_timing(out)
    assert got["attention_share_decode"].null_count() == got["ideal_tpot"].null_count() == got.height > 0
    assert (got["attention_share"] == 0.2).all() and got["speedup_ttft"].equals(t["speedup_ttft"])


@pytest.mark.parametrize("damage, needle", [
    ("kl", "column kl must be finite; row 0 holds nan"),
    ("sparsity", "column sparsity must be in [0, 1]; row 0 holds 4.0"),
    ("label", "lacks columns label"),
])
def test_damaged_rows_are_one_line(evaluated, tmp_path, damage, needle):
    """rows.parquet is checked when read (EvalStore): a NaN measure, a sparsity of 4, a missing key
    column: one line naming the table, column, row and value, exit 2 (before: a crash in finish)."""
    out = tmp_path / "ev"
    shutil.copytree(evaluated[0], out)
    path = out / "data" / "rows.parquet"
    t = pl.read_parquet(path)
    first = pl.int_range(pl.len()) == 0
    if damage == "kl":
        t = t.with_columns(pl.when(first).then(float("nan")).otherwise(pl.col("kl")).alias("kl"))
    elif damage == "sparsity":
        t = t.with_columns(pl.when(first).then(4.0).otherwise(pl.col("sparsity")).alias("sparsity"))
    else:
        t = t.drop("label")
    t.write_parquet(path)
    res = cli("eval", evaluated[2], "--out", out)
    last = res.stderr.strip().splitlines()[-1]
    assert res.exit_code == 2 and last.startswith("error: ") and needle in last and "evaluate" in last, res.output


def test_attention_share_from_device_time_and_in_range():
    """The share a = 1 - rest / best SDPA is null outside [0, 1] (s41's 8B eager 64K step: rest 4.64 ms
    against SDPA's 4.09 gave -0.13), and a record takes the graph replays' share where captured."""
    from sparsecal.evaluation.methods import Method
    from sparsecal.evaluation.timing import attention_share, method_record

    assert attention_share(4.64, 4.09) is None and attention_share(None, 2.0) is None
    assert attention_share(1.5, 2.0) == 0.25 and attention_share(2.0, 2.0) == 0.0
    t = {"ttft_ms": [10.0] * 4, "tpot_ms": [5.0] * 4, "ttft_graph_ms": [9.0] * 4, "tpot_graph_ms": [2.0] * 4,
         "decode_skipped": [3], "decode_reachable": [4]}
    base = {"ttft_ms": {"best": "sdpa", "ms": 10.0, "rest": 8.0, "share": 0.2},
            "ttft_graph_ms": {"best": "sdpa", "ms": 9.0, "rest": 6.3, "share": 0.3},
            "tpot_ms": {"best": "sdpa", "ms": 4.09, "rest": 4.64, "share": None},
            "tpot_graph_ms": {"best": "sdpa", "ms": 2.0, "rest": 1.6, "share": 0.2}}
    rec = method_record(Method("bsfa", 1, None, True), 256, t, base, None, [])
    assert rec["attention_share"] == 0.3 and rec["attention_share_decode"] == 0.2
    assert rec["ideal_tpot"] == 1.0 / (1.0 - 0.2 * 0.75 / 2.0)
    del base["tpot_graph_ms"]
    rec = method_record(Method("bsfa", 1, None, True), 256, t, base, None, [])
    assert rec["attention_share_decode"] is None and rec["ideal_tpot"] is None
