"""``sparsecal export --format``: the files serving engines read (Model-Optimizer's config.json
block, TensorRT-LLM's YAML, SGLang's environment, vLLM's flags), their sidecar engine.json and the
Model-Optimizer block patched into a checkpoint. Formats in sparsecal.formats.engine_files; tiles
and sources in sparsecal.formats.engines and docs/formats.md.
"""
from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path

import numpy as np

from sparsecal.analysis.engine_law import fit_exp_law, simulate
from sparsecal.formats import engine_files as F
from sparsecal.formats.engines import FORMATS, SCALED_SCORES, check_format_geometry
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import blasst_dense_below
from sparsecal.formats.files import atomic_write_text
from sparsecal.formats.version import SCHEMA_VERSION, __version__

WRITERS = {"trtllm": F.trtllm_text, "sglang": F.sglang_text, "vllm": F.vllm_text}
ENGINE_NAMES = {"trtllm": "TensorRT-LLM (LLM API: --config / extra_llm_api_options)",
                "sglang": "SGLang (environment of `python -m sglang.launch_server --attention-backend trtllm_mha`)",
                "vllm": "vLLM (`vllm serve MODEL $(grep -v '^#' vllm.args)`; flags of vllm-project/vllm PR 42989)"}


def attention_modules(model: dict, config=None) -> tuple[list[str], dict[int, str]]:
    """(attention class names, {layer: module name}) in transformers' naming. With a config, the
    model is built on the meta device (no weights, offline) and its modules listed; without one,
    the architecture's naming convention (LlamaForCausalLM -> LlamaAttention, model.layers.{i}.self_attn)."""
    if config is not None:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(config)
        found = {int(m.layer_idx): (n, type(m).__name__) for n, m in net.named_modules()
                 if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")}
        if found:
            return sorted({c for _, c in found.values()}), {i: n for i, (n, _) in sorted(found.items())}
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model.get("model_type"), "")
    cls = arch.replace("ForCausalLM", "Attention") if arch.endswith("ForCausalLM") else "Attention"
    return [cls], {i: f"model.layers.{i}.self_attn" for i in range(model["num_layers"])}


def checkpoint_config(checkpoint):
    """The transformers config of a local checkpoint directory (offline), or None if it does not load."""
    from transformers import AutoConfig

    path = Path(checkpoint)
    try:
        return AutoConfig.from_pretrained(str(path if path.is_dir() else path.parent))
    except (OSError, ValueError, KeyError):
        return None


def formats_tiles(formats: list, root: Path, cfg: dict, model: dict) -> dict:
    """{format: Tiles}, refusing a format whose engine decides on other tiles than the run's."""
    return {f: check_format_geometry(f, str(root), cfg["block_m"], cfg["block_n"], model.get("head_dim"))
            for f in formats}


def laws(doc: dict, need: bool) -> dict:
    """{mode: ExpLaw} of factor = a exp(b S) across the fitted targets; {} when fewer than two
    targets were fitted and the law is not ``need``ed (the modelopt format needs it)."""
    out = {}
    for mode in F.PHASES:
        pts = [(e["target_sparsity"], e["threshold_scale_factor"].get(mode)) for e in doc["targets"]]
        pts = [(t, f) for t, f in pts if f is not None]
        if not pts:
            continue
        if len(pts) < 2 and not need:
            return {}
        out[mode] = fit_exp_law(*zip(*pts))
    return out


def validity(doc: dict) -> dict:
    """engine.json ``validity``: per phase the exported target's validated lengths, min/max_length and
    dense_below (max(min_length, ceil(factor)): below it the rule extrapolates, and below ceil(factor)
    factor / kv_len > 1 skips every candidate tile)."""
    return {m: dict(v, dense_below=blasst_dense_below(doc["threshold_scale_factor"][m], v["min_length"]))
            for m, v in (doc.get("validity") or {}).items()}


def _lengths_note(doc: dict) -> str:
    parts = [f"{m} {v['min_length']}-{v['max_length']} tokens (below {v['dense_below']}: serve dense)"
             for m, v in validity(doc).items()]
    return ("Validated lengths: " + "; ".join(parts) + ". Engines apply factor / kv_len at every length; below "
            "ceil(factor) lambda > 1 skips every candidate tile." if parts else "")


def _header(tiles, ctx: dict, note: str) -> list[str]:
    lines = [(f"sparsecal {__version__}: BLASST skip-softmax for {ctx['model']['id']} (run {ctx['run']['name']}), "
              f"target sparsity {ctx['target']:g}; lambda = threshold_scale_factor / kv_len."),
             (f"Calibrated on {tiles.block_m} x {tiles.block_n} tiles = {tiles.engine}: {tiles.kernel}; log base "
              f"{tiles.log_base}; scores: {tiles.score_scale}."), note, ctx.get("lengths_note", ""),
             "Model, tiles, the exp law, ignored layers and the simulated sparsity: engine.json and report.txt here."]
    return [x for x in lines if x]


