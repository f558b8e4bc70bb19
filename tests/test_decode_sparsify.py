"""sparsify(..., decode_decision="group"): decode steps run the group decision (a KV group skips a
tile only when every head would) through the group kernel and the reference alike."""

import pytest
import torch
from test_sparsify import _decode_lambda_one_export, _noop_export, tiny_model  # noqa: F401  (the fixture)

import sparsecal
from sparsecal.formats.errors import UserError


def test_group_decision_in_a_model(tiny_model, tmp_path, seed):  # noqa: F811
    """BLASST at lambda = 1 in decode: with the group decision both backends give the same logits
    and counts, every head of a KV group (2 query heads each) counts the same skipped tiles, and
    no more than with the per-head decision."""
    _, model = tiny_model
    exp = _decode_lambda_one_export(tmp_path / "e")
    ids = torch.randint(0, 300, (1, 450), generator=torch.Generator().manual_seed(seed))
    got = {}
    for backend, decision in (("reference", "group"), ("triton", "group"), ("reference", "head")):
        sparsecal.sparsify(model, exp, method="blasst", backend=backend, decode_decision=decision)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True)
        got[backend, decision] = (out.logits[-1], model.sparsecal_stats["skipped"].clone())
        sparsecal.densify(model)
    (lr, sr), (lt, st), (_, sh) = got.values()
    torch.testing.assert_close(lt, lr, atol=2e-4, rtol=2e-4)
    assert torch.equal(st, sr) and torch.equal(sr[:, 0::2], sr[:, 1::2])
    assert (sr <= sh).all() and sh.sum() > 0


def test_unknown_decision(tiny_model, tmp_path):  # noqa: F811
    _, model = tiny_model
    with pytest.raises(UserError, match="decode decision"):
        sparsecal.sparsify(model, _noop_export(tmp_path / "e"), method="blasst", decode_decision="any")
