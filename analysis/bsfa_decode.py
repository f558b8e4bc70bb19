"""BSFA decode thresholds calibrated on single decode rows, and the mass BSFA retains under the
fitted (exported) thresholds, prefill and decode, on the validation samples.

Per sample capture stores, for each of the last R decode rows (row r its own block, BM = 1:
candidates j < A_r = r // BN), the midpoint of the k-th and (k+1)-th largest candidate row block
maxima (``decode_bsfa_threshold``, -inf when A_r <= k), and the sorted top candidate maxima with
their masses (``decode_bsfa_top_bmax`` / ``decode_bsfa_top_mass``, ``decode_bsfa_cand_mass``).

Fitting: position = r // BM, the prefill thresholds' query block index, so a kernel reads
thresholds[h, min(r // BM, Pt - 1)] as before. Per (k, layer, head, position) the thresholds of the
calibration samples' decode rows in that position are pooled (mean, or median); rows with
A_r <= k (-inf: they keep everything) do not enter, and a position none of whose rows has
A_r > k is -inf. Positions no decode row covers are filled by linear interpolation, in position
index, between the calibrated positions with a finite value, constant beyond the ends; positions
up to the last calibrated -inf position stay -inf (A grows with the position). ``positions`` lists
the calibrated positions.

Retained mass under a threshold t of one position (query block or decode row): the stored sorted
maxima >= t are the kept candidates (n_pass of them); skipped mass = candidate mass - the sum of
their masses. Exact while n_pass < T or A <= T; when all T stored maxima pass and A > T the kept
count is a lower bound and the skipped mass an upper bound ("bound" positions are counted).

Shape legend: K k values, L layers, H heads, R decode rows of a sample, X positions of a sample
(query blocks or decode rows), T stored maxima, Pt fitted positions, C calibrated decode positions.
"""
from __future__ import annotations

import warnings

import numpy as np

from sparsecal.formats.errors import UserError

DECODE_FIT_KEYS = ("decode_bsfa_threshold",)
DECODE_EVAL_KEYS = ("decode_bsfa_top_bmax", "decode_bsfa_top_mass", "decode_bsfa_cand_mass",
                    "decode_bsfa_skipped_mass")
PREFILL_MASS_KEYS = ("bsfa_top_bmax", "bsfa_top_mass", "bsfa_cand_mass", "candidates")
RECAPTURE = ("was captured before decode-row BSFA statistics existed (decode_bsfa_threshold); capture it "
             "again with this sparsecal to calibrate BSFA decode thresholds")


def optional_arrays(store, record: dict, keys) -> dict | None:
    """The named arrays of one sample, or None when it lacks any (captured by an older sparsecal)."""
    _, tensors = store.load_sample(record["id"], keys=list(keys))
    return {k: tensors[k] for k in keys} if all(k in tensors for k in keys) else None


def decode_rows(length: int, decode_rows: int) -> np.ndarray:
    """Row indices [R] of a sample's decode rows (the last min(decode_rows, N))."""
    return np.arange(max(length - decode_rows, 0), length)


def interpolate(vals: np.ndarray, calibrated: np.ndarray, num: int) -> np.ndarray:
    """[..., C] values at the calibrated positions (ascending) -> [..., num] (module docstring)."""
    out = np.full(vals.shape[:-1] + (num,), -np.inf, np.float32)
    pos = np.arange(num)
    for idx in np.ndindex(vals.shape[:-1]):
        v = vals[idx]
        fin = np.isfinite(v)
        if not fin.any():
            continue
        row = np.interp(pos, calibrated[fin], v[fin])
        if (~fin).any():
            row[pos <= calibrated[~fin].max()] = -np.inf
        out[idx] = row
    return out


