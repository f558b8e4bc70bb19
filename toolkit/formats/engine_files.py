"""The files serving engines read, written by ``sparsecal export --format`` and read back with checks.

    EXPORT/
      modelopt.config.json   {"sparse_attention_config": {...}}: Model-Optimizer's config.json block
                             (a * exp(b * target_sparsity) per phase, targets, ignore, producer)
      trtllm.yaml            TensorRT-LLM LLM API options: sparse_attention_config with scalar factors, or
                             target_sparsity when the checkpoint carries the block (--patch-config)
      sglang.env             SGLANG_SKIP_SOFTMAX_{PREFILL,DECODE}_THRESHOLD_SCALE_FACTOR=...
      vllm.serve             the command serving the patched checkpoint with Model-Optimizer's vLLM launcher
                             (vLLM reads skip-softmax only through that plugin, from the config.json block)
      engine.json            what they were calibrated on (kind sparsecal-engine-export): model, tiles, log
                             base, score scale, factors, the exp law, ignored layers, the simulation
      report.txt             the simulated-sparsity table and the ignored layers, as printed

The engine files hold only what their engine parses (plus comments); ``engine.json`` beside them
carries the identity every loader checks (schema, model, geometry). The Model-Optimizer block
carries the same identity inside ``producer.calibration``, so it is also checked once it is
patched into a checkpoint's config.json (``patch_config``). Formats: docs/formats.md.
"""
from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import (
    LONGEST_LENGTH,
    blasst_runtime_lambda,
    check_factor_range,
    check_geometry,
    check_validity,
    longest_length,
)
from sparsecal.formats.files import atomic_write_text, check_schema, read_json_manifest
from sparsecal.formats.json_values import finite_number, first_non_finite
from sparsecal.formats.version import __version__

ENGINE_JSON = "engine.json"
ENGINE_KIND = "sparsecal-engine-export"
REPORT = "report.txt"
FORMULA = "a * exp(b * target_sparsity)"
PHASES = ("prefill", "decode")
SGLANG_VARS = {m: f"SGLANG_SKIP_SOFTMAX_{m.upper()}_THRESHOLD_SCALE_FACTOR" for m in PHASES}
VLLM_LAUNCHER = "vllm_serve_sparse_attn.py"   # NVIDIA/Model-Optimizer examples/vllm_serve/
VLLM_LEGACY = "vllm.args"
BACKUP_SUFFIX = ".sparsecal-backup"
REMEDY = "export it again with `sparsecal export RUN --out DIR --format ...`"


# ---- writing ---------------------------------------------------------------------------------------
def modelopt_block(laws: dict, target: float, classes: list, ignore: list, calibration: dict) -> dict:
    """Model-Optimizer's ``sparse_attention_config``: one skip_softmax group with the per-phase
    a, b of factor = a * exp(b * target_sparsity); ``calibration`` goes into ``producer``."""
    tsf = {"formula": FORMULA}
    tsf.update({m: {"a": laws[m]["a"], "b": laws[m]["b"]} for m in PHASES if laws.get(m)})
    group = {"algorithm": "skip_softmax", "targets": list(classes)}
    if ignore:
        group["ignore"] = list(ignore)
    group["threshold_scale_factor"] = tsf
    group["target_sparsity"] = {m: target for m in PHASES if laws.get(m)}
    return {"config_groups": {"group_0": group},
            "producer": {"name": "sparsecal", "version": __version__, "calibration": calibration}}


def _comments(header: list[str]) -> list[str]:
    return [f"# {line}".rstrip() for line in header]


def trtllm_text(factors: dict, header: list[str]) -> str:
    """The YAML TensorRT-LLM's LLM API takes (``--config`` / extra_llm_api_options)."""
    lines = _comments(header) + ["sparse_attention_config:", "  algorithm: skip_softmax", "  threshold_scale_factor:"]
    lines += [f"    {m}: {factors[m]!r}" for m in PHASES if factors.get(m) is not None]
    return "\n".join(lines) + "\n"


def sglang_text(factors: dict, header: list[str]) -> str:
    """Environment lines SGLang reads (trtllm_mha backend)."""
    body = [f"{SGLANG_VARS[m]}={factors[m]!r}" for m in PHASES if factors.get(m) is not None]
    return "\n".join(_comments(header) + body) + "\n"


