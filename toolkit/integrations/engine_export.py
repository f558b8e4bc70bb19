"""``sparsecal export --format``: the files serving engines read (Model-Optimizer's config.json
block, TensorRT-LLM's YAML, SGLang's environment, the command serving the block with
Model-Optimizer's vLLM plugin), their sidecar engine.json and the Model-Optimizer block patched
into a checkpoint. The block's a * exp(b * S) law is fitted with S over the enabled layers, and
with length weights every engine's factor where the traffic is (analysis.engine_fit); served
lengths where lambda >= 1 in integrations.engine_safety. Formats in sparsecal.formats.engine_files;
tiles, consumers and sources in sparsecal.formats.engines and docs/formats.md.
"""
from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path

import numpy as np

from sparsecal.analysis.engine_fit import best_factor, curves, fit_law
from sparsecal.analysis.engine_law import fit_exp_law, simulate
from sparsecal.formats import engine_files as F
from sparsecal.formats.engines import BLOCK_FORMATS, FORMATS, SCALED_SCORES, check_format_geometry, engine_tiles
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import blasst_dense_below
from sparsecal.formats.files import atomic_write_text
from sparsecal.formats.version import SCHEMA_VERSION, __version__

WRITERS = {"trtllm": F.trtllm_text, "sglang": F.sglang_text}
ENGINE_NAMES = {"trtllm": "TensorRT-LLM (LLM API: --config / extra_llm_api_options)",
                "sglang": "SGLang (environment of `python -m sglang.launch_server --attention-backend trtllm_mha`)",
                "vllm": ("vLLM through Model-Optimizer's plugin (nvidia-modelopt >= 0.47, vLLM >= 0.15): it reads the "
                         "checkpoint's config.json block (modelopt.config.json here); no released vLLM takes "
                         "skip-softmax flags")}


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
    """{mode: ExpLaw} of factor = a exp(b S) through the fitted targets' a/L factors (sparsecal's
    every-layer targets); {} when fewer than two targets were fitted and the law is not ``need``ed."""
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
             ("Model, tiles, the exp law, ignored layers, served lengths and the simulated sparsity: engine.json and "
              "report.txt here.")]
    return [x for x in lines if x]


def _uniform(ctx: dict) -> dict:
    lengths = sorted({n for hs in (ctx.get("train") or {}).values() for n in hs}) or [1]
    return {n: 1.0 / len(lengths) for n in lengths}


def block_laws(doc: dict, ctx: dict, weights: dict) -> tuple[dict, str]:
    """({mode: ExpLaw}, definition) of the config.json block: fitted on the run's calibration
    histograms with S the mean over the enabled (sparse) layers, at ``weights`` (analysis.engine_fit);
    without the run's samples, the fitted targets' every-layer a/L factors (``laws``)."""
    if not ctx.get("train"):
        return laws(doc, need=True), "every captured layer (the run's samples are gone: fitted targets' a/L factors)"
    targets = [e["target_sparsity"] for e in doc["targets"]]
    out = {}
    for mode in F.PHASES:
        cur = curves(ctx["train"].get(mode, {}), ctx["edges"], ctx["sparse"], diagonal=True)
        if cur and doc["threshold_scale_factor"].get(mode) is not None:
            out[mode] = fit_law(cur, {n: w for n, w in weights.items() if n in cur}, targets)
    return out, SPARSE_DEFINITION


SPARSE_DEFINITION = ("mean over the enabled (not ignored) layers of each layer's skipped / reachable tiles, as "
                     "Model-Optimizer's calibrator averages the per-call sparsity over its enabled modules; its rule "
                     "can skip diagonal tiles too, counted where the samples record them (diag_gap_count)")


def scalar_factors(doc: dict, ctx: dict) -> dict:
    """The scalar formats' factor per phase: the a/L law's (blasst.json), or with length weights the
    one minimising the weighted sparsity error over every layer (they skip on every layer)."""
    out = {m: doc["threshold_scale_factor"].get(m) for m in F.PHASES}
    if ctx.get("weights") is None or not ctx.get("train"):
        return out
    every = np.ones_like(ctx["sparse"])
    for m in F.PHASES:
        cur = curves(ctx["train"].get(m, {}), ctx["edges"], every)
        if out[m] is not None and cur:
            out[m] = best_factor(cur, {n: w for n, w in ctx["weights"].items() if n in cur}, ctx["target"])
    return out


def _scalar_note(fmt: str, ctx: dict) -> str:
    dense = (f"sparsecal would leave {len(ctx['ignored'])} layer(s) dense (report.txt)" if ctx["ignored"]
             else "no layer is left dense")
    if fmt == "sglang":
        return (f"This file applies the factor to every layer: {dense}. On SM90 and SM120 FlashInfer's decode goes "
                "through XQA, which never receives the decode factor: decode runs dense there (the prefill factor "
                "still applies where SGLang runs trtllm-gen).")
    return (f"This file applies the factor to every layer ({dense}); TensorRT-LLM leaves the layers of the config.json "
            "block's `ignore` dense when the checkpoint carries it (`--patch-config`: then this file takes the "
            "target_sparsity form).")


