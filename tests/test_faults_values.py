"""Fault injection, round two (issue 30, items 1 and 4): values are checked, not only shapes, and
writes stay inside the directory a command owns.

Promises held here, each by the test named after it:
- a sample holding an impossible statistic (NaN or inf where none is allowed, a negative count, a
  per-position mass above 1, block counts that are not its length's) is refused by every reader
  with its id and the entry; `fit` leaves it out in one warning line and exits 0 on the rest, or
  says in one error line that none is left;
- manifest records are checked against the samples they describe: swapped or missing lengths
  are refused by `fit` with one line naming `doctor`, which repairs them from the samples, and
  rebuilds a manifest's lost samples, model, config and dtype from them;
- `doctor` on a run this sparsecal cannot capture into (the committed fixture) does not tell the
  user to re-run the capture;
- `export` validates everything before writing anything (NaN fitted thresholds or factors:
  nothing written), and refuses a run, its fit/ or samples/, a sample folder, an evaluation and
  any other non-empty directory that is not an export;
- a BLASST factor with lambda >= 1 at every covered length (1e300) is refused by every reader;
- `sparsify()` without model_id refuses an export of another checkpoint or head_dim; a lone .pt
  names its model;
- no command follows a symbolic link out of the run: RUN/.lock, RUN/fit, a sample folder.
"""
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from sparsecal.analysis.samples import finished_records
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import load_blasst
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig

from helpers import FIXTURE, assert_user_error, cli, make_checkpoint

pytestmark = pytest.mark.faults

CFG = StatsConfig(block_m=128, block_n=128, orders=("forward",), k_values=(2, 4), decode_rows=16)
LENGTHS = [512, 1024]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, module_seed):
    """A synthetic run (2 lengths x 2 samples, 2 layers x 4 heads), fitted and exported."""
    root = tmp_path_factory.mktemp("values") / "run"
    write_synthetic_run(root, LENGTHS, 2, layers=2, heads=4, cfg=CFG, seed=module_seed)
    res = cli("fit", root, "--targets", "0.3", "--holdout", "0")
    assert res.exit_code == 0, res.output
    res = cli("export", root, "--out", root.parent / "export")
    assert res.exit_code == 0, res.output
    return root


@pytest.fixture
def run(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "run", symlinks=True)


@pytest.fixture
def export(pristine, tmp_path):
    return shutil.copytree(pristine.parent / "export", tmp_path / "export")


def poke(path, key, value, index=0):
    """Set one entry (flat ``index``) of array ``key`` of a safetensors file, keeping its header
    metadata (a sparse-encoded array: its first stored value)."""
    with safe_open(str(path), framework="np") as f:
        meta, arrays = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not iterable
    name = key if key in arrays else f"{key}.val"
    a = arrays[name].copy()
    a.reshape(-1)[index] = value
    arrays[name] = a
    save_file(arrays, str(path), metadata=meta)


def manifest(root):
    return json.loads((root / "manifest.json").read_text())


def write_manifest(root, man):
    (root / "manifest.json").write_text(json.dumps(man))


# ---- raw tiles (capture --raw) ---------------------------------------------------------------------
RAW_BAD = [("raw_gap", float("nan")), ("raw_bmax", float("inf")), ("raw_mass", 1.5), ("raw_mass", -0.5)]


@pytest.mark.parametrize("key,value", RAW_BAD, ids=[f"{k}={v}" for k, v in RAW_BAD])
def test_raw_tiles_are_checked_when_read(tmp_path, key, value):
    """The committed fixture's raw tiles (a real capture with --raw) read back checked; one
    impossible value in them is one line naming the array, the entry and what to do."""
    run = shutil.copytree(FIXTURE, tmp_path / "fixture")
    store = RunStore.open(run)
    sid = store.manifest["samples"][0]["id"]
    _, arrays = store.load_sample(sid, raw=True)
    assert {"raw_bmax", "raw_mass", "raw_gap"} <= set(arrays)
    poke(run / "samples" / sid / "raw.safetensors", key, value)
    with pytest.raises(UserError, match=rf"raw.safetensors holds an impossible value or shape \({key}\[0, 0, 0"):
        RunStore.open(run).load_sample(sid, raw=True)
    RunStore.open(run).load_sample(sid)   # the statistics alone still read


