"""Where ``sparsify`` applies the BLASST law against the lengths it was validated on (issue 27,
"laws said right"; docs/design.md "Applying thresholds", Lengths).

blasst.json's ``validity[mode]`` (per target and phase: ``min_length``, ``max_length``, the ends of
the calibrated lengths at which the target was reached) bounds the a/L law. Each attention call of
length L (the prompt in prefill, the cache in decode) is, for that phase's law:

    below         L < min_length: never validated that short; runs dense (as before)
    interpolated  min_length <= L <= max_length: lambda = a / L (the deployed law)
    extrapolated  L > max_length: past the longest validated length; runs dense, exactly what
                  ``dense`` runs there (sparsify.dense_first), skipping nothing and counting nothing
                  skipped, unless the user opts in (``sparsify(..., extrapolate=True)``, ``sparsecal
                  eval --extrapolate``): then lambda = a / L as inside the range, still flagged

After every forward ``model.sparsecal_law`` (the state's ``law`` dict; ``register``'s returned state
holds the same) is ``{"mode": "prefill" | "decode", "length": L, "law": regime}`` for that forward (a
prefill, or one decode step); the regime is None when the method has no length law (dense, BSFA,
window) or the export names no validated lengths (the law is then applied at every length, unchecked).
"""
from __future__ import annotations

from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import LAW_REGIMES, blasst_lambda, blasst_law_regime, blasst_validity

__all__ = ["LAW_REGIMES", "law_max_length", "law_regime", "law_validity", "mode_factor", "note_law", "use_group_law",
           "worst_regime"]


def mode_factor(doc: dict, target: float, mode: str) -> float | None:
    """A target's factor a (lambda = a / L) of one phase from a validated blasst.json; decode: None
    where the export has no decode calibration (decode then runs dense)."""
    try:
        return blasst_lambda(doc, 1, target, mode)
    except UserError:
        if mode == "decode":
            return None
        raise


def law_validity(doc: dict, target: float, modes) -> dict:
    """mode -> the target's ``validity`` entry for the phases in ``modes`` (those with a factor), from
    a validated blasst.json; a phase without validated lengths is left out."""
    out = {m: blasst_validity(doc, m, target) for m in modes}
    return {m: v for m, v in out.items() if v is not None}


def law_regime(state, mode: str, length: int) -> str | None:
    """The regime of one call (module docstring) for ``state``'s method: None without a BLASST law."""
    if state.method != "blasst":
        return None
    return blasst_law_regime(length, state.validity.get(mode))


def note_law(state, mode: str, length: int) -> None:
    """Record this call's regime in ``state.law`` (read after the forward; every layer of a forward
    writes the same)."""
    state.law.update(mode=mode, length=int(length), law=law_regime(state, mode, length))


def law_max_length(state, mode: str) -> int | None:
    """The longest length the runtime applies the law at (formats.exports.blasst_runtime_lambda's
    ``max_length``): the validated max_length, None (no bound) when the user opted in or none is known."""
    if state.extrapolate:
        return None
    v = state.validity.get(mode)
    return None if v is None else int(v["max_length"])


def worst_regime(regimes) -> str | None:
    """One flag for several calls (a generation's decode steps): "extrapolated" if any call was, else
    "below" if any was, else "interpolated" if any was, else None: a flag never hides extrapolation."""
    seen = set(regimes)
    return next((r for r in ("extrapolated", "below", "interpolated") if r in seen), None)


def use_group_law(state, decision: str) -> None:
    """``decode_decision="group"`` on BLASST: the export's group law (blasst.json ``decode_group``, the
    factor and validated lengths fitted on the capture's group gap histograms: analysis/blasst_group.py)
    replaces the per-head decode law, so the group decision reaches the target sparsity. Without one
    (an export of a run captured before the statistic) the per-head law stays, under which the group
    skips less than the target, and that is said once on stderr."""
    if decision != "group" or state.method != "blasst" or state.vfa or state.factors.get("decode") is None:
        return
    law = state.group_law
    if law is None:
        import sys

        print("note: this export has no decode law for the group decision (blasst.json decode_group); the group "
              "decision follows the per-head law and skips less than its target: capture and fit again to "
              "calibrate it.", file=sys.stderr)
        return
    state.factors["decode"] = float(law["threshold_scale_factor"])
    state.layer_factors.pop("decode", None)  # per-layer factors are the per-head law's
    state.min_lengths["decode"] = int(law["validity"]["min_length"])
    state.validity["decode"] = law["validity"]
