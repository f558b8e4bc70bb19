"""What a serving engine does with a BLASST calibration, computed from a run (numpy, torch-free).

- The threshold law that Model-Optimizer writes into a checkpoint's config.json:
  factor(S) = a * exp(b * S), fitted per phase to the (target S, factor a_S) pairs of the run's
  fitted targets (each a_S from the lambda = a_S / L law), by least squares in ln(factor); R^2 is
  taken in ln(factor).
- The engines' rule replayed on the run's own tiles: a tile is skipped iff its gap (the largest
  row max minus the running max over its rows) is below ln(lambda), lambda = factor / L. With the
  run captured at the engine's tile geometry this is the engine's decision tile for tile (up to
  ties), so the achieved sparsity per length is the number the engine will show. Where factor > L,
  ln(lambda) > 0 skips every candidate tile (every gap is <= 0) and is counted so: nothing is clamped.
  sparsecal's own rows can apply the runtime policy instead (dense below the validated lengths).
- Which captured layers skipping does not pay for: at the exported factor a layer skips almost
  none of its tiles at every calibrated length, while every tile still pays for the test.

Shape legend: L' captured layers (the stats arrays' first axis), H query heads, O captured scan
orders, NG gap bins. Counts are summed in float64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sparsecal.analysis.blasst import skipped
from sparsecal.analysis.samples import decode_reachable, load_arrays
from sparsecal.formats.errors import UserError
from sparsecal.formats.exports import blasst_runtime_lambda

MODES = ("prefill", "decode")
PREFIX = {"prefill": "", "decode": "decode_"}
MIN_LAYER_SPARSITY = 0.05  # a layer skipping less than this at every length is left dense


@dataclass(frozen=True)
class ExpLaw:
    """factor(S) = a * exp(b * S) fitted to ``points`` (target, factor)."""

    a: float
    b: float
    r2: float | None          # in ln(factor); None when every factor is the same
    points: tuple             # ((target, factor), ...) the fit used

    def predict(self, target: float) -> float:
        return self.a * math.exp(self.b * target)

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "r2": self.r2, "points": [list(p) for p in self.points]}


def fit_exp_law(targets, factors) -> ExpLaw:
    """Least squares of ln(factor) = ln(a) + b * S over at least two distinct targets."""
    pts = sorted((float(t), float(f)) for t, f in zip(targets, factors) if f is not None)
    if len({t for t, _ in pts}) < 2:
        have = ", ".join(f"{t:g}" for t, _ in pts) or "none"
        raise UserError(f"the a * exp(b * target_sparsity) law needs at least two fitted targets (have {have}); "
                        "fit more with `sparsecal fit RUN --targets 0.3,0.5,0.7`.")
    s = np.array([t for t, _ in pts])
    y = np.log([f for _, f in pts])
    b, ln_a = np.polyfit(s, y, 1)
    res = y - (ln_a + b * s)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((res ** 2).sum()) / ss_tot if ss_tot > 0 else None
    return ExpLaw(float(math.exp(ln_a)), float(b), r2, tuple(pts))


@dataclass
class Hist:
    """One mode's gap histograms of the exported order, summed over samples of one length."""

    count: np.ndarray            # [L', H, NG]
    mass: np.ndarray             # [L', H, NG]
    reach: float = 0.0           # reachable tiles per (layer, head)
    npos: float = 0.0            # query blocks (prefill) or decode rows per (layer, head)
    samples: int = 0
    diag: np.ndarray | None = None   # [L', H, NG] the diagonal tiles' gaps (samples since capture records them)

    def add(self, other: Hist) -> None:
        self.count += other.count
        self.mass += other.mass
        if self.samples == 0 and other.diag is not None:
            self.diag = np.zeros_like(other.diag)
        self.diag = None if self.diag is None or other.diag is None else self.diag + other.diag
        self.reach += other.reach
        self.npos += other.npos
        self.samples += other.samples