def trtllm_target_text(targets: dict, header: list[str]) -> str:
    """TensorRT-LLM's YAML in its target_sparsity form (the formula and ``ignore`` come from the
    checkpoint's config.json block)."""
    lines = _comments(header) + ["sparse_attention_config:", "  algorithm: skip_softmax", "  target_sparsity:"]
    lines += [f"    {m}: {targets[m]!r}" for m in PHASES if targets.get(m) is not None]
    return "\n".join(lines) + "\n"


def vllm_text(checkpoint, header: list[str]) -> str:
    """The shell command serving ``checkpoint`` (its config.json carrying the block) with
    Model-Optimizer's vLLM launcher, and how to get there, as comments."""
    how = [("How: 1. the checkpoint's config.json carries the block (`sparsecal export RUN --out DIR --patch-config "
            "CHECKPOINT`, or merge modelopt.config.json's sparse_attention_config into it);"),
           (f"2. run NVIDIA/Model-Optimizer examples/vllm_serve/{VLLM_LAUNCHER} (its SparseAttnWorker calls "
            "install_vllm_sparse_attention_from_checkpoint once the model is loaded); --enforce-eager: calibrated"),
           "decode skipping needs a non-FULL decode CUDA graph mode. Any other vllm serve flag may follow."]
    command = f"python {VLLM_LAUNCHER} {shlex.quote(str(checkpoint))} --enforce-eager"
    return "\n".join(_comments(header + how) + [command]) + "\n"


def json_text(doc: dict) -> str:
    """JSON as every engine export writes it (no NaN, indented, newline-terminated)."""
    return json.dumps(doc, indent=1, allow_nan=False) + "\n"


def write_json(path: Path, doc: dict) -> None:
    atomic_write_text(path, json_text(doc))


# ---- the sidecar ------------------------------------------------------------------------------------
def _check_layers(path, doc: dict, num_layers: int) -> None:
    ign, sparse = doc.get("ignored_layers", {}), doc.get("sparse_layers", [])
    ok = (isinstance(ign, dict) and all(isinstance(v, str) and k.isdigit() and int(k) < num_layers for k, v in ign.items())
          and isinstance(sparse, list) and all(isinstance(i, int) and 0 <= i < num_layers for i in sparse))
    if not ok:
        raise UserError(f"{path}: ignored_layers must map layer indices below {num_layers} to reasons and "
                        f"sparse_layers list layer indices; {REMEDY}.")
    if set(map(int, ign)) & set(sparse):
        raise UserError(f"{path}: a layer is both sparse and ignored; {REMEDY}.")


def _check_factors(path, factors, where: str, longest: int = LONGEST_LENGTH) -> None:
    if not isinstance(factors, dict) or not set(factors) <= set(PHASES) or not any(f is not None for f in factors.values()):
        raise UserError(f"{path}: {where} must hold a prefill and/or decode factor; {REMEDY}.")
    for m, f in factors.items():
        if f is not None and (not finite_number(f) or f <= 0):
            raise UserError(f"{path}: {where}.{m} is {f!r}, not a finite positive number (lambda = factor / "
                            f"kv_len); {REMEDY}.")
        if f is not None:
            check_factor_range(path, f"{where}.{m}", f, longest)


def _identity(path, doc: dict, expect: dict | None) -> None:
    """Model and geometry of a sidecar (or of a modelopt block's calibration), against ``expect``."""
    model, geo = doc.get("model"), doc.get("geometry")
    if not isinstance(model, dict) or not isinstance(model.get("id"), str) or not isinstance(geo, dict):
        raise UserError(f"{path} lacks the model or geometry it was calibrated for; {REMEDY}.")
    for key in ("block_m", "block_n"):
        if not isinstance(geo.get(key), int) or isinstance(geo.get(key), bool) or geo[key] < 1:
            raise UserError(f"{path}: geometry.{key} is {geo.get(key)!r}, not a positive integer; {REMEDY}.")
    for key in ("num_layers", "num_heads"):
        n = model.get(key)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise UserError(f"{path}: model.{key} is {n!r}, not a positive integer; {REMEDY}.")
    bad = first_non_finite(doc)
    if bad:
        raise UserError(f"{path}: {bad[0]} is {bad[1]}; every number of a sparsecal export is finite: {REMEDY}.")
    for key in ("log_base", "score_scale"):
        if not isinstance(geo.get(key), str):
            raise UserError(f"{path}: geometry.{key} is missing; every engine export records it: {REMEDY}.")
    check_geometry(path, {"model": model["id"], "num_layers": model.get("num_layers"),
                          "num_heads": model.get("num_heads"), "block_m": geo["block_m"],
                          "block_n": geo["block_n"]}, expect)


