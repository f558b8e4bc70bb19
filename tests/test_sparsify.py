"""sparsecal.sparsify on a tiny random Llama (reference backend): no-op thresholds reproduce dense
logits and generation; real exports skip exactly what the capture statistics say; densify undoes."""
import json
import math

import numpy as np
import pytest
import torch

import sparsecal
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import write_blasst
from sparsecal.integrations.exports import write_bsfa

from helpers import NOOP_BLASST_FACTOR, block_counts_torch, cli, make_checkpoint, write_prompts


@pytest.fixture
def tiny_model(tmp_path, seed):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    return path, AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def _noop_export(out, layers=2, heads=4):
    out.mkdir()
    thr = torch.full((2, layers, heads, 4), -math.inf)
    write_bsfa(out, thr, [1, 2], 128, 64, "mean", {"model": "tiny"})
    write_blasst(out, {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": NOOP_BLASST_FACTOR,
                                                                   "decode": NOOP_BLASST_FACTOR},
                       "target_sparsity": 0.5, "targets": [], "model": "tiny", "num_layers": layers,
                       "num_heads": heads, "q_block_size": 128, "k_block_size": 64, "schema_version": 1})
    return out


def _decode_lambda_one_export(out):
    """_noop_export with BLASST's decode factor at 451: lambda = 1 at the decode step after a
    450-token prompt (451 keys)."""
    exp = _noop_export(out)
    doc = json.loads((exp / "blasst.json").read_text())
    doc["threshold_scale_factor"]["decode"] = 451.0
    (exp / "blasst.json").write_text(json.dumps(doc))
    return exp


def write_bsfa_from_fit(run, exp):
    """Export only the BSFA part of a run whose BLASST fit was refused (the thresholds are the
    aggregation of the run's per-sample thresholds, as `sparsecal fit` computes them)."""
    from sparsecal.analysis.bsfa import ThresholdAccumulator
    from sparsecal.formats.run import RunStore

    store = RunStore.open(run)
    acc = ThresholdAccumulator()
    for sid in sorted(store.done_ids()):
        acc.add(store.load_sample(sid)[1]["bsfa_threshold"])
    exp.mkdir()
    write_bsfa(exp, torch.from_numpy(acc.result()), [1, 2], 128, 64, "mean", {"model": "tiny"})


@pytest.mark.parametrize("method,kw", [("bsfa", {"k": 2}), ("blasst", {}), ("window", {"blocks": 6}),
                                       ("bsfa", {"k": 2, "backend": "triton"}),
                                       ("blasst", {"backend": "triton"})])
