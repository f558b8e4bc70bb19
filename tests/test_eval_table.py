"""scripts/eval-table's Markdown table (evaluation/report.markdown_table) against the committed
issue-27 evaluation, whose README table was written from the same summary and timing files."""
from pathlib import Path

import polars as pl

from sparsecal.evaluation.report import markdown_table
from sparsecal.evaluation.summary import own_speed

EVAL = Path(__file__).resolve().parents[1] / "data" / "eval" / "smollm2-1k-8k-h100-issue27" / "data"


def test_markdown_table_of_the_committed_evaluation():
    summary = pl.read_parquet(EVAL / "summary.parquet")
    lines = markdown_table(summary, own_speed(pl.read_parquet(EVAL / "timing.parquet"))).splitlines()
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in lines[2:]}
    assert len(rows) == len(lines) - 2 == summary.select("label", "length").n_unique()  # one row each
    assert lines[0].startswith("| method | tokens | niah_multikey: acc (n)")
    # the README's blasst:0.5 row at 8K: niah_single 0.72 (n=32) +1/-0 p=1, answer LL +0.124
    # [-0.003, +0.426], text KL 5.2e-03, distinguishable on both text tasks, TTFT graph 0.975
    row = rows[("blasst:0.5", "8192")]
    assert "0.72 (n=32) +1/-0 p=1; +0.124 [-0.003, +0.426]" in row
    assert "5.2e-03 [5.1e-03, 5.3e-03]; +0/-23 p=2.4e-07" in row and "| text, text_stdlib |" in row
    assert "| 0.57 / 0.62 | 0.667 / 0.975 | - / - |" in row  # TPOT: its decode sparsity did not match
    assert rows[("dense", "1024")].count("+0/-0 p=1") == 4 and "| no |" in rows[("dense", "1024")]
    # a timing with intervals (eval --time from 4 rounds) shows each speedup's interval beside it
    speed = own_speed(pl.read_parquet(EVAL / "timing.parquet")).with_columns(
        pl.lit(0.601).alias("speedup_ttft_lo"), pl.lit(0.7).alias("speedup_ttft_hi"))
    ci = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in markdown_table(summary, speed).splitlines()[2:]}
    assert "| 0.57 / 0.62 | 0.667 [0.601, 0.700] / 0.975 | - / - |" in ci[("blasst:0.5", "8192")]
    # without timings the speed cells are empty, the rest unchanged
    bare = markdown_table(summary).splitlines()
    assert bare[3].rsplit("|", 3)[0] == lines[3].rsplit("|", 3)[0] and bare[3].endswith("| - / - | - / - |")


S35 = EVAL.parents[1] / "smollm2-1k-8k-h100-s35" / "data"


def test_zero_skip_prefills_of_the_committed_evaluation_are_dense_bit_for_bit():
    """Issue 27: in the committed evaluation every prompt whose prefill skipped no tile reads KL 0 and
    top-1 1.000 against ``dense`` (the kernels' methods), and a ``+dispatch`` one the prompt NLL of
    ``dense+dispatch`` exactly (both run the record's SDPA backend there); vfa / vsa run the fp32
    reference, ``dense:fp32`` is the rounding floor."""
    rows = pl.read_parquet(S35 / "rows.parquet")
    zero = rows.filter((pl.col("prefill_skipped") == 0) & ~pl.col("label").is_in(["dense:fp32", "vfa"])
                       & ~pl.col("label").str.starts_with("vsa"))
    plain = zero.filter(~pl.col("label").str.ends_with("+dispatch"))
    assert plain.height > 3000 and set(plain["label"].unique()) >= {"bsfa:16", "blasst:0.5", "window_sink:32"}
    assert (plain["kl"] == 0).all() and (plain["top1"] == 1).all()
    floor = rows.filter(pl.col("label") == "dense+dispatch").select("sample_id", pl.col("nll").alias("floor"))
    disp = zero.filter(pl.col("label").str.ends_with("+dispatch")).join(floor, on="sample_id")
    assert disp.height > 3000 and (disp["nll"] == disp["floor"]).all()
    # and a prefill that skips is not: the test could fail
    assert (rows.filter((pl.col("label") == "bsfa:16") & (pl.col("prefill_skipped") > 0))["kl"] > 0).all()