def build(formats: list, tiles: dict, doc: dict, ctx: dict) -> dict:
    """Every requested format's text (or block), factors and simulation rows. ``ctx``: model, run,
    target, config, sparse mask [L'] (bool), ignored {layer: reason}, module names, classes, held and
    train hists, edges, validation, weights (calibrated {length: w} or None), patched checkpoint (or
    None). Returns {"files": {name: text}, "block", "formats", "laws", "definition", "rows", "scalar_laws"}."""
    ctx = dict(ctx, validity=validity(doc), lengths_note=_lengths_note(doc))
    patched = ctx.get("checkpoint") is not None
    targets = {m: ctx["target"] for m in F.PHASES}
    need_block = any(f in BLOCK_FORMATS for f in formats) or (patched and "trtllm" in formats)
    law, definition = block_laws(doc, ctx, ctx.get("weights") or _uniform(ctx)) if need_block else ({}, None)
    block_factors = {m: law[m].predict(ctx["target"]) if m in law else None for m in F.PHASES}
    scalar = scalar_factors(doc, ctx)
    out = {"files": {}, "block": None, "formats": {}, "laws": {m: v.to_dict() for m, v in law.items()},
           "definition": definition, "rows": [], "patched": patched,
           "scalar_laws": {m: v.to_dict() for m, v in laws(doc, need=False).items()}}
    scalar_fmts = [f for f in formats if f == "sglang" or (f == "trtllm" and not patched)]
    if scalar_fmts and ctx["held"] is not None:
        out["rows"] += simulate(ctx["held"], ctx["edges"], scalar, targets, np.ones_like(ctx["sparse"]),
                                f"{'/'.join(scalar_fmts)}: factor, every layer")
    for fmt in scalar_fmts:
        name = FORMATS[fmt][1]
        note = f"{ENGINE_NAMES[fmt]}. {_scalar_note(fmt, ctx)}"
        out["files"][name] = WRITERS[fmt](scalar, _header(tiles[fmt], ctx, note))
        out["formats"][fmt] = {"file": name, "tiles": tiles[fmt].geometry(), "factors": scalar, "form": "factor",
                               "source": tiles[fmt].source}
    if need_block:
        _block_formats(formats, tiles, ctx, law, block_factors, out)
    out["formats"] = {f: out["formats"][f] for f in FORMATS if f in out["formats"]}
    return out


def _block_formats(formats: list, tiles: dict, ctx: dict, law: dict, factors: dict, out: dict) -> None:
    """The config.json block (always written as modelopt.config.json), and the formats reading it:
    vllm.serve, and trtllm.yaml in its target_sparsity form when the checkpoint is patched."""
    targets = {m: ctx["target"] for m in F.PHASES}
    readers = [f for f in FORMATS if f in formats and (f in BLOCK_FORMATS or (f == "trtllm" and out["patched"]))]
    if ctx["held"] is not None:
        out["rows"] += simulate(ctx["held"], ctx["edges"], factors, targets, ctx["sparse"],
                                f"{'/'.join(readers)}: a*exp(b*S), ignore honored")
    out["block"] = modelopt_block(law, tiles.get("modelopt") or tiles.get("vllm") or engine_tiles("modelopt"),
                                  ctx, out["definition"])
    out["files"][FORMATS["modelopt"][1]] = F.json_text({"sparse_attention_config": out["block"]})
    tgt = {m: ctx["target"] for m in F.PHASES if factors.get(m) is not None}
    for fmt in readers:
        t = tiles[fmt]
        entry = {"file": FORMATS[fmt][1], "tiles": t.geometry(), "factors": factors, "source": t.source,
                 "form": "target_sparsity" if fmt == "trtllm" else "block", "block_file": FORMATS["modelopt"][1]}
        if fmt == "trtllm":
            entry["target_sparsity"] = tgt
            note = (f"{ENGINE_NAMES[fmt]}. target_sparsity form: TensorRT-LLM takes a * exp(b * S) and `ignore` from "
                    f"the patched checkpoint's config.json ({ctx['checkpoint']}).")
            text = F.trtllm_target_text(tgt, _header(t, ctx, note))
        elif fmt == "vllm":
            text = F.vllm_text(ctx.get("checkpoint") or "CHECKPOINT", _header(t, ctx, ENGINE_NAMES[fmt] + "."))
        else:
            continue
        out["files"][FORMATS[fmt][1]] = text
        out["formats"][fmt] = entry
    if "modelopt" in formats:
        out["formats"]["modelopt"] = {"file": FORMATS["modelopt"][1], "tiles": tiles["modelopt"].geometry(),
                                      "factors": factors, "form": "block", "source": tiles["modelopt"].source}