def build(formats: list, tiles: dict, doc: dict, ctx: dict) -> dict:
    """Every requested format's text (or block), factors and simulation rows. ``ctx``: model, run,
    target, config, sparse mask [L'] (bool), ignored {layer: reason}, module names, classes, held hists,
    edges, validation. Returns {"files": {name: text}, "block", "formats": {...}, "laws", "rows"}."""
    law = laws(doc, need="modelopt" in formats)
    ctx = dict(ctx, validity=validity(doc), lengths_note=_lengths_note(doc))
    scalar = {m: doc["threshold_scale_factor"].get(m) for m in F.PHASES}
    targets = {m: ctx["target"] for m in F.PHASES}
    out = {"files": {}, "block": None, "formats": {}, "laws": {m: v.to_dict() for m, v in law.items()}, "rows": []}
    scalar_fmts = [f for f in formats if f != "modelopt"]
    if scalar_fmts and ctx["held"] is not None:
        out["rows"] += simulate(ctx["held"], ctx["edges"], scalar, targets, np.ones_like(ctx["sparse"]),
                                f"{'/'.join(scalar_fmts)}: factor, every layer")
    for fmt in scalar_fmts:
        dense = (f"sparsecal would leave {len(ctx['ignored'])} layer(s) dense (report.txt)" if ctx["ignored"]
                 else "no layer is left dense")
        note = (f"This file applies the factor to every layer: {dense}." if fmt != "trtllm" else
                f"This file applies the factor to every layer ({dense}); TensorRT-LLM leaves the layers of the "
                "config.json block's `ignore` dense when the checkpoint carries it (`--patch-config`).")
        name = FORMATS[fmt][1]
        out["files"][name] = WRITERS[fmt](scalar, _header(tiles[fmt], ctx, f"{ENGINE_NAMES[fmt]}. {note}"))
        out["formats"][fmt] = {"file": name, "tiles": tiles[fmt].geometry(), "factors": scalar,
                               "source": tiles[fmt].source}
    if "modelopt" in formats:
        factors = {m: law[m].predict(ctx["target"]) if m in law else None for m in F.PHASES}
        if ctx["held"] is not None:
            out["rows"] += simulate(ctx["held"], ctx["edges"], factors, targets, ctx["sparse"],
                                    "modelopt: a*exp(b*S), ignore honored")
        out["block"] = modelopt_block(law, tiles["modelopt"], ctx)
        out["files"][FORMATS["modelopt"][1]] = F.json_text({"sparse_attention_config": out["block"]})
        out["formats"]["modelopt"] = {"file": FORMATS["modelopt"][1], "tiles": tiles["modelopt"].geometry(),
                                      "factors": factors, "source": tiles["modelopt"].source}
    return out


def modelopt_block(law: dict, tiles, ctx: dict) -> dict:
    """Model-Optimizer's block, its producer's calibration carrying the identity loaders check."""
    model = ctx["model"]
    ident = {k: model.get(k) for k in ("id", "model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                       "vocab_size", "layer_types") if model.get(k) is not None}
    cal = {"kind": F.ENGINE_KIND, "schema_version": SCHEMA_VERSION, "model": ident, "run": ctx["run"],
           "geometry": tiles.geometry(), "law": {m: v.to_dict() for m, v in law.items()},
           "validity": ctx.get("validity", {}),
           "ignored_layers": {str(k): v for k, v in sorted(ctx["ignored"].items())}}
    ignore = [ctx["names"][i] for i in sorted(ctx["ignored"]) if i in ctx["names"]]
    return F.modelopt_block({m: {"a": v.a, "b": v.b} for m, v in law.items()}, ctx["target"], ctx["classes"],
                            ignore, cal)


def manifest(built: dict, doc: dict, ctx: dict) -> dict:
    """engine.json: the identity every engine-file loader checks, and what the export found."""
    cfg = ctx["config"]
    return {"kind": F.ENGINE_KIND, "schema_version": SCHEMA_VERSION, "sparsecal": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "run": ctx["run"],
            "model": ctx["model"], "validation": ctx["validation"], "lengths": doc["lengths"],
            "geometry": {"block_m": cfg["block_m"], "block_n": cfg["block_n"], "decode_block_m": 1,
                         "decode_block_n": cfg["block_n"], "scan_order": doc["scan_order"], "log_base": "e",
                         "score_scale": SCALED_SCORES},
            "target_sparsity": ctx["target"],
            "factors": {m: doc["threshold_scale_factor"].get(m) for m in F.PHASES},
            "law": built["laws"] or None, "formats": built["formats"], "validity": validity(doc),
            "length_policy": doc.get("length_policy"),
            "sparse_layers": ctx["sparse_layers"],
            "ignored_layers": {str(k): v for k, v in sorted(ctx["ignored"].items())},
            "simulation": built["rows"]}


def write(out: Path, built: dict, man: dict) -> list[str]:
    """The engine files, then engine.json (every write atomic). Returns the names written."""
    for name, text in built["files"].items():
        atomic_write_text(Path(out) / name, text)
    F.write_json(Path(out) / F.ENGINE_JSON, man)
    return sorted(built["files"]) + [F.ENGINE_JSON]


def check_factors_finite(built: dict) -> None:
    """A law that extrapolates to inf or 0 would write an unusable file: refuse it in one line."""
    for fmt, entry in built["formats"].items():
        for m, f in entry["factors"].items():
            if f is not None and (not math.isfinite(f) or f <= 0):
                raise UserError(f"--format {fmt}: the {m} factor came out {f!r}; fit targets closer to the exported "
                                "one with `sparsecal fit RUN --targets ...`.")