@dataclass
class RunHists:
    """The calibration samples summed per (mode, length), and each held-out sample on its own."""

    train: dict = field(default_factory=lambda: {m: {} for m in MODES})   # mode -> length -> Hist
    held: dict = field(default_factory=lambda: {m: [] for m in MODES})    # mode -> [(length, Hist)]


KEYS = ("gap_count", "gap_mass", "decode_gap_count", "decode_gap_mass", "reachable")
DIAG_KEYS = ("diag_gap_count", "decode_diag_gap_count")


def _sample_hists(arrays: dict, length: int, cfg, o: int) -> dict:
    """{mode: Hist} of one sample; decode is absent when the run has no decode rows."""
    out = {}
    for mode in MODES:
        c = np.asarray(arrays[f"{PREFIX[mode]}gap_count"][:, :, o], np.float64)
        m = np.asarray(arrays[f"{PREFIX[mode]}gap_mass"][:, :, o], np.float64)
        if mode == "prefill":
            reach, npos = float(arrays["reachable"].sum()), float(len(arrays["reachable"]))
        else:
            reach, npos = float(decode_reachable(length, cfg)), float(min(cfg.decode_rows, length))
        d = arrays.get(f"{PREFIX[mode]}diag_gap_count")
        if reach > 0:
            out[mode] = Hist(c, m, reach, npos, 1, None if d is None else np.asarray(d[:, :, o], np.float64))
    return out


def collect(store, fit: dict, cfg, order: str) -> RunHists:
    """Read the fit's calibration and held-out samples (in-sample validation: the calibration
    samples are also the held-out ones), keeping only the histograms of ``order``."""
    o = list(cfg.orders).index(order)
    by_id = {r["id"]: r for r in store.manifest["samples"]}
    split = fit["split"]
    missing = [sid for sid in split["train"] + split["test"] if sid not in by_id]
    if missing:
        raise UserError(f"{store.root}/fit names sample {missing[0]} that the run does not plan; run `sparsecal fit "
                        f"{store.root}` again.")
    out = RunHists()
    held_ids = split["test"] or split["train"]
    for sid in dict.fromkeys(split["train"] + held_ids):
        rec = by_id[sid]
        hists = _sample_hists(load_arrays(store, rec, KEYS, optional=DIAG_KEYS), rec["length"], cfg, o)
        for mode, h in hists.items():
            if sid in split["train"]:
                acc = out.train[mode].setdefault(rec["length"], Hist(np.zeros_like(h.count), np.zeros_like(h.mass)))
                acc.add(h)
            if sid in held_ids:
                out.held[mode].append((rec["length"], h))
    return out


def layer_sparsity(h: Hist, edges, log_lambda: float) -> np.ndarray:
    """[L'] sparsity of each captured layer (heads pooled) at ln(lambda)."""
    return skipped(h.count.sum(1), edges, log_lambda) / (h.reach * h.count.shape[1])


def unpaid_layers(train: dict, edges, factor: float, target: float, min_sparsity: float) -> dict[int, str]:
    """{position in the captured layers: why it stays dense} for the layers whose prefill sparsity at
    lambda = factor / L stays below ``min_sparsity`` (or a quarter of the target, if that is lower)
    at every calibrated length: every tile pays for the test, almost none is skipped."""
    lengths = sorted(train)
    floor = min(min_sparsity, target / 4)
    if not lengths or floor <= 0:
        return {}
    at = np.stack([layer_sparsity(train[n], edges, math.log(factor / n)) for n in lengths])      # [Nlen, L']
    most = np.stack([layer_sparsity(train[n], edges, 0.0) for n in lengths])                     # lambda = 1
    out = {}
    for pos in np.flatnonzero((at < floor).all(0)):
        out[int(pos)] = (f"skips at most {at[:, pos].max():.3f} of its tiles at the exported factor (below {floor:g}) "
                         f"and at most {most[:, pos].max():.3f} even at lambda = 1, on {', '.join(map(str, lengths))} "
                         f"tokens (target {target:g}): the tile test costs more than it saves")
    return out