def load_engine_manifest(path, expect: dict | None = None) -> dict:
    """engine.json (a directory or the file), checked: kind, schema, model, geometry, factors,
    layers, formats; then against ``expect`` (model, num_layers, num_heads, block_m, block_n)."""
    path = Path(path)
    if path.is_dir():
        path = path / ENGINE_JSON
    if not path.is_file():
        raise UserError(f"{path} does not exist; {REMEDY}.")
    doc = read_json_manifest(path, ENGINE_KIND, REMEDY)
    _identity(path, doc, expect)
    t = doc.get("target_sparsity")
    if not finite_number(t) or not 0.0 < t < 1.0:
        raise UserError(f"{path}: target_sparsity is {t!r}, not a number in (0, 1); {REMEDY}.")
    longest = longest_length(doc)
    _check_factors(path, doc.get("factors"), "factors", longest)
    if not isinstance(doc.get("formats"), dict):
        raise UserError(f"{path}: formats is not an object; {REMEDY}.")
    for fmt, entry in doc["formats"].items():
        _check_factors(path, (entry or {}).get("factors"), f"formats.{fmt}.factors", longest)
    _check_layers(path, doc, int(doc["model"].get("num_layers") or 0))
    check_validity(path, doc.get("validity"), "engine.json")
    return doc


def engine_lambda(man: dict, phase: str, kv_len: int, fmt: str | None = None) -> float | None:
    """What a serving-side reader should use at ``kv_len`` under sparsecal's runtime policy, from a
    checked engine.json: lambda = factor / kv_len (the format's factor, else ``factors``), or None
    (serve dense) below the phase's validity min_length or where the lambda would exceed 1.
    Exports written before ``validity`` existed give no length guard (only the lambda > 1 one)."""
    factors = man["formats"][fmt]["factors"] if fmt else man["factors"]
    v = (man.get("validity") or {}).get(phase)
    return blasst_runtime_lambda(factors.get(phase), kv_len, v["min_length"] if v else None)


def _sidecar(path: Path, fmt: str, expect: dict | None) -> dict:
    man = load_engine_manifest(path.parent, expect)
    if fmt not in man["formats"]:
        raise UserError(f"{path.parent / ENGINE_JSON} does not describe a {fmt} export; {REMEDY}.")
    return man


def _same(path, fmt: str, got: dict, man: dict) -> None:
    want = {m: f for m, f in man["formats"][fmt]["factors"].items() if f is not None}
    if set(got) != set(want) or any(abs(got[m] - want[m]) > 1e-9 * abs(want[m]) for m in want):
        raise UserError(f"{path} holds factors {got} but {ENGINE_JSON} beside it says {want}: the file was edited "
                        f"or belongs to another export; {REMEDY}.")


def _resolve(path, fmt: str, name: str) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise UserError(f"{path} does not exist; write it with `sparsecal export RUN --out DIR --format {fmt}`.")
    return path


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a text file; {REMEDY}.") from None


