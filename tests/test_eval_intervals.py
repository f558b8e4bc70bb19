"""Paired bootstrap intervals of evaluation rows (toolkit/evaluation/intervals.py) and the
--methods grammar of decode modes and noise-floor methods."""
import re

import numpy as np
import pytest

from sparsecal.evaluation.intervals import DRAWS, _draws, cells
from sparsecal.evaluation.methods import Method, parse_methods, with_dense
from sparsecal.formats.errors import UserError


def _rows(np_rng, n, task="niah_single", flip=(), nll_shift=0.0, label="bsfa:16"):
    """Dense and one method on n samples: the method's score differs from dense's on ``flip``."""
    rows = []
    for i in range(n):
        sd = float(np_rng.random() < 0.7)
        nll = 2.0 + 0.1 * np_rng.random()
        sm = 1.0 - sd if i in flip else sd
        for lab, sc, nl, ll in (("dense", sd, nll, -1.0), (label, sm, nll + nll_shift, -1.0 - 0.1 * (i in flip))):
            rows.append(dict(sample_id=f"{task}{i}", label=lab, length=1024, task=task, score=sc, top1=0.98,
                             kl=0.01, nll=nl, answer_logprob=ll))
    return rows


def test_identical_method_has_a_point_interval(np_rng):
    c, p = cells(_rows(np_rng, 40))
    r = c.filter(c["label"] == "bsfa:16").to_dicts()[0]
    assert r["accuracy_rel_dense_lo"] == r["accuracy_rel_dense_hi"] == 1.0
    assert r["answer_ll_delta_lo"] == r["answer_ll_delta_hi"] == 0.0


def test_pairing_keeps_one_changed_answer_narrow(np_rng):
    """One changed answer in 50 moves the relative accuracy by about 1/35: paired draws keep the
    interval near that, where unpaired draws of two 70% means would span about +-0.25."""
    rows = _rows(np_rng, 50, flip={3})
    dense_score = next(r["score"] for r in rows if r["sample_id"] == "niah_single3" and r["label"] == "dense")
    c, p = cells(rows)
    r = c.filter(c["label"] == "bsfa:16").to_dicts()[0]
    pt = p.filter(p["label"] == "bsfa:16").to_dicts()[0]
    assert r["accuracy_rel_dense_lo"] <= pt["accuracy_rel_dense"] <= r["accuracy_rel_dense_hi"]
    width = r["accuracy_rel_dense_hi"] - r["accuracy_rel_dense_lo"]
    assert 0 < width < 0.1, width
    assert (pt["accuracy_rel_dense"] < 1) == (dense_score == 1.0)
    assert r["answer_ll_delta_hi"] <= 0.0 and r["answer_ll_delta_lo"] < 0


def test_intervals_equal_a_plain_loop_over_the_same_draws(np_rng):
    """The vectorized statistics equal a per-draw loop (text: dense ppl / the method's)."""
    rows = _rows(np_rng, 12, task="text", nll_shift=0.05) + _rows(np_rng, 12, flip={1, 2})
    c, p = cells(rows)
    text = [r for r in rows if r["task"] == "text"]
    ids = sorted({r["sample_id"] for r in text})
    nll = {lab: np.array([next(r["nll"] for r in text if r["sample_id"] == i and r["label"] == lab) for i in ids])
           for lab in ("dense", "bsfa:16")}
    idx = _draws(1024, "text", len(ids))
    loop = [np.exp(nll["dense"][d].mean() - nll["bsfa:16"][d].mean()) for d in idx]
    r = c.filter((c["label"] == "bsfa:16") & (c["task"] == "text")).to_dicts()[0]
    assert r["accuracy_rel_dense_lo"] == pytest.approx(np.percentile(loop, 2.5))
    assert r["accuracy_rel_dense_hi"] == pytest.approx(np.percentile(loop, 97.5))
    assert len(loop) == DRAWS and p.filter(p["label"] == "bsfa:16")["tasks"].to_list() == [2]


def test_missing_dense_rows_give_no_interval(np_rng):
    """A method lacking a sample dense has (an evaluation still running) gets no interval yet."""
    rows = [r for r in _rows(np_rng, 6) if not (r["label"] == "bsfa:16" and r["sample_id"] == "niah_single0")]
    c, _ = cells(rows)
    assert c.filter(c["label"] == "bsfa:16").height == 0


def test_decode_modes_and_floors_in_the_grammar():
    ms = with_dense(parse_methods("bsfa:16,32:topk,8:thresholds,blasst:0.5,0.5:dense,window:4:dense,sdpa"))
    assert [m.label for m in ms] == ["dense", "dense:fp32", "bsfa:16", "bsfa:32:topk", "bsfa:8:thresholds",
                                     "blasst:0.5", "blasst:0.5:dense", "window:4:dense", "sdpa"]
    assert ms[3].sparsify_kwargs == {"method": "bsfa", "k": 32, "decode": "topk", "dispatch": False}
    assert ms[1].sparsify_kwargs == {"method": "dense", "precision": "fp32"} and ms[1].is_floor
    assert ms[2].decode_mode == "dense" and ms[5].decode_mode == "sparse" and ms[-1].sparsify_kwargs == {}
    assert parse_methods("bsfa:16:dense") == [Method("bsfa", 16)]  # the default is not written
    for bad, why in (("bsfa:16:sparse", "not a decode mode of bsfa"), ("blasst:0.5:topk", "not a decode mode"),
                     ("bsfa:16:topk:x", "NAME:VALUE[:DECODE]")):
        with pytest.raises(UserError, match=re.escape(why)):
            parse_methods(bad)