def test_raw_tiles_of_another_geometry_are_refused():
    """check_raw: the tile grid of the sample's length, one [layers, heads] for all three arrays,
    the run's scan orders; -inf (an unreachable tile) is a value a tile can have."""
    from sparsecal.formats.sample_values import check_raw

    ok = {"raw_bmax": np.full((2, 3, 4, 8), -np.inf, np.float16), "raw_mass": np.zeros((2, 3, 4, 8), np.float16),
          "raw_gap": np.zeros((2, 3, 1, 4, 8), np.float16)}
    assert check_raw(ok, 500, 128, 64, orders=1) is None
    assert check_raw(ok, 500, 128, 64) is None
    assert "raw_bmax has shape [2, 3, 4, 8], not [layers, heads, 5, 9]" in check_raw(ok, 513, 128, 64)
    assert "raw_gap has shape" in check_raw(ok, 500, 128, 64, orders=2)
    assert "raw_mass has shape [2, 2, 4, 8]" in check_raw({**ok, "raw_mass": ok["raw_mass"][:, :2]}, 500, 128, 64)


# ---- samples: values -----------------------------------------------------------------------------
BAD = [("gap_mass", float("nan")), ("decode_gap_mass", float("inf")), ("gap_count", -3),
       ("bsfa_threshold", float("nan")), ("bsfa_top_bmax", float("inf")), ("bsfa_skipped_mass", 2.5),
       ("decode_bsfa_cand_mass", float("nan")), ("tstar_hist", -1), ("qinit_count", -7), ("joint_count", -7),
       ("candidates", 99)]


@pytest.mark.parametrize("key,value", BAD, ids=[k for k, _ in BAD])
def test_impossible_statistic_is_refused_by_readers_and_left_out_by_name(run, key, value):
    sid = "synthetic-512-0000"
    poke(run / "samples" / sid / "stats.safetensors", key, value)
    store = RunStore.open(run)
    assert key in store.check_values(sid)
    with pytest.raises(UserError, match=f"{sid}.*{key}"):
        store.load_sample(sid, keys=(key,))
    warnings = []
    assert sid not in {r["id"] for r in finished_records(store, warnings.append)}
    assert len(warnings) == 1 and sid in warnings[0] and key in warnings[0]
    assert sid in store.scan(values=True) and store.scan(values=True)[sid] is not None


def test_joint_count_on_other_bins_than_qinit_is_refused():
    """joint_count must have qinit_count's shape (the same bins); a sample without it passes."""
    from sparsecal.formats.sample_values import check_shapes

    flat = {"input_ids": (300,), "candidates": (3,), "reachable": (3,)}
    ok = dict(flat, qinit_count=(2, 4, 162), joint_count=(2, 4, 162))
    assert check_shapes(ok, 300, 128, 2, 4) is None
    assert check_shapes(dict(flat, qinit_count=(2, 4, 162)), 300, 128, 2, 4) is None
    why = check_shapes(dict(ok, joint_count=(2, 4, 81)), 300, 128, 2, 4)
    assert why == "joint_count has shape [2, 4, 81], not [2, 4, 162] of qinit_count (the same bins)"


def test_fit_leaves_a_nan_sample_out_and_exits_0(run):
    poke(run / "samples" / "synthetic-1024-0001" / "stats.safetensors", "gap_mass", float("nan"))
    res = cli("fit", run, "--targets", "0.3", "--holdout", "0")
    assert res.exit_code == 0, res.output
    warn = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "synthetic-1024-0001" in " ".join(res.stderr.split())
    fit = json.loads((run / "fit" / "fit.json").read_text())
    assert "synthetic-1024-0001" not in fit["split"]["train"] and len(fit["split"]["train"]) == 3
    thr = np.asarray(safe_open(str(run / "fit" / "bsfa_thresholds.safetensors"), "np").get_tensor("thresholds"))
    assert not np.isnan(thr).any()
    res = cli("doctor", run)
    assert res.exit_code == 0 and "damaged: synthetic-1024-0001: gap_mass" in res.output


def test_fit_with_every_sample_nan_is_one_error_line(run):
    for folder in (run / "samples").iterdir():
        poke(folder / "stats.safetensors", "gap_mass", float("nan"))
    assert_user_error(cli("fit", run, "--targets", "0.3"), "no usable sample", "gap_mass")