# ---- the engine files ---------------------------------------------------------------------------------
def load_trtllm(path, expect: dict | None = None) -> dict:
    """trtllm.yaml: ``sparse_attention_config`` with algorithm skip_softmax and either positive
    factors equal to those its engine.json records, or (the form for a patched checkpoint) per-phase
    target_sparsity equal to engine.json's. Returns {"factors", "manifest", "config", "form"}."""
    import yaml

    path = _resolve(path, "trtllm", "trtllm.yaml")
    try:
        doc = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML ({type(e).__name__}); {REMEDY}.") from None
    cfg = doc.get("sparse_attention_config") if isinstance(doc, dict) else None
    if not isinstance(cfg, dict) or cfg.get("algorithm") != "skip_softmax":
        raise UserError(f"{path} holds no sparse_attention_config with algorithm skip_softmax; {REMEDY}.")
    man = _sidecar(path, "trtllm", expect)
    entry = man["formats"]["trtllm"]
    if "target_sparsity" in cfg and "threshold_scale_factor" not in cfg:
        tgt = cfg["target_sparsity"]
        tgt = {m: tgt for m in PHASES} if finite_number(tgt) else tgt
        if not isinstance(tgt, dict) or tgt != entry.get("target_sparsity"):
            raise UserError(f"{path} holds target_sparsity {tgt} but {ENGINE_JSON} beside it says "
                            f"{entry.get('target_sparsity')}: the file was edited or belongs to another export; "
                            f"{REMEDY}.")
        return {"factors": {m: f for m, f in entry["factors"].items() if f is not None}, "manifest": man,
                "config": cfg, "form": "target_sparsity"}
    tsf = cfg.get("threshold_scale_factor")
    factors = {m: tsf for m in PHASES} if finite_number(tsf) else tsf
    _check_factors(path, factors, "sparse_attention_config.threshold_scale_factor")
    _same(path, "trtllm", factors, man)
    return {"factors": factors, "manifest": man, "config": cfg, "form": "factor"}