class DecodeFit:
    """Decode thresholds pooled over the calibration samples' decode rows, then their validation.

    add(arrays, length): one calibration sample's decode_bsfa_threshold [L, H, R, K] (the fitted
    k's); result(num): [K, L, H, num] and the calibrated positions [C]; measure(...): a validation
    sample's decode density and retained mass under them, and the prefill retained mass under the
    fitted prefill thresholds."""

    def __init__(self, cfg, kidx: list, method: str = "mean"):
        self.cfg, self.kidx, self.method = cfg, kidx, method
        self.sum: dict = {}     # position -> [L, H, K] sum of finite thresholds (mean)
        self.count: dict = {}   # position -> [K] finite rows
        self.vals: dict = {}    # position -> list of [L, H, K] (median)
        self.missing = 0        # calibration samples without the arrays
        self.thr = self.positions = None
        self.evals: dict = {}   # length -> list of per-sample dicts

    def add(self, arrays: dict | None, length: int) -> None:
        if arrays is None:
            self.missing += 1
            return
        t = np.asarray(arrays["decode_bsfa_threshold"], np.float64)[..., self.kidx]  # [L, H, R, K]
        for x, r in enumerate(decode_rows(length, self.cfg.decode_rows)):
            p, v = int(r) // self.cfg.block_m, t[:, :, x]
            fin = np.isfinite(v)
            self.sum[p] = self.sum.get(p, 0.0) + np.where(fin, v, 0.0)
            self.count[p] = self.count.get(p, 0) + fin[0, 0].astype(np.int64)  # -inf iff A_r <= k
            if self.method == "median":
                self.vals.setdefault(p, []).append(np.where(fin, v, np.nan).astype(np.float32))

    def result(self, num: int):
        """(thresholds [K, L, H, num] f32, positions [C] i64), or (None, None) with no decode rows."""
        if not self.count:
            return None, None
        cal = np.array(sorted(self.count), np.int64)
        pooled = []
        for p in cal:
            if self.method == "median":
                with warnings.catch_warnings():  # an all-NaN slice (every row keeps everything) is -inf below
                    warnings.simplefilter("ignore", RuntimeWarning)
                    m = np.nanmedian(np.stack(self.vals[p]), axis=0)
            else:
                with np.errstate(invalid="ignore", divide="ignore"):
                    m = self.sum[p] / self.count[p]
            pooled.append(np.where(self.count[p] > 0, m, -np.inf))
        vals = np.moveaxis(np.stack(pooled, axis=-1), 2, 0)  # [K, L, H, C]
        self.thr, self.positions = interpolate(vals, cal, max(num, int(cal.max()) + 1)), cal
        return self.thr, self.positions

    def measure(self, pre: dict | None, dec: dict | None, prefill_thr: np.ndarray, length: int, ks) -> None:
        """One validation sample: prefill retained mass under the fitted prefill thresholds (pre:
        PREFILL_MASS_KEYS arrays, or None) and decode density / retained mass under the fitted decode
        thresholds (dec: DECODE_EVAL_KEYS arrays, or None)."""
        item = {}
        if pre is not None:
            cand = np.asarray(pre["candidates"], np.int64)
            pos = np.minimum(np.arange(len(cand)), prefill_thr.shape[-1] - 1)
            _, skipped, bound = apply_thresholds(prefill_thr[..., pos], pre["bsfa_top_bmax"], pre["bsfa_top_mass"],
                                                    pre["bsfa_cand_mass"], cand)
            item["prefill"] = {"retained": 1.0 - skipped.mean(-1), "bound": bound, "positions": len(cand)}
        if dec is not None and self.thr is not None:
            item["decode"] = self._measure_decode(dec, length, ks)
        if item:
            self.evals.setdefault(length, []).append(item)

    def _measure_decode(self, dec: dict, length: int, ks) -> dict:
        rows = decode_rows(length, self.cfg.decode_rows)
        cand = rows // self.cfg.block_n
        pos = np.minimum(rows // self.cfg.block_m, self.thr.shape[-1] - 1)
        kept, skipped, bound = apply_thresholds(self.thr[..., pos], dec["decode_bsfa_top_bmax"],
                                                dec["decode_bsfa_top_mass"], dec["decode_bsfa_cand_mass"], cand)
        reach = (cand + 1).sum()
        own = np.moveaxis(np.asarray(dec["decode_bsfa_skipped_mass"], np.float64)[..., self.kidx], -1, 0)
        return {"density": (kept.sum(-1) + len(rows)) / reach,                                   # [K, L, H]
                "predicted": np.array([(np.minimum(k, cand).sum() + len(rows)) / reach for k in ks]),
                "retained": 1.0 - skipped.mean(-1), "retained_topk": 1.0 - own.mean(-1),
                "bound": bound, "positions": len(rows)}


def apply_thresholds(th: np.ndarray, top: np.ndarray, tmass: np.ndarray, cmass: np.ndarray, cand: np.ndarray):
    """Kept candidates and skipped mass of one sample under per-position thresholds.

    th [K, L, H, X] (the threshold each position reads); top, tmass [L, H, X, T] the stored sorted
    maxima and their masses; cmass [L, H, X] candidate mass; cand [X] A per position. Returns (kept
    [K, L, H, X] int64, skipped mass [K, L, H, X] f64, bound [K]: positions where all T stored
    maxima pass and A > T, so kept is a lower bound and the skipped mass an upper bound). A -inf
    threshold keeps every candidate, exactly."""
    top = np.asarray(top, np.float32)
    t_len = top.shape[-1]
    n_pass = (top[None] >= th.astype(np.float32)[..., None]).sum(-1)                 # [K, L, H, X]
    cum = np.concatenate([np.zeros(top.shape[:-1] + (1,)), np.cumsum(np.asarray(tmass, np.float64), -1)], -1)
    kept_mass = np.take_along_axis(np.broadcast_to(cum, n_pass.shape[:1] + cum.shape), n_pass[..., None], -1)[..., 0]
    keep_all = th == -np.inf
    skipped = np.where(keep_all, 0.0, np.maximum(np.asarray(cmass, np.float64)[None] - kept_mass, 0.0))
    cand = np.asarray(cand, np.int64)
    kept = np.where(keep_all, cand, np.minimum(n_pass, cand))
    bound = ((n_pass == t_len) & (cand > t_len) & ~keep_all).sum(axis=(1, 2, 3))
    return kept, skipped, bound


def density_rows(evals: dict, ks, label: str) -> list[dict]:
    """``bsfa_decode`` rows per k and length: predicted vs measured decode density under the fitted
    decode thresholds (mean, spread over samples), retained mass under them and under each row's own
    top-k (what decode top-k keeps), bound rows."""
    rows = []
    for n, items in sorted(evals.items()):
        items = [e["decode"] for e in items if "decode" in e]
        if not items:
            continue
        dens = np.stack([e["density"] for e in items]).mean((2, 3))                   # [S, K]
        ret = np.stack([e["retained"] for e in items]).mean((2, 3))
        own = np.stack([e["retained_topk"] for e in items]).mean((0, 2, 3))
        bound = np.stack([e["bound"] for e in items]).sum(0)
        for i, k in enumerate(ks):
            rows.append({"k": k, "length": n, "samples": len(items), "split": label,
                         "predicted": float(items[0]["predicted"][i]), "measured": float(dens[:, i].mean()),
                         "measured_std": float(dens[:, i].std(ddof=1)) if len(items) > 1 else float("nan"),
                         "retained_mass": float(ret[:, i].mean()), "retained_mass_topk": float(own[i]),
                         "bound_rows": int(bound[i])})
    return rows


def retained_rows(evals: dict, ks, label: str) -> list[dict]:
    """``bsfa_retained`` rows per phase (prefill, decode), k and length: mean retained softmax mass
    under the fitted thresholds on the validation samples, its min over samples, and the positions
    where it is a lower bound."""
    rows = []
    for n, items in sorted(evals.items()):
        for phase in ("prefill", "decode"):
            got = [e[phase] for e in items if phase in e]
            if not got:
                continue
            ret = np.stack([g["retained"] for g in got]).mean((2, 3))                  # [S, K]
            bound = np.stack([g["bound"] for g in got]).sum(0)
            for i, k in enumerate(ks):
                rows.append({"phase": phase, "k": k, "length": n, "samples": len(got), "split": label,
                             "retained_mass": float(ret[:, i].mean()), "retained_min": float(ret[:, i].min()),
                             "bound_positions": int(bound[i]), "positions": int(sum(g["positions"] for g in got))})
    return rows


def require_decode(thr, where: str) -> None:
    """One line when thresholds-mode decode is asked of a run (or fit) without decode thresholds."""
    if thr is None:
        raise UserError(f"{where} {RECAPTURE}.")


class DecodeStep(DecodeFit):
    """DecodeFit with the reads and writes of ``sparsecal fit`` (analysis/fit.py calls these)."""

    def add_sample(self, store, record: dict) -> None:
        self.add(optional_arrays(store, record, DECODE_FIT_KEYS), record["length"])

    def finish(self, num: int, warn=None) -> None:
        """Fit the decode thresholds over ``num`` positions; warns when samples lack the arrays."""
        self.result(num)
        if self.missing and warn:
            what = "no BSFA decode thresholds" if self.thr is None else "decode thresholds from the others only"
            warn(f"{self.missing} calibration sample(s) {RECAPTURE.replace('was', 'were', 1)}: {what}.")

    def measure_sample(self, store, record: dict, prefill_thr: np.ndarray, ks) -> None:
        self.measure(optional_arrays(store, record, PREFILL_MASS_KEYS), optional_arrays(store, record, DECODE_EVAL_KEYS),
                     prefill_thr, record["length"], ks)

    def arrays(self) -> dict:
        """Extra arrays of bsfa_thresholds.safetensors: decode_thresholds [K, L, H, Pt] f32 and
        decode_positions [C] i64 (nothing when no sample had decode rows)."""
        if self.thr is None:
            return {}
        return {"decode_thresholds": np.ascontiguousarray(self.thr, np.float32),
                "decode_positions": self.positions.astype(np.int64)}

    def frames(self, ks, label: str) -> dict:
        return {"bsfa_decode": density_rows(self.evals, ks, label), "bsfa_retained": retained_rows(self.evals, ks, label)}