def modelopt_block(law: dict, tiles, ctx: dict, definition: str | None = None) -> dict:
    """Model-Optimizer's block, its producer's calibration carrying the identity loaders check and
    what its target_sparsity means (``target_definition``)."""
    model = ctx["model"]
    ident = {k: model.get(k) for k in ("id", "model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                       "vocab_size", "layer_types") if model.get(k) is not None}
    cal = {"kind": F.ENGINE_KIND, "schema_version": SCHEMA_VERSION, "model": ident, "run": ctx["run"],
           "geometry": tiles.geometry(), "law": {m: v.to_dict() for m, v in law.items()},
           "validity": ctx.get("validity", {}), "target_definition": definition or SPARSE_DEFINITION,
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
            "law": built["laws"] or None, "target_definition": built["definition"], "formats": built["formats"],
            "validity": validity(doc), "safety": built.get("safety"), "traffic": built.get("traffic"),
            "length_policy": doc.get("length_policy"),
            "sparse_layers": ctx["sparse_layers"],
            "ignored_layers": {str(k): v for k, v in sorted(ctx["ignored"].items())},
            "simulation": built["rows"]}


def traffic(built: dict, doc: dict, ctx: dict) -> dict | None:
    """engine.json ``traffic`` (with length weights): per group of formats sharing factors, per phase
    the factor fitted on the weights and the unweighted one (the a/L law's for the scalar files, the
    law fitted with every calibrated length weighing the same for the block), each one's weighted
    RMS sparsity error on the held-out samples and per length what the engine reaches."""
    if ctx.get("weights") is None:
        return None
    out = {"weights": {str(n): w for n, w in sorted(ctx["weights"].items())}, "source": ctx.get("weights_source"),
           "groups": []}
    if ctx["held"] is None:
        return out
    groups: dict = {}
    for fmt, entry in built["formats"].items():
        groups.setdefault(entry["form"] == "factor", []).append(fmt)
    targets = {m: ctx["target"] for m in F.PHASES}
    for scalar, fmts in groups.items():
        if scalar:
            mask, un = np.ones_like(ctx["sparse"]), {m: doc["threshold_scale_factor"].get(m) for m in F.PHASES}
        else:
            law = block_laws(doc, ctx, _uniform(ctx))[0]
            mask, un = ctx["sparse"], {m: law[m].predict(ctx["target"]) if m in law else None for m in F.PHASES}
        got = simulate(ctx["held"], ctx["edges"], built["formats"][fmts[0]]["factors"], targets, mask, "weighted")
        base = simulate(ctx["held"], ctx["edges"], un, targets, mask, "unweighted")
        out["groups"].append({"formats": fmts, "definition": "every layer" if scalar else "enabled layers",
                              "phases": _traffic_phases(got, base, ctx["weights"])})
    return out


def _weighted_rms(rows: dict, weights: dict) -> float:
    """sqrt(sum_L w_L (achieved_L - target)^2 / sum_L w_L) over the rows {length: row} with weight."""
    lens = [n for n in sorted(rows) if weights.get(n, 0) > 0]
    tot = sum(weights[n] for n in lens) or 1.0
    return math.sqrt(sum(weights[n] * (rows[n]["achieved_sparse_layers"] - rows[n]["target"]) ** 2
                         for n in lens) / tot)


def _traffic_phases(got: list, base: list, weights: dict) -> dict:
    out = {}
    for m in F.PHASES:
        g = {r["length"]: r for r in got if r["mode"] == m}
        b = {r["length"]: r for r in base if r["mode"] == m}
        if not g:
            continue
        first = next(iter(g.values()))
        out[m] = {"target": first["target"], "factor": first["factor"],
                  "unweighted_factor": next(iter(b.values()))["factor"], "error": _weighted_rms(g, weights),
                  "unweighted_error": _weighted_rms(b, weights),
                  "per_length": [{"length": n, "weight": weights.get(n, 0.0),
                                  "achieved": g[n]["achieved_sparse_layers"],
                                  "unweighted_achieved": b[n]["achieved_sparse_layers"]} for n in sorted(g)]}
    return out


def traffic_lines(tr: dict | None) -> list[str]:
    """report.txt's "Traffic" section."""
    if not tr:
        return []
    w = ", ".join(f"{n}: {v:.3g}" for n, v in tr["weights"].items())
    lines = [(f"Traffic ({tr['source']}; weight per calibrated length {w}): held-out sparsity over the layers "
              "that skip, the factor fitted on these weights against the unweighted one:")]
    for g in tr["groups"]:
        for m, p in g["phases"].items():
            per = ", ".join(f"{r['length']} {r['achieved']:.3f} ({r['unweighted_achieved']:.3f})"
                            for r in p["per_length"])
            lines.append(f"  {'/'.join(g['formats'])} {m} (target {p['target']:g}, {g['definition']}): factor "
                         f"{p['factor']:.4g} (unweighted {p['unweighted_factor']:.4g}), weighted RMS error "
                         f"{p['error']:.4f} ({p['unweighted_error']:.4f}); per length {per}")
    return lines


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
