"""BSFA decode thresholds in the export: thresholds.bsfa.pt and thresholds.safetensors carry
decode_thresholds [K, L, H, P] (the prefill layout) and decode_positions beside the prefill ones;
both loaders give ``BsfaExport.decode_for_k(k)``; exports without them still load (None), and asking
for thresholds-mode decode then is one line."""
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from sparsecal.analysis.fit import FitRequest, fit_run
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats import exports as FE
from sparsecal.formats.errors import UserError
from sparsecal.integrations.export import export_run
from sparsecal.integrations.exports import load_bsfa


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("dec")
    store = write_synthetic_run(base / "run", [1024, 2048], 3, layers=2, heads=3, seed=11)
    fit_run(store, FitRequest(k_values=[4, 8, 16], targets=[0.5]), warn=lambda line: None)
    export_run(store, base / "export", max_length=3000)
    return base / "run", base / "export"


def test_round_trip_pt_and_safetensors(exported):
    run, out = exported
    with safe_open(str(run / "fit" / "bsfa_thresholds.safetensors"), "np") as f:
        fitted, pos = f.get_tensor("decode_thresholds"), f.get_tensor("decode_positions")
    p = fitted.shape[-1]
    d = torch.load(out / "thresholds.bsfa.pt", weights_only=True)
    assert d["decode_thresholds"].shape == d["thresholds"].shape == (3, 2, 3, 24)  # ceil(3000 / 128)
    assert d["decode_positions"] == pos.tolist() == [7, 15]
    np.testing.assert_array_equal(d["decode_thresholds"][..., :p].numpy(), fitted)
    np.testing.assert_array_equal(d["decode_thresholds"][..., p:].numpy(), np.repeat(fitted[..., -1:], 24 - p, -1))
    for path in (out, out / "thresholds.bsfa.pt", out / "thresholds.safetensors"):
        exp = load_bsfa(path, expect={"num_layers": 2, "num_heads": 3})
        assert exp.decode_positions == (7, 15)
        for i, k in enumerate((4, 8, 16)):
            got = exp.decode_for_k(k)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (2, 3, 24)
            assert torch.equal(got, d["decode_thresholds"][i])
    numpy_exp = FE.load_bsfa(out)
    np.testing.assert_array_equal(numpy_exp.decode_for_k(8), d["decode_thresholds"][1].numpy())
    with pytest.raises(UserError, match="k=5 is not in the export"):
        numpy_exp.decode_for_k(5)


def _without_decode(out, dst):
    """An export as sparsecal wrote it before decode thresholds: the reference's nine .pt keys and a
    safetensors file with thresholds and k_values only."""
    dst.mkdir()
    d = torch.load(out / "thresholds.bsfa.pt", weights_only=True)
    torch.save({k: d[k] for k in FE.BSFA_KEYS}, dst / "thresholds.bsfa.pt")
    with safe_open(str(out / "thresholds.safetensors"), "np") as f:
        meta = f.metadata()
        save_file({k: f.get_tensor(k) for k in ("thresholds", "k_values")}, str(dst / "thresholds.safetensors"),
                  metadata=meta)
    return dst


def test_old_export_loads_without_decode(exported, tmp_path):
    _, out = exported
    old = _without_decode(out, tmp_path / "old")
    for path in (old / "thresholds.bsfa.pt", old / "thresholds.safetensors"):
        exp = load_bsfa(path)
        assert exp.decode_thresholds is None and exp.decode_positions is None
        assert exp.decode_for_k(8) is None and exp.for_k(8).shape == (2, 3, 24)
        with pytest.raises(UserError, match="no decode thresholds.*capture the run again") as e:
            exp.decode_for_k(8, required=True)
        assert "\n" not in str(e.value)


def test_damaged_decode_thresholds_refused(exported, tmp_path):
    _, out = exported
    d = torch.load(out / "thresholds.bsfa.pt", weights_only=True)
    bad = dict(d, decode_thresholds=d["decode_thresholds"].clone())
    bad["decode_thresholds"][1, 0, 2, 5] = float("nan")
    torch.save(bad, tmp_path / "nan.bsfa.pt")
    with pytest.raises(UserError, match="decode threshold at k=8, layer 0, head 2, block 5"):
        load_bsfa(tmp_path / "nan.bsfa.pt")
    torch.save(dict(d, decode_thresholds=d["decode_thresholds"][..., :3]), tmp_path / "shape.bsfa.pt")
    with pytest.raises(UserError, match="decode thresholds of shape"):
        load_bsfa(tmp_path / "shape.bsfa.pt")
    torch.save({k: v for k, v in d.items() if k != "decode_positions"}, tmp_path / "half.bsfa.pt")
    with pytest.raises(UserError, match="does not hold the BSFA export keys"):
        load_bsfa(tmp_path / "half.bsfa.pt")
    pos = list(d["decode_positions"])
    for wrong in (pos[::-1], [p - max(pos) - 1 for p in pos]):   # out of order; negative
        torch.save(dict(d, decode_positions=wrong), tmp_path / "pos.bsfa.pt")
        with pytest.raises(UserError, match="decode positions .* are not ascending block positions >= 0"):
            load_bsfa(tmp_path / "pos.bsfa.pt")
