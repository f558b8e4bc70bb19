"""The exp law A exp(B S) / L is fitted and reported only from three or more targets: through two
(S, a_S) points it passes through both and is a/L itself, so ``fit`` says so in one line instead."""
import json

from sparsecal.analysis.blasst_laws import EXP_MIN_TARGETS, exp_note
from sparsecal.bench.synthetic import write_synthetic_run

from helpers import cli


def test_two_targets_fit_no_exp_law_and_say_so(tmp_path, seed):
    run = tmp_path / "run"
    write_synthetic_run(run, [1024, 2048], 2, layers=1, heads=2, seed=seed, law=(2.0, 4.0, 1.0))
    res = cli("fit", run, "--holdout", "0", "--targets", "0.3,0.5")
    assert res.exit_code == 0, res.output
    doc = json.loads((run / "fit" / "fit.json").read_text())
    fitted = [c for c in doc["blasst"] if c.get("laws")]
    assert fitted and all("exp" not in c["laws"] and "a/L" in c["laws"] for c in fitted)
    assert "exp law A*exp(B*S)/L not fitted: it needs >= 3 targets (this fit has 2;" in " ".join(res.output.split())


def test_exp_note_from_three_targets_on():
    assert EXP_MIN_TARGETS == 3 and exp_note([0.3, 0.5, 0.7]) is None
    assert "has 1;" in exp_note([0.5, 0.5]) and "\n" not in exp_note([0.3, 0.5])
