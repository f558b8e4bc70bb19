"""sparsecal bench break-even on the CPU: the run's geometry and lengths, the file built from given
timings (read back and used by an export), and the one-line refusals (no CUDA, bad options)."""
import json

import pytest
from typer.testing import CliRunner

from sparsecal.bench import breakeven as B
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.cli import app
from sparsecal.formats import dispatch as D
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import load_blasst

runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("be") / "run"
    write_synthetic_run(root, [1024, 2048], 2, layers=2, heads=4)
    return root


def _one_line(res, needle):
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.output


def test_without_cuda_or_with_bad_options_one_error_line(run, tmp_path):
    out = tmp_path / "be.json"
    _one_line(runner.invoke(app, ["bench", "break-even", "--run", str(run), "--out", str(out)]), "CUDA GPU")
    _one_line(runner.invoke(app, ["bench", "break-even", "--run", str(run), "--out", str(out), "--methods", "topk"]),
              "--methods takes bsfa,blasst")
    _one_line(runner.invoke(app, ["bench", "break-even", "--out", str(out)]), "--run")
    _one_line(runner.invoke(app, ["bench", "break-even", "--run", str(run), "--out", str(out), "--sparsities", "x"]),
              "comma-separated numbers")
    assert not out.exists()


def test_geometry_and_lengths_of_the_run(run):
    geo, lengths, info = B.geometry(run)
    assert geo == {"block_m": 128, "block_n": 64, "heads": 4, "kv_heads": 4, "head_dim": 64, "dtype": "bfloat16",
                   "batch": 1}
    assert lengths == [1024, 2048] and info == {"name": "run", "model": "synthetic-2x4"}
    assert B.geometry(run, [4096, 512])[1] == [512, 4096]
    args = B.parse(["--run", str(run), "--out", "f.json", "--lengths", "512,256", "--sparsities", "0.5,0,0.5"])
    assert args.lengths == [512, 256] and args.sparsities == [0.0, 0.5] and args.methods == ["bsfa", "blasst"]
    with pytest.raises(UserError, match="values in \\[0, 1\\)"):
        B.parse(["--run", str(run), "--out", "f.json", "--sparsities", "1.0"])


def test_file_from_given_timings_feeds_an_export(run, tmp_path):
    """Timings in, rows with the fastest backend and the break-even out, read back by export."""
    geo, lengths, info = B.geometry(run)
    measured = [{"method": m, "head_dim": 64, "group": 1, "length": n,
                 "dense": {"CUDNN_ATTENTION": 0.05, "FLASH_ATTENTION": 0.04}, "dense_gqa": {},
                 "points": [{"sparsity": 0.0, "ms": 0.06, "target": 0.0}, {"sparsity": 0.4, "ms": 0.05, "target": 0.5},
                            {"sparsity": 0.8, "ms": 0.03, "target": 0.9}]} for m in D.METHODS for n in lengths]
    doc = B.to_file(measured, geo, info, {"rounds": 3})
    assert {r["dense_backend"] for r in doc["rows"]} == {"FLASH_ATTENTION"}
    # 0.05 > 0.04 at 0.4, 0.03 <= 0.04 at 0.8: 0.4 + (0.05 - 0.04) / (0.05 - 0.03) * 0.4 = 0.6
    assert [r["break_even"] for r in doc["rows"]] == pytest.approx([0.6] * 4)
    assert doc["run"] == info and doc["request"] == {"rounds": 3} and "commit" in doc["provenance"]
    D.write_break_even(tmp_path / "be.json", doc)
    assert D.load_break_even(tmp_path / "be.json")["rows"] == json.loads(json.dumps(doc["rows"]))
    assert "break-even 0.600" in B.summary(doc)
    assert runner.invoke(app, ["fit", str(run), "--k", "8", "--targets", "0.5"]).exit_code == 0
    res = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "e"), "--break-even", str(tmp_path / "be.json")])
    assert res.exit_code == 0, res.output
    rec = load_blasst(tmp_path / "e")["dispatch"]
    assert [x for e in rec["configs"] for x in e["break_even"]] == pytest.approx([0.6] * 4)
    assert all(e["dense_backend"] == ["FLASH_ATTENTION"] * 2 for e in rec["configs"])