def _assignments(path: Path, allowed: dict, sep: str | None) -> dict:
    """{phase: factor} from lines ``NAME<sep>VALUE`` (comments and blank lines skipped)."""
    names = {v: m for m, v in allowed.items()}
    out = {}
    for no, line in enumerate(_read_text(path).splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split("=", 1) if sep == "=" else shlex.split(line)
        if len(parts) != 2 or parts[0].strip() not in names:
            raise UserError(f"{path}:{no}: {line[:60]!r} is not one of {', '.join(allowed.values())} with a value; "
                            f"{REMEDY}.")
        try:
            out[names[parts[0].strip()]] = float(parts[1])
        except ValueError:
            raise UserError(f"{path}:{no}: {parts[1].strip()!r} is not a number; {REMEDY}.") from None
    return out


def load_sglang(path, expect: dict | None = None) -> dict:
    """sglang.env: the two SGLang variables (at least one), each a positive number equal to engine.json's."""
    path = _resolve(path, "sglang", "sglang.env")
    factors = _assignments(path, SGLANG_VARS, "=")
    _check_factors(path, factors, "the SGLANG_SKIP_SOFTMAX_* variables")
    man = _sidecar(path, "sglang", expect)
    _same(path, "sglang", factors, man)
    return {"factors": factors, "manifest": man, "env": {SGLANG_VARS[m]: repr(f) for m, f in factors.items()}}


def load_vllm(path, expect: dict | None = None) -> dict:
    """vllm.serve: one command running Model-Optimizer's vLLM launcher on a checkpoint, the
    modelopt.config.json block beside it (checked as ``load_modelopt``) with the factors engine.json
    records, and, where the named checkpoint is here, its config.json carrying that same block.
    An export's vllm.args (an older sparsecal: flags no released vLLM reads) is refused in one line.
    Returns {"factors", "manifest", "command", "checkpoint", "block"}."""
    given = Path(path)
    if given.is_dir() and not (given / "vllm.serve").is_file() and (given / VLLM_LEGACY).is_file():
        raise UserError(f"{given / VLLM_LEGACY} was written by an older sparsecal: it names vLLM flags no released "
                        "vLLM reads (vLLM runs skip-softmax through Model-Optimizer's plugin); export again with "
                        "`sparsecal export RUN --out DIR --format vllm --patch-config CHECKPOINT`.")
    path = _resolve(given, "vllm", "vllm.serve")
    lines = [ln.strip() for ln in _read_text(path).splitlines() if ln.strip() and not ln.strip().startswith("#")]
    words = shlex.split(lines[0]) if len(lines) == 1 else []
    if len(words) < 3 or Path(words[1]).name != VLLM_LAUNCHER or "--enforce-eager" not in words:
        raise UserError(f"{path} must hold one command `python {VLLM_LAUNCHER} CHECKPOINT --enforce-eager ...`; "
                        f"{REMEDY}.")
    man = _sidecar(path, "vllm", expect)
    block = load_modelopt(path.parent / man["formats"]["vllm"].get("block_file", "modelopt.config.json"), expect)
    _same(path.parent / "modelopt.config.json", "vllm", block["factors"], man)
    config = Path(words[2]) / "config.json"
    if config.is_file():
        have = load_modelopt(config, expect)
        if have["block"] != block["block"]:
            raise UserError(f"{config} carries another sparse_attention_config than "
                            f"{path.parent}/modelopt.config.json; patch it again with `sparsecal export RUN --out DIR "
                            "--patch-config CHECKPOINT`.")
    return {"factors": block["factors"], "manifest": man, "command": words, "checkpoint": words[2],
            "block": block["block"]}


def _skip_group(path, block) -> dict:
    """The skip_softmax group of a sparse_attention_config, checked."""
    groups = block.get("config_groups") if isinstance(block, dict) else None
    found = [g for g in (groups or {}).values() if isinstance(g, dict) and g.get("algorithm") == "skip_softmax"]
    if len(found) != 1:
        raise UserError(f"{path}: sparse_attention_config needs exactly one config group with algorithm "
                        f"skip_softmax (found {len(found)}); {REMEDY}.")
    g = found[0]
    tsf, tgt = g.get("threshold_scale_factor"), g.get("target_sparsity")
    if not isinstance(tsf, dict) or tsf.get("formula") != FORMULA or not isinstance(tgt, dict):
        raise UserError(f"{path}: the skip_softmax group needs threshold_scale_factor with formula {FORMULA!r} and "
                        f"target_sparsity per phase; {REMEDY}.")
    for m, law in tsf.items():
        if m == "formula":
            continue
        if m not in PHASES or not isinstance(law, dict) or not finite_number(law.get("a")) or law["a"] <= 0 or \
                not finite_number(law.get("b")):
            raise UserError(f"{path}: threshold_scale_factor.{m} must be {{'a': positive, 'b': number}}; {REMEDY}.")
    if not set(tgt) <= set(tsf) - {"formula"} or not all(finite_number(s) and 0 <= s <= 1 for s in tgt.values()):
        raise UserError(f"{path}: target_sparsity must give a value in [0, 1] for a calibrated phase; {REMEDY}.")
    if not isinstance(g.get("targets"), list) or not isinstance(g.get("ignore", []), list):
        raise UserError(f"{path}: targets and ignore must be lists of module names; {REMEDY}.")
    return g


def load_modelopt(path, expect: dict | None = None) -> dict:
    """modelopt.config.json, or a checkpoint's config.json patched with it: the block, its
    producer's calibration (schema, model, geometry, checked against ``expect``) and, in a full
    config, that the config is of the calibrated model. Returns {"block", "group", "calibration",
    "factors"} with factors = a * exp(b * target) per phase."""
    path = _resolve(path, "modelopt", "modelopt.config.json")
    try:
        doc = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg}); {REMEDY}.") from None
    block = doc.get("sparse_attention_config") if isinstance(doc, dict) else None
    if not isinstance(block, dict):
        raise UserError(f"{path} has no sparse_attention_config; {REMEDY}, or patch a config with --patch-config.")
    group = _skip_group(path, block)
    cal = (block.get("producer") or {}).get("calibration")
    if not isinstance(cal, dict) or cal.get("kind") != ENGINE_KIND:
        raise UserError(f"{path}: the sparse_attention_config was not written by sparsecal (no producer.calibration);"
                        " its tiles and model cannot be checked.")
    check_schema(path, cal.get("schema_version"), REMEDY)
    _identity(path, cal, expect)
    if any(k in doc for k in ("num_hidden_layers", "text_config")):
        check_config_model(path, doc, cal["model"])
    factors = _modelopt_factors(path, group)
    if path.name == "modelopt.config.json" and (path.parent / ENGINE_JSON).is_file():
        man = load_engine_manifest(path.parent, expect)
        if "modelopt" in man["formats"]:
            _same(path, "modelopt", factors, man)
    return {"block": block, "group": group, "calibration": cal, "factors": factors}


