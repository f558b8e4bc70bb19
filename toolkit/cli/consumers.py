"""``sparsecal verify``: an export run by its consumer's own code (integrations.consumer_verify)."""
from __future__ import annotations

from pathlib import Path

from sparsecal.formats.errors import UserError

SAMPLE_SETS = ("held-out", "all")


def check_verify_options(engine: str, samples: str, targets: list[float] | None, limit: int | None,
                         device: str) -> None:
    """Every option checked before anything is read or loaded."""
    from sparsecal.capture.models import check_dtype_device
    from sparsecal.integrations.consumer_verify import ENGINES

    if engine not in ENGINES:
        raise UserError(f"--engine {engine}: verify runs {', '.join(ENGINES)} (the consumer that installs here); "
                        "FlashInfer runs on a GPU machine (data/bench/NOTES.md).")
    if samples not in SAMPLE_SETS:
        raise UserError(f"--samples {samples}: pick one of {', '.join(SAMPLE_SETS)}.")
    if targets and not all(0.0 < t < 1.0 for t in targets):
        raise UserError(f"--targets {targets}: each target sparsity must lie in (0, 1).")
    if limit is not None and limit < 1:
        raise UserError("--per-length must be at least 1.")
    check_dtype_device("float32", device)


def verify_command(export: Path, run: Path | None, engine: str, targets: list[float] | None,
                   lengths: list[int] | None, samples: str, limit: int | None, masks: bool, device: str) -> dict:
    from sparsecal.integrations import consumer_verify as V

    check_verify_options(engine, samples, targets, limit, device)
    inp = V.open_inputs(export, run)
    recs = V.choose_samples(inp, samples, lengths, limit)
    law_targets = sorted({p[0] for m in (inp["manifest"].get("law") or {}).values() for p in m["points"]})
    targets = targets or law_targets or [inp["manifest"]["target_sparsity"]]
    print(f"verify {export} with {V._consumer_version()} (HF path, pytorch backend, {device}): {len(recs)} "
          f"sample(s) of {inp['store'].root}, targets {', '.join(f'{t:g}' for t in targets)}"
          f"{', masks applied per target' if masks else ''}")
    from sparsecal.capture.models import load_run_model

    model = load_run_model(inp["store"].manifest, device, attn="eager")  # Model-Optimizer patches F.softmax there
    doc = V.run_verify(inp, recs, targets, masks, model, device)
    path = V.write(export, doc)
    print(V.format_table(doc["rows"]))
    print(f"wrote {path}")
    return doc