def _one(h: Hist, edges, log_lambda: float, sparse: np.ndarray) -> tuple[float, float, float]:
    """(sparsity over every captured layer, over the sparse layers only, retained mass) of one sample:
    ignored layers run dense, so they count as reachable and never skipped."""
    layers, heads = h.count.shape[:2]
    skip = skipped(h.count[sparse].sum((0, 1)), edges, log_lambda)
    lost = skipped(h.mass[sparse].sum((0, 1)), edges, log_lambda)
    all_tiles, sparse_tiles = h.reach * layers * heads, h.reach * int(sparse.sum()) * heads
    return (float(skip / all_tiles), float(skip / sparse_tiles) if sparse_tiles else 0.0,
            float(1.0 - lost / (h.npos * layers * heads)))


def simulate(held: dict, edges, factors: dict, targets: dict, sparse: np.ndarray, label: str,
             min_lengths: dict | None = None) -> list[dict]:
    """Per (mode, length): achieved sparsity of the held-out samples under lambda = factor / L.
    ``factors``/``targets``: {mode: value or None}; ``sparse``: [L'] bool, the layers that skip.
    ``min_lengths`` ({mode: n or None}) applies sparsify's runtime policy (formats.exports.
    blasst_runtime_lambda: dense below n and where lambda > 1; rows say ``dense``); without it the
    rule is applied at every length as engines do (ln(lambda) > 0 skips every candidate tile)."""
    rows = []
    for mode in MODES:
        if factors.get(mode) is None:
            continue
        by_len: dict[int, list] = {}
        for n, h in held[mode]:
            by_len.setdefault(n, []).append(_one(h, edges, _log_lambda(factors[mode], n, min_lengths, mode), sparse))
        for n in sorted(by_len):
            got = np.array(by_len[n])
            x = _log_lambda(factors[mode], n, min_lengths, mode)
            rows.append({"factors": label, "mode": mode, "length": n, "samples": len(got),
                         "factor": factors[mode], "lambda": factors[mode] / n, "target": targets[mode],
                         "dense": x == -math.inf, "saturated": x > 0.0,
                         "achieved": float(got[:, 0].mean()), "achieved_min": float(got[:, 0].min()),
                         "achieved_max": float(got[:, 0].max()), "achieved_sparse_layers": float(got[:, 1].mean()),
                         "retained_mass": float(got[:, 2].mean())})
    return rows


def _log_lambda(factor: float, n: int, min_lengths: dict | None, mode: str) -> float:
    """ln(factor / n), or -inf where the runtime policy runs dense (only with ``min_lengths``)."""
    if min_lengths is None:
        return math.log(factor / n)
    lam = blasst_runtime_lambda(factor, n, min_lengths.get(mode))
    return -math.inf if lam is None else math.log(lam)


def _lambda_cell(r: dict) -> str:
    return f"{r['lambda']:.3g}" + (" dense" if r.get("dense") else " >1" if r.get("saturated") else "")


def format_table(rows: list[dict]) -> str:
    """The simulated-sparsity table as fixed-width text (the export report's and the CLI's)."""
    head = ("factors", "phase", "tokens", "samples", "factor", "lambda", "target", "achieved", "min-max",
            "sparse layers", "mass kept")
    body = [(r["factors"], r["mode"], str(r["length"]), str(r["samples"]), f"{r['factor']:.4g}",
             _lambda_cell(r), f"{r['target']:g}", f"{r['achieved']:.3f}",
             f"{r['achieved_min']:.3f}-{r['achieved_max']:.3f}", f"{r['achieved_sparse_layers']:.3f}",
             f"{r['retained_mass']:.4f}") for r in rows]
    return text_table(head, body)


def text_table(head, body) -> str:
    """Right-aligned fixed-width text of a header row and body rows (strings), with a rule under the
    header: the tables the CLI prints and report.txt holds."""
    widths = [max(len(x) for x in col) for col in zip(head, *body)]

    def line(cells) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])