def _modelopt_factors(path: Path, group: dict) -> dict:
    """Model-Optimizer's factor a * exp(b * target) per calibrated phase: each finite, positive and
    below LONGEST_LENGTH (lambda = factor / L under 1 at some length), or one line."""
    tsf, factors = group["threshold_scale_factor"], {}
    for m, target in group["target_sparsity"].items():
        try:
            f = tsf[m]["a"] * math.exp(tsf[m]["b"] * target)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f) or f <= 0:
            raise UserError(f"{path}: the {m} factor a * exp(b * target) is {f:g}, not a finite positive number; "
                            f"{REMEDY}.")
        check_factor_range(path, f"the {m} factor a * exp(b * target)", f, LONGEST_LENGTH)
        factors[m] = f
    return factors


LOADERS = {"modelopt": load_modelopt, "trtllm": load_trtllm, "sglang": load_sglang, "vllm": load_vllm}


# ---- patching a checkpoint ------------------------------------------------------------------------------
CONFIG_KEYS = (("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_heads"),
               ("num_key_value_heads", "num_kv_heads"), ("head_dim", "head_dim"), ("vocab_size", "vocab_size"))


def _config_value(cfg: dict, key: str):
    """A text-model key of a config.json (top level, else its text_config); derived head_dim/kv heads."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}

    def get(k):
        return cfg.get(k, text.get(k))

    value = get(key)
    if value is None and key == "head_dim" and get("hidden_size") and get("num_attention_heads"):
        value = get("hidden_size") // get("num_attention_heads")
    if value is None and key == "num_key_value_heads":
        value = get("num_attention_heads")
    return value


def check_config_model(path, cfg: dict, model: dict) -> None:
    """Refuse a config.json of another model than the run's (model_type, layers, heads, KV heads,
    head_dim, vocabulary and, where both record it, the layer types)."""
    if _config_value(cfg, "num_hidden_layers") is None:
        raise UserError(f"{path} is not a decoder model's config (no num_hidden_layers); give the checkpoint "
                        "directory of the calibrated model.")
    types = {cfg.get("model_type"), (cfg.get("text_config") or {}).get("model_type")} - {None}
    diffs = []
    if model.get("model_type") and types and model["model_type"] not in types:
        diffs.append(f"model_type {'/'.join(sorted(types))} (the run's model is {model['model_type']})")
    for ckey, mkey in CONFIG_KEYS:
        have, want = _config_value(cfg, ckey), model.get(mkey)
        if have is not None and want is not None and have != want:
            diffs.append(f"{ckey} {have} (the run's model has {want})")
    have, want = _config_value(cfg, "layer_types"), model.get("layer_types")
    if have is not None and want is not None and list(have) != list(want):
        diffs.append("layer_types")
    if diffs:
        raise UserError(f"{path} is the config of another model than {model.get('id')}: {'; '.join(diffs)}; patch the "
                        "checkpoint the run was captured from.")


def read_config(checkpoint, model: dict) -> tuple[Path, dict, str]:
    """(path, parsed, text) of CHECKPOINT/config.json (or that file), checked to be ``model``'s."""
    path = Path(checkpoint)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(f"--patch-config {checkpoint}: no config.json there; give a Hugging Face checkpoint directory.")
    text = _read_text(path)
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg}); fix or restore the checkpoint's config first.") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path} holds a JSON {type(cfg).__name__}, not a model config.")
    check_config_model(path, cfg, model)
    return path, cfg, text


def patch_config(checkpoint, block: dict, model: dict) -> tuple[Path, Path]:
    """Write ``block`` as ``sparse_attention_config`` into CHECKPOINT/config.json, atomically, after
    checking the config is of ``model``; the original is kept once as config.json.sparsecal-backup
    (an existing backup, the oldest original, is left alone). Returns (config, backup)."""
    path, cfg, text = read_config(checkpoint, model)
    backup = path.with_name(path.name + BACKUP_SUFFIX)
    if not backup.exists():
        atomic_write_text(backup, text)
    cfg["sparse_attention_config"] = block
    atomic_write_text(path, json.dumps(cfg, indent=2) + "\n")
    return path, backup