def test_noop_thresholds_reproduce_dense(tiny_model, tmp_path, method, kw, seed):
    """Reference backend, and the Triton kernels (in the interpreter): prefill and decode."""
    _, model = tiny_model
    ids = torch.randint(0, 300, (2, 333), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        dense = model(ids).logits
        dense_gen = model.generate(ids[:1, :200], max_new_tokens=6, do_sample=False)
        sparsecal.sparsify(model, _noop_export(tmp_path / "e"), method=method, **kw)
        sparse = model(ids).logits
        stats = {k: v.clone() for k, v in model.sparsecal_stats.items()}
        sparse_gen = model.generate(ids[:1, :200], max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(sparse, dense, atol=1e-4, rtol=1e-4)
    assert torch.equal(sparse_gen, dense_gen)
    assert stats["skipped"].sum() == 0
    _, reach = block_counts_torch(333, 128, 64)
    # two sequences per forward; window:6 holds all 4 candidates of 333 tokens: dense's own path (the
    # kernels with skipping off), which counts the reachable tiles as dense does
    assert (stats["reachable"] == 2 * int(reach.sum())).all()
    sparsecal.densify(model)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense)


def test_real_export_skips_what_capture_measured(tiny_model, tmp_path, seed):
    """Layer 0 sees the same inputs as in capture, so a sample's own BSFA thresholds skip exactly
    A_i - min(k, A_i) candidates per query block and head there."""
    path, model = tiny_model
    prompts = write_prompts(tmp_path / "p.jsonl", [500], seed)
    run, exp = tmp_path / "run", tmp_path / "exp"
    assert cli("capture", "--model", path, "--prompts-file", prompts, "--out", run, "--k", "1,2").exit_code == 0
    # a random model's prefill tiles nearly all raise some row's max: BLASST prefill cannot skip,
    # so the fit targets decode-friendly nothing; BSFA is what this test checks
    res = cli("fit", run, "--holdout", "0", "--targets", "0.05")
    assert res.exit_code == 2 and "out of reach" in res.output
    write_bsfa_from_fit(run, exp)
    ids = torch.tensor([json.loads(prompts.read_text())["input_ids"]])
    cand, _ = block_counts_torch(500, 128, 64)
    for k in (1, 2):
        sparsecal.sparsify(model, exp, method="bsfa", k=k)
        with torch.no_grad():
            model(ids)
        want = int((cand - torch.clamp(cand, max=k)).sum())
        assert model.sparsecal_stats["skipped"][0].tolist() == [want] * 4
    sparsecal.densify(model)


def test_blasst_decode_skips_below_the_running_max(tiny_model, tmp_path, seed):
    """With lambda = 1 in decode (factor = length), every candidate tile whose scores all sit below
    the running max is skipped: a single decode row has such tiles even in a random model."""
    _, model = tiny_model
    exp = _decode_lambda_one_export(tmp_path / "e")
    ids = torch.randint(0, 300, (1, 450), generator=torch.Generator().manual_seed(seed))
    sparsecal.sparsify(model, exp, method="blasst")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    st = model.sparsecal_stats  # the last forward: one decode step at 451 keys
    assert (st["reachable"] == 451 // 64 + 1).all()
    assert 0 < st["skipped"].sum() < 451 // 64 * st["skipped"].numel()
    sparsecal.densify(model)


def test_refusals(tiny_model, tmp_path):
    _, model = tiny_model
    exp = _noop_export(tmp_path / "e", heads=8)
    with pytest.raises(UserError, match="num_heads 8, but it is applied to num_heads 4"):
        sparsecal.sparsify(model, exp, method="bsfa", k=1)
    with pytest.raises(UserError, match="needs k"):
        sparsecal.sparsify(model, _noop_export(tmp_path / "f"), method="bsfa")
    with pytest.raises(UserError, match="not one of"):
        sparsecal.sparsify(model, exp, method="topk")


def test_window_that_holds_every_candidate_runs_dense_attention(tiny_model, tmp_path, seed):
    """window:4 at 333 tokens (at most 4 candidates a query block): exactly what ``dense`` runs, bit
    for bit, with dense's counts (nothing skipped); at 700 tokens (up to 8) the window kernel runs and skips."""
    _, model = tiny_model
    gen = torch.Generator().manual_seed(seed)
    short, long = torch.randint(0, 300, (1, 333), generator=gen), torch.randint(0, 300, (1, 700), generator=gen)
    with torch.no_grad():
        sparsecal.sparsify(model, _noop_export(tmp_path / "e"), method="dense")
        dense, dense_reach = model(short).logits, model.sparsecal_stats["reachable"].clone()
        sparsecal.sparsify(model, tmp_path / "e", method="window", blocks=4)
        assert torch.equal(model(short).logits, dense) and torch.equal(model.sparsecal_stats["reachable"], dense_reach)
        assert model.sparsecal_stats["skipped"].sum() == 0
        model(long)
    cand, _ = block_counts_torch(700, 128, 64)
    assert (model.sparsecal_stats["skipped"] == int(np.clip(cand - 4, 0, None).sum())).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_window_skips_all_but_the_nearest_blocks(tiny_model, tmp_path, backend, seed):
    """window:1 keeps one candidate per query block: A_i - min(1, A_i) skipped in every layer and head."""
    _, model = tiny_model
    ids = torch.randint(0, 300, (1, 700), generator=torch.Generator().manual_seed(seed))
    sparsecal.sparsify(model, _noop_export(tmp_path / "e"), method="window", blocks=1, backend=backend)
    with torch.no_grad():
        model(ids)
    cand, reach = block_counts_torch(700, 128, 64)
    assert (model.sparsecal_stats["skipped"] == int(np.clip(cand - 1, 0, None).sum())).all()
    assert (model.sparsecal_stats["reachable"] == int(reach.sum())).all()
    with pytest.raises(UserError, match="blocks"):
        sparsecal.sparsify(model, tmp_path / "e", method="window")


def test_triton_backend_matches_reference_in_a_model(tiny_model, tmp_path, seed):
    """BSFA thresholds that keep everything (-inf) or skip everything (1e30, above any score: an
    export holds no +inf) scattered over layers, heads and positions, through both backends: same
    logits, same per-layer/head counts (the plumbing of layer, head and position)."""
    _, model = tiny_model
    g = torch.Generator().manual_seed(seed)
    # half of the 32 (layer, head, position) thresholds skip all, half none, shuffled: at least 8 of
    # each sit at positions 1-3 (query blocks with candidates), so some tiles are skipped, some kept
    thr = torch.where(torch.randperm(32, generator=g) < 16, -math.inf, 1e30).view(1, 2, 4, 4)
    exp = tmp_path / "e"
    exp.mkdir()
    write_bsfa(exp, thr, [1], 128, 64, "mean", {"model": "tiny"})
    ids = torch.randint(0, 300, (1, 520), generator=g)  # 5 query blocks: the last reads position 3 again
    got = {}
    for backend in ("reference", "triton"):
        sparsecal.sparsify(model, exp, method="bsfa", k=1, backend=backend)
        with torch.no_grad():
            got[backend] = (model(ids).logits, model.sparsecal_stats["skipped"].clone())
    torch.testing.assert_close(got["triton"][0], got["reference"][0], atol=2e-4, rtol=2e-4)
    assert torch.equal(got["triton"][1], got["reference"][1])
    assert 0 < got["triton"][1].sum() < got["triton"][1].numel() * int(block_counts_torch(520, 128, 64)[0].sum())
    sparsecal.densify(model)


def test_from_pretrained_with_registered_export(tiny_model, tmp_path, seed):
    """register(EXPORT_DIR, ...) then from_pretrained(attn_implementation="sparsecal_window")."""
    from transformers import AutoModelForCausalLM

    path, dense_model = tiny_model
    ids = torch.randint(0, 300, (1, 400), generator=torch.Generator().manual_seed(seed))
    state = sparsecal.register(_noop_export(tmp_path / "e"), method="window", blocks=1)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sparsecal_window").eval()
    sparsecal.sparsify(dense_model, tmp_path / "e", method="window", blocks=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense_model(ids).logits)
    cand, _ = block_counts_torch(400, 128, 64)
    assert (state.stats["skipped"] == int(np.clip(cand - 1, 0, None).sum())).all()
    sparsecal.densify(dense_model)


def test_registered_export_is_checked_against_the_model(tiny_model, tmp_path, rng):
    """register() cannot see the model: its first forward runs sparsify's checks (heads here)."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model
    sparsecal.register(_noop_export(tmp_path / "e", heads=8), method="blasst")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sparsecal_blasst").eval()
    with pytest.raises(UserError, match="num_heads 8, but it is applied to num_heads 4"), torch.no_grad():
        model(torch.randint(0, 300, (1, 100), generator=rng))


def test_per_layer_factors_run_each_layer_at_its_own_lambda(tiny_model, tmp_path, seed):
    """A --per-layer blasst.json: each layer gets its own lambda = factor_l / L; a layer whose
    lambda would exceed 1 (every candidate skipped) runs dense instead (reference backend)."""
    from sparsecal.integrations.sparsify import method_args

    _, model = tiny_model
    out = _noop_export(tmp_path / "export")
    doc = json.loads((out / "blasst.json").read_text())
    ids = torch.randint(0, 300, (1, 333), generator=torch.Generator().manual_seed(seed))
    cand = int(block_counts_torch(333, 128, 64)[0].sum()) * 4  # candidate tiles x heads
    for big, want in ((333.0, {"log_lambda": 0.0}), (1e9, {"dense": True})):  # lambda = 1; then > 1: dense's call
        doc["per_layer"] = {"prefill": {"0": NOOP_BLASST_FACTOR, "1": big}}
        write_blasst(out, doc)
        sparsecal.sparsify(model, out, method="blasst", backend="reference")
        state = model._sparsecal_state
        assert method_args(state, 0, "prefill", 333, "cpu")["log_lambda"] == math.log(NOOP_BLASST_FACTOR / 333)
        assert method_args(state, 1, "prefill", 333, "cpu") == want
        with torch.no_grad():
            model(ids)
        skipped = model.sparsecal_stats["skipped"].sum(dim=1)
        assert skipped[0] == 0 and skipped[1] < cand and (want == 0.0 or skipped[1] == 0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bsfa_decode_modes(tiny_model, tmp_path, backend, seed):
    """BSFA prefill thresholds of 1e30 skip every candidate in prefill. Decode: dense by default
    (nothing skipped), ``topk`` keeps the k largest of a row's A = 450 // 64 = 7 candidates, and
    ``thresholds`` reads the decode thresholds (here 1e30: every candidate skipped). The dense
    method and decode='dense' skip nothing and still count the reachable tiles."""
    _, model = tiny_model
    out = tmp_path / "e"
    out.mkdir()
    thr = torch.full((2, 2, 4, 8), 1e30)
    write_bsfa(out, thr, [1, 2], 128, 64, "mean", {"model": "tiny"}, decode=(thr.clone(), [3]))
    ids = torch.randint(0, 300, (1, 450), generator=torch.Generator().manual_seed(seed))
    a = 450 // 64
    for decode, want in ((None, 0), ("topk", a - 2), ("thresholds", a)):
        sparsecal.sparsify(model, out, method="bsfa", k=2, decode=decode, backend=backend)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False)
        st = model.sparsecal_stats  # the last forward: one decode step at 451 keys
        assert (st["reachable"] == a + 1).all() and (st["skipped"] == want).all(), decode
    sparsecal.sparsify(model, out, method="dense", backend=backend)
    with torch.no_grad():
        model(ids)
    _, reach = block_counts_torch(450, 128, 64)
    assert (model.sparsecal_stats["skipped"] == 0).all() and (model.sparsecal_stats["reachable"] == int(reach.sum())).all()
    with pytest.raises(UserError, match="not a decode mode of bsfa"):
        sparsecal.sparsify(model, out, method="bsfa", k=2, decode="sparse")
    _noop_export(tmp_path / "old")
    with pytest.raises(UserError, match="no BSFA decode thresholds"):
        sparsecal.sparsify(model, tmp_path / "old", method="bsfa", k=2, decode="thresholds")
    sparsecal.densify(model)


def test_dense_decode_step_runs_the_group_kernels_dense_path(tiny_model, tmp_path, seed):
    """A decode step that skips nothing by construction (BSFA decodes dense by default) runs the group
    kernel's tuned dense path (sparsify.GROUP_DENSE_MAX_D; not decode.py's split-K kernel; at batch 1
    and D = 64 its table may name the attend pass with skipping off), and generates dense's tokens."""
    from sparsecal.kernels.jit import LAST_COMPILED

    _, model = tiny_model
    ids = torch.randint(0, 300, (1, 200), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=3, do_sample=False)
    for name in ("group_dense", "group_attend", "decode_scores"):
        LAST_COMPILED.pop(name, None)
    sparsecal.sparsify(model, _noop_export(tmp_path / "e"), method="bsfa", k=2, backend="triton")
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=3, do_sample=False)
    sparsecal.densify(model)
    assert torch.equal(got, want)
    assert {"group_dense", "group_attend"} & set(LAST_COMPILED) and "decode_scores" not in LAST_COMPILED