def test_fit_error_starts_without_a_blank_line(run):
    p = subprocess.run([sys.executable, "-m", "sparsecal.cli", "fit", str(run), "--targets", "0.99"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2 and p.stderr.startswith("error: "), repr(p.stderr)


# ---- manifest records against their samples ----------------------------------------------------
def test_swapped_lengths_are_refused_by_fit_and_repaired_by_doctor(run):
    man = manifest(run)
    a = next(r for r in man["samples"] if r["length"] == 512)
    b = next(r for r in man["samples"] if r["length"] == 1024)
    a["length"], b["length"] = 1024, 512
    write_manifest(run, man)
    assert_user_error(cli("fit", run, "--targets", "0.3"), a["id"], "sparsecal doctor")
    assert_user_error(cli("export", run, "--out", run.parent / "e"), "sparsecal doctor")  # the old fit's reader
    assert not (run.parent / "e").exists()
    res = cli("doctor", run)
    assert res.exit_code == 0, res.output
    assert f"record of {a['id']}: length 1024 -> 512" in res.output and f"record of {b['id']}" in res.output
    assert all(r["length"] == int(r["id"].split("-")[1]) for r in manifest(run)["samples"])
    assert cli("fit", run, "--targets", "0.3", "--holdout", "0").exit_code == 0
    assert "agrees with the samples" in cli("doctor", run).output


@pytest.mark.parametrize("bad", ["missing", "string"])
def test_record_without_a_length_is_one_line_and_doctor_repairs_it(run, bad):
    man = manifest(run)
    if bad == "missing":
        del man["samples"][0]["length"]
    else:
        man["samples"][0]["length"] = "512"
    man["samples"].append({"id": "planned-1", "task": "x", "length": "many"})  # planned, never captured
    write_manifest(run, man)
    assert_user_error(cli("fit", run, "--targets", "0.3"), man["samples"][0]["id"], "sparsecal doctor")
    res = cli("doctor", run)
    assert res.exit_code == 0 and "dropped the planned record of planned-1" in res.output, res.output
    assert cli("fit", run, "--targets", "0.3", "--holdout", "0").exit_code == 0


def test_doctor_rebuilds_a_manifest_from_its_samples(run):
    want = manifest(run)
    man = {k: v for k, v in want.items() if k not in ("samples", "config", "model", "dtype")}
    write_manifest(run, man)
    assert_user_error(cli("fit", run), "sparsecal doctor")
    res = cli("doctor", run)
    assert res.exit_code == 0, res.output
    got = RunStore.open(run).manifest
    for key in ("config", "model", "dtype"):
        assert got[key] == want[key], key
    assert sorted(r["id"] for r in got["samples"]) == sorted(r["id"] for r in want["samples"])
    (run / "manifest.json").write_text("{garbled")
    assert cli("doctor", run).exit_code == 0 and RunStore.open(run).manifest["model"] == want["model"]


def test_doctor_on_the_committed_fixture_does_not_advise_a_refused_capture(tmp_path):
    run = shutil.copytree(FIXTURE, tmp_path / "fixture", ignore=shutil.ignore_patterns("raw.safetensors"))
    victim = min((run / "samples").iterdir())
    data = (victim / "stats.safetensors").read_bytes()
    (victim / "stats.safetensors").write_bytes(data[: len(data) // 3])
    res = cli("doctor", run)
    assert res.exit_code == 0 and f"damaged: {victim.name}" in res.output
    assert "run the same capture command" not in res.output and "new directory" in res.output


# ---- exports -----------------------------------------------------------------------------------
def test_export_with_nan_thresholds_writes_nothing(run, tmp_path):
    poke(run / "fit" / "bsfa_thresholds.safetensors", "thresholds", float("nan"), index=5)
    out = tmp_path / "new-export"
    assert_user_error(cli("export", run, "--out", out), "bsfa_thresholds", "sparsecal fit")
    assert not out.exists()


def test_export_with_a_nan_factor_in_the_fit_writes_nothing(run, tmp_path):
    fit = json.loads((run / "fit" / "fit.json").read_text())
    fit["blasst"][0]["a"] = float("nan")
    (run / "fit" / "fit.json").write_text(json.dumps(fit))
    out = tmp_path / "new-export"
    assert_user_error(cli("export", run, "--out", out), "fit.json", "sparsecal fit")
    assert not out.exists()


@pytest.mark.parametrize("where", ["run", "fit", "samples", "sample", "inside samples", "eval", "foreign"])
def test_export_refuses_a_directory_it_does_not_own(run, tmp_path, where):
    target = {"run": run, "fit": run / "fit", "samples": run / "samples",
              "sample": run / "samples" / "synthetic-512-0000", "inside samples": run / "samples" / "new",
              "eval": tmp_path / "eval", "foreign": tmp_path / "foreign"}[where]
    if where == "eval":
        (target / "data").mkdir(parents=True)
        (target / "data" / "manifest.json").write_text(json.dumps({"kind": "sparsecal-eval-run"}))
    if where == "foreign":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert_user_error(cli("export", run, "--out", target), str(target.name))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_export_into_its_own_export_directory_still_works(run, export):
    res = cli("export", run, "--out", export, "--force")
    assert res.exit_code == 0, res.output


def _set_factor(path, value):
    doc = json.loads(path.read_text())
    for entry in [doc] + doc["targets"]:
        if entry["target_sparsity"] == doc["target_sparsity"]:
            entry["threshold_scale_factor"]["prefill"] = value
    path.write_text(json.dumps(doc))


def test_factor_past_every_covered_length_is_refused(export):
    _set_factor(export / "blasst.json", 1e300)
    with pytest.raises(UserError, match="lambda = factor / L >= 1 at every length up to the 1024 tokens"):
        load_blasst(export)
    _set_factor(export / "blasst.json", 1000.0)  # lambda < 1 at 1024 tokens: kept
    assert load_blasst(export)["threshold_scale_factor"]["prefill"] == 1000.0


def test_engine_json_factor_past_every_covered_length_is_refused(pristine, tmp_path):
    from sparsecal.formats.engine_files import load_engine_manifest

    out = tmp_path / "engines"
    res = cli("fit", shutil.copytree(pristine, tmp_path / "r"), "--targets", "0.2,0.3", "--holdout", "0")
    assert res.exit_code == 0, res.output
    res = cli("export", tmp_path / "r", "--out", out, "--format", "trtllm")
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "engine.json").read_text())
    doc["factors"]["prefill"] = 1e300
    (out / "engine.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match="at every length up to"):
        load_engine_manifest(out)


# ---- sparsify: the model an export belongs to -----------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, module_seed):
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", module_seed, heads=4, kv_heads=2, layers=2)
    return AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager").eval()


def _renamed_export(pristine, tmp_path, model_id):
    run = shutil.copytree(pristine, tmp_path / "other-run")
    for path in (run / "manifest.json", run / "fit" / "fit.json"):
        doc = json.loads(path.read_text())
        doc["model"]["id"] = model_id
        path.write_text(json.dumps(doc))
    poke_meta(run / "fit" / "bsfa_thresholds.safetensors", model=model_id)
    for folder in (run / "samples").iterdir():
        poke_meta(folder / "stats.safetensors", model=model_id)
    out = tmp_path / "other-export"
    res = cli("export", run, "--out", out)
    assert res.exit_code == 0, res.output
    return out


def poke_meta(path, **meta):
    with safe_open(str(path), framework="np") as f:
        old, arrays = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not iterable
    save_file(arrays, str(path), metadata={**old, **meta})


def test_sparsify_refuses_an_export_of_another_checkpoint(pristine, tmp_path, tiny_model):
    from sparsecal.integrations.sparsify import sparsify

    export = _renamed_export(pristine, tmp_path, "/elsewhere/other-llama#config-deadbeef")
    for method, kw in (("blasst", {}), ("bsfa", {"k": 2})):
        with pytest.raises(UserError, match="other-llama#config-deadbeef"):
            sparsify(tiny_model, export, method=method, backend="reference", **kw)
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(export / "thresholds.bsfa.pt", lone)  # a .pt alone still names its model
    with pytest.raises(UserError, match="other-llama#config-deadbeef"):
        sparsify(tiny_model, lone, method="bsfa", k=2, backend="reference")


def test_sparsify_refuses_an_export_of_another_head_dim(export, tiny_model):
    from sparsecal.integrations.sparsify import sparsify

    doc = json.loads((export / "blasst.json").read_text())
    doc["head_dim"] = 128
    (export / "blasst.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match="head_dim 128"):
        sparsify(tiny_model, export, method="blasst", backend="reference")


# ---- symbolic links out of the run --------------------------------------------------------------
def test_symlinked_lock_is_refused_and_not_followed(run, tmp_path):
    outside = tmp_path / "outside-lock"
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(outside)
    assert_user_error(cli("doctor", run), ".lock is a symbolic link")
    assert not outside.exists()


def test_symlinked_fit_dir_is_refused_and_not_written_through(run, tmp_path):
    outside = tmp_path / "outside-fit"
    outside.mkdir()
    shutil.rmtree(run / "fit")
    (run / "fit").symlink_to(outside)
    assert_user_error(cli("fit", run, "--targets", "0.3"), "fit is a symbolic link")
    assert list(outside.iterdir()) == []


def test_symlinked_sample_folder_is_damaged_and_replaced_without_following(run, tmp_path):
    sid = "synthetic-512-0000"
    elsewhere = shutil.move(str(run / "samples" / sid), str(tmp_path / "elsewhere"))
    (run / "samples" / sid).symlink_to(elsewhere)
    store = RunStore.open(run)
    assert "symbolic link" in store.damaged()[sid]
    rec = json.loads((tmp_path / "elsewhere" / "sample.json").read_text())
    from sparsecal.bench.synthetic import synthetic_stats

    stats = synthetic_stats(np.random.default_rng(0), 512, CFG, 2, 4, 300.0, 30.0, 0.5)
    store.write_sample(rec, stats)
    assert not (run / "samples" / sid).is_symlink() and store.check_sample(sid) is None
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["sample.json", "stats.safetensors"]


@pytest.mark.parametrize("table, col, value, says", [
    ("blasst_layers", "layer", -1, "column layer must be finite and >= 0; row 0 holds -1"),
    ("blasst_layers", "target", 1.5, "column target must be in [0, 1]; row 0 holds 1.5"),
    ("bsfa_heads", "measured", float("nan"), "column measured must be in [0, 1]; row 0 holds nan"),
    ("bsfa_heads", "length", 0, "column length must be finite and >= 1; row 0 holds 0"),
])
def test_fit_tables_values_are_checked_when_read(run, tmp_path, table, col, value, says):
    """A fit table's shares, counts and lengths are checked when read (analysis.tables.read_table):
    `export --per-layer` reading a damaged blasst_layers table writes nothing and says which column,
    row and value; NaN `measured` in bsfa_heads (which the dispatch record would have read as a dense
    layer) is refused the same way."""
    import polars as pl

    from sparsecal.analysis.tables import read_table

    path = run / "fit" / f"{table}.parquet"
    df = pl.read_parquet(path)
    df.with_columns(pl.when(pl.int_range(pl.len()) == 0).then(pl.lit(value)).otherwise(pl.col(col))
                    .cast(df[col].dtype if not isinstance(value, float) else pl.Float64).alias(col)).write_parquet(path)
    with pytest.raises(UserError, match=re.escape(f"{table}.parquet: {says}")):
        read_table(run / "fit", table)
    if table == "blasst_layers":
        out = tmp_path / "new-export"
        assert_user_error(cli("export", run, "--out", out, "--per-layer"), f"{table}.parquet", col, "sparsecal fit")
        assert not out.exists()


def _reshape(path, key, shape):
    """Replace array ``key`` of a safetensors file by zeros of ``shape`` (its dtype and metadata kept)."""
    with safe_open(str(path), framework="np") as f:
        meta, arrays = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not iterable
    name = key if key in arrays else f"{key}.val"
    arrays = {k: v for k, v in arrays.items() if not k.startswith(f"{key}.")} if name != key else arrays
    arrays[key] = np.zeros(shape, dtype=arrays.get(name, np.zeros(1, np.float32)).dtype)
    save_file(arrays, str(path), metadata=meta)


@pytest.mark.parametrize("key, tail", [("gap_count", (1, 100)), ("bsfa_threshold", (4, 3)), ("tstar_hist", (1, 7)),
                                       ("rescale_count", (1, 5)), ("rescale_excess", (2,)),
                                       ("shortfall_count", (1, 2, 3))])
def test_trailing_axes_of_the_runs_settings_are_checked(run, key, tail):
    """A sample array whose trailing axes are not the run's settings (gap bins, k values, t* bins,
    rescale bins, shortfall prefixes and bins) is damaged: `fit` leaves it out by name in one warning (before: a broadcast ValueError or an
    IndexError deep in the fit)."""
    from sparsecal.formats.sample_values import trailing_shapes

    store = RunStore.open(run)
    cfg = StatsConfig.from_dict(store.manifest["config"])
    sid = "synthetic-512-0000"
    assert trailing_shapes(cfg, 512)[key] != tail
    _reshape(run / "samples" / sid / "stats.safetensors", key, (2, 4, *tail))
    assert key in (RunStore.open(run).scan()[sid] or "")
    res = cli("fit", run, "--targets", "0.3", "--holdout", "0")
    assert res.exit_code == 0 and sid in res.output and key in res.output, res.output


@pytest.mark.parametrize("edit, says", [
    ({"block_m": 0}, "block sizes must be positive"),
    ({"gap_step": 0.0}, "gap_step and qinit_step must be positive"),
    ({"k_values": [4, 2]}, "k values must be distinct positive integers in ascending order"),
])
def test_a_manifest_config_that_cannot_be_a_captures_is_one_line(run, edit, says):
    """The manifest's capture settings are checked when the run is opened (before: ZeroDivisionError
    or a bare ValueError inside fit): one line naming the setting and `doctor`."""
    path = run / "manifest.json"
    man = json.loads(path.read_text())
    man["config"].update(edit)
    path.write_text(json.dumps(man))
    assert_user_error(cli("fit", run, "--targets", "0.3"), says, "sparsecal doctor")
