"""A run's finished samples as the analysis sees them: records, the hold-out split, and streaming
reads of the statistics it needs (numpy, float64 for sums).

The split is per length (every length is both calibrated and validated) and deterministic: the
samples of a length are ordered by a hash of (seed, sample id) and the first round(holdout * n)
of them, at least one, are held out.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from sparsecal.formats.errors import UserError
from sparsecal.formats.stats_config import StatsConfig


@dataclass(frozen=True)
class Split:
    train: tuple[dict, ...]   # sample records (task, length, id, ...)
    test: tuple[dict, ...]

    @property
    def lengths(self) -> list[int]:
        return sorted({r["length"] for r in self.train + self.test})


def finished_records(store, warn=None, strict: bool = False) -> list[dict]:
    """Records of the finished, readable samples of ``store``: the manifest's in its order, then
    finished samples the manifest lacks (a warning names them and `sparsecal doctor`); damaged
    samples and samples holding impossible statistics (NaN, inf, negative counts: every array is
    read and checked) are left out with one warning line each kind. A manifest record that
    disagrees with its sample's own record is refused (one line naming `sparsecal doctor`)."""
    scan = store.scan()  # one read of every sample's header
    impossible = {sid: why for sid, why in ((sid, store.check_values(sid)) for sid, w in scan.items() if w is None)
                  if why is not None}
    damaged = store.damaged(scan)
    scan.update(impossible)
    recs, extra = store.finished_records(scan)
    _check_records(store, scan)
    if not recs:
        if impossible or damaged:
            raise UserError(f"{store.root} has no usable sample: every finished one is damaged or holds impossible "
                            f"statistics ({_named({**damaged, **impossible})}); recapture them.")
        raise UserError(f"{store.root} has no finished samples; run `sparsecal capture --out {store.root}` first.")
    if warn and extra:
        warn(f"{len(extra)} finished sample(s) of {store.root} are missing from its manifest ({', '.join(extra[:3])}"
             f"{', ...' if len(extra) > 3 else ''}); they are fitted too. `sparsecal doctor {store.root}` repairs "
             "the manifest.")
    if strict and (damaged or impossible):
        sid, why = next(iter({**damaged, **impossible}.items()))
        raise UserError(f"{store.root} has {len(damaged) + len(impossible)} damaged sample(s) ({sid}: {why}); "
                        "recapture them (`sparsecal doctor` says how), or fit without --strict to leave them out.")
    if warn and damaged:
        sid, why = next(iter(damaged.items()))
        warn(f"{len(damaged)} damaged sample(s) left out ({sid}: {why}); the same capture command recaptures them.")
    if warn and impossible:
        warn(f"{len(impossible)} sample(s) with impossible statistics left out ({_named(impossible)}); remove their "
             "folders and run the same capture command to recapture them.")
    return recs


def _named(bad: dict[str, str]) -> str:
    """"id: why" of the first bad sample, and the other ids (at most three in all)."""
    sid, why = next(iter(bad.items()))
    rest = list(bad)[1:]
    return f"{sid}: {why}" + (f"; also {', '.join(rest[:2])}{', ...' if len(rest) > 2 else ''}" if rest else "")


def _check_records(store, scan: dict) -> None:
    """Refuse manifest records that disagree with their samples' own records (one line)."""
    wrong = store.mismatches(scan)
    if wrong:
        sid, diff = next(iter(wrong.items()))
        more = f" and {len(wrong) - 1} more" if len(wrong) > 1 else ""
        raise UserError(f"{store.root}/manifest.json's record of sample {sid} disagrees with the sample "
                        f"({diff}){more}; run `sparsecal doctor {store.root}`, which repairs the manifest from the samples.")


def split_samples(records: list[dict], holdout: float, seed: int = 0, where: str = "the run") -> Split:
    """Hold out a share of each length's samples; holdout 0 keeps all for calibration."""
    if not 0.0 <= holdout < 1.0:
        raise UserError(f"--holdout {holdout} must be in [0, 1); e.g. 0.25 holds out a quarter of each length's samples.")
    by_len = defaultdict(list)
    for r in records:
        by_len[r["length"]].append(r)
    if holdout == 0:
        return Split(tuple(records), ())
    short = {n: len(v) for n, v in sorted(by_len.items()) if len(v) < 2}
    if short:
        desc = ", ".join(f"{len_} tokens: {c}" for len_, c in short.items())
        raise UserError(f"{where} has too few samples for a hold-out split ({desc} sample); each length needs at "
                        "least 2: capture more with --samples, or fit without validation using --holdout 0.")
    train, test = [], []
    for n in sorted(by_len):
        items = sorted(by_len[n], key=lambda r: hashlib.sha1(f"{seed}:{r['id']}".encode()).hexdigest())
        n_test = min(max(1, round(holdout * len(items))), len(items) - 1)
        test += items[:n_test]
        train += items[n_test:]
    return Split(tuple(train), tuple(test))


def decode_reachable(length: int, cfg: StatsConfig) -> int:
    """Reachable key blocks summed over the decode rows of a length-N sample (row r: r//BN + 1)."""
    rows = np.arange(max(length - cfg.decode_rows, 0), length)
    return int((rows // cfg.block_n + 1).sum())


def load_arrays(store, record: dict, keys, optional=()) -> dict[str, np.ndarray]:
    """The named statistics of one sample as numpy arrays (float tensors keep their dtype), and
    those of ``optional`` the sample has (statistics older captures lack). ``record`` (the
    manifest's) must agree with the sample's own on its length and task."""
    own, tensors = store.load_sample(record["id"], keys=tuple(keys) + tuple(optional))
    for key in ("length", "task"):
        if record.get(key) != own.get(key):
            raise UserError(f"{store.root}/manifest.json says sample {record['id']} has {key} {record.get(key)!r}, "
                            f"the sample itself {own.get(key)!r}; run `sparsecal doctor {store.root}`, which repairs "
                            "the manifest.")
    missing = [k for k in keys if k not in tensors]
    if missing:
        raise UserError(f"sample {record['id']} of {store.root} lacks {', '.join(missing)}; "
                        "it was captured by an incompatible sparsecal: capture the run again.")
    return {k: tensors[k] for k in tuple(keys) + tuple(optional) if k in tensors}
