"""sparsify / register with an export's dispatch record, on a tiny random Llama (reference backend):
a prefill runs a layer sparse only where the plan says so at its length bucket, else exactly
PyTorch SDPA counting nothing; dispatch=False and decode steps run as without a plan."""
import pytest
import torch

import sparsecal
from sparsecal.formats import dispatch as D
from sparsecal.formats.errors import UserError
from sparsecal.integrations.sparsify import dispatched_dense, expected_sparsity

from helpers import block_counts_torch, dispatch_export, make_checkpoint


@pytest.fixture
def tiny_model(tmp_path, seed):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "tiny", seed, heads=4, kv_heads=2, layers=2)
    return path, AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def _run(model, n, seed):
    ids = torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(ids).logits
    return logits, {k: v.clone() for k, v in model.sparsecal_stats.items()}


def test_dense_dispatched_layer_is_sdpa_and_counts_nothing(tiny_model, tmp_path, seed):
    _, model = tiny_model
    with torch.no_grad():
        sdpa = {n: model(torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))).logits
                for n in (200, 333)}
    exp = dispatch_export(tmp_path / "e")
    sparsecal.sparsify(model, exp, method="bsfa", k=1)
    cand = 4 * int(block_counts_torch(333, 128, 64)[0].sum())
    logits, st = _run(model, 333, seed)  # bucket 256: layer 0 sparse, layer 1 dense
    assert st["skipped"][0].sum() == cand and st["skipped"][1].sum() == 0 and st["reachable"][1].sum() == 0
    # the same as an export that leaves layer 1 alone under the same record (a layer left dense runs
    # what dense runs: the record's SDPA backend), bit for bit
    sparsecal.sparsify(model, dispatch_export(tmp_path / "ref", sparse_layers=(0,)), method="bsfa", k=1)
    assert torch.equal(_run(model, 333, seed)[0], logits)
    sparsecal.sparsify(model, exp, method="bsfa", k=1)
    logits, st = _run(model, 200, seed)  # below the shortest calibrated length: every layer dense
    assert torch.equal(logits, sdpa[200]) and st["skipped"].sum() == 0 and st["reachable"].sum() == 0
    _, st = _run(model, 520, seed)  # bucket 512: both layers sparse
    assert (st["skipped"].sum(1) == 4 * int(block_counts_torch(520, 128, 64)[0].sum())).all()
    sparsecal.sparsify(model, exp, method="bsfa", k=1, dispatch=False)  # every exported layer sparse
    _, st = _run(model, 333, seed)
    assert (st["skipped"].sum(1) == cand).all()
    sparsecal.densify(model)
    with torch.no_grad():
        assert torch.equal(model(torch.randint(0, 300, (1, 333), generator=torch.Generator().manual_seed(seed))).logits,
                           sdpa[333])


def test_decode_is_not_dispatched(tiny_model, tmp_path, seed):
    """Layer 1 runs its 333-token prefill dense, but the decode step through the kernels (BSFA
    decodes dense: nothing skipped, the reachable tiles counted) as without a plan."""
    _, model = tiny_model
    sparsecal.sparsify(model, dispatch_export(tmp_path / "e"), method="bsfa", k=1)
    ids = torch.randint(0, 300, (1, 333), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    st = model.sparsecal_stats  # the last forward: one decode step at 334 keys
    assert (st["reachable"] == 334 // 64 + 1).all() and st["skipped"].sum() == 0
    sparsecal.densify(model)


def test_plan_lookup_and_backends(tiny_model, tmp_path):
    _, model = tiny_model
    sparsecal.sparsify(model, dispatch_export(tmp_path / "e", layer1=(0.5, 0.2)), method="blasst")
    state = model._sparsecal_state
    assert state.plan["sparse"] == [[True, True], [True, False]]
    got = {n: [dispatched_dense(state, layer, "prefill", n) for layer in (0, 1)] for n in (100, 256, 511, 512, 9000)}
    assert got == {100: ["CUDNN_ATTENTION"] * 2, 256: [None, None], 511: [None, None],
                   512: [None, "FLASH_ATTENTION"], 9000: [None, "FLASH_ATTENTION"]}
    assert dispatched_dense(state, 1, "decode", 9000) is None
    # the kernel pick's hint: the layer's calibrated sparsity at the bucket (none below it, nor in decode)
    hints = {n: [expected_sparsity(state, layer, "prefill", n) for layer in (0, 1)] for n in (100, 300, 600)}
    assert hints == {100: [None, None], 300: [0.9, 0.5], 600: [0.9, 0.2]}
    assert expected_sparsity(state, 0, "decode", 600) is None
    sparsecal.sparsify(model, tmp_path / "e", method="blasst", dispatch=False)
    assert model._sparsecal_state.plan is None
    assert expected_sparsity(model._sparsecal_state, 0, "prefill", 600) is None
    sparsecal.sparsify(model, tmp_path / "e", method="window", blocks=1)  # no calibrated operating point
    assert model._sparsecal_state.plan is None
    sparsecal.densify(model)


def test_registered_export_dispatches(tiny_model, tmp_path, seed):
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model
    state = sparsecal.register(dispatch_export(tmp_path / "e"), method="bsfa", k=1)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sparsecal_bsfa").eval()
    ids = torch.randint(0, 300, (1, 333), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(ids)
    cand = 4 * int(block_counts_torch(333, 128, 64)[0].sum())
    assert state.stats["skipped"][0].sum() == cand and state.stats["skipped"][1].sum() == 0


def test_sdpa_first_puts_one_backend_first_and_restores_the_order(rng):
    from sparsecal.integrations.sparsify import _sdpa_first

    before = torch._C._get_sdp_priority_order()
    q, k, v = torch.randn(1, 4, 70, 16, generator=rng), torch.randn(1, 2, 70, 16, generator=rng), \
        torch.randn(1, 2, 70, 16, generator=rng)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for name in D.SDPA_BACKENDS:
        with _sdpa_first(name):
            order = torch._C._get_sdp_priority_order()
            got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert order[0] == int(getattr(torch.nn.attention.SDPBackend, name)) and sorted(order) == sorted(before)
        assert torch._C._get_sdp_priority_order() == before
        torch.testing.assert_close(got, want)  # on the CPU the first backend that can run does


def test_bsfa_with_a_damaged_blasst_json_says_dispatch_false_runs_without_it(tiny_model, tmp_path, seed):
    """BSFA reads blasst.json only for the dispatch record: a damaged one is refused in one line
    that names the way around it, and dispatch=False runs BSFA as before."""
    _, model = tiny_model
    exp = dispatch_export(tmp_path / "e")
    (exp / "blasst.json").write_text("{ not json")
    with pytest.raises(UserError, match=r"blasst\.json.*dispatch=False"):
        sparsecal.sparsify(model, exp, method="bsfa", k=1)
    sparsecal.sparsify(model, exp, method="bsfa", k=1, dispatch=False)
    ids = torch.randint(0, 300, (1, 333), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(ids)
    assert (model.sparsecal_stats["skipped"].sum(1) == 4 * int(block_counts_torch(333, 128, 64)[0].sum())).all()
