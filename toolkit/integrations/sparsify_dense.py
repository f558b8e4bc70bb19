"""sparsify's one dense path and its dispatch: what a call that skips nothing runs (the kernels with
skipping off, or under an export's dispatch record the backend the record picks per length bucket
and phase: prefill, and decode where the record has decode entries; an SDPA backend, or for decode
also the project's own dense decode kernel, formats.dispatch.OWN_DENSE), the dispatch plan of an
operating point (prefill and decode), and SDPA's backend priority. Split from
sparsify.py; ``state`` is sparsify's per-model state (its ``plan``, ``dense_backends`` and
``precision``)."""
from __future__ import annotations

import bisect
import contextlib
from pathlib import Path

import torch

from sparsecal.formats.errors import UserError


def _vote(per_config: list, n_len: int) -> list:
    """Per length the most frequent backend over the configs' lists (ties: formats.dispatch.DECODE_BACKENDS
    order: SDPA's, then the project's own dense decode kernel)."""
    from collections import Counter

    from sparsecal.formats.dispatch import DECODE_BACKENDS

    picks = []
    for j in range(n_len):
        votes = Counter(b[j] for b in per_config)
        picks.append(min(votes, key=lambda b: (-votes[b], DECODE_BACKENDS.index(b))))
    return picks


def _dense_backends(export_dir, expect: dict, method: str) -> dict | None:
    """Under an export's dispatch record: per length bucket the one SDPA backend that every method's
    dense prefill tries first (the reference ``dense`` included), the most frequent fastest dense
    backend over the record's operating points (ties: formats.dispatch.SDPA_BACKENDS order), so a
    dense layer is the same computation whichever method or point runs it; ``decode``: the same per
    measured batch over the configs' decode entries of every decision ({"batches" [NB] ascending
    (0: a record that names none), "picks" [NB][lengths]}: the dense decode is one call whichever
    decision the sparse kernel takes, and the fastest one moves with the batch; None: the record has
    none, decode's dense path stays the kernels with skipping off). None: no record."""
    from sparsecal.formats.dispatch import decode_entries, decode_views
    from sparsecal.formats.exports import BLASST_JSON, load_blasst

    folder = Path(export_dir) if Path(export_dir).is_dir() else Path(export_dir).parent
    if not (folder / BLASST_JSON).is_file():
        return None
    try:
        rec = load_blasst(folder, expect).get("dispatch")
    except UserError:
        if method == "blasst":
            raise
        return None  # bsfa: _dispatch_plan has said so; dense, window: no record they could read
    if not rec:
        return None
    n = len(rec["lengths"])
    dec: dict = {}
    for c in rec["configs"]:
        for d in decode_entries(c):
            for b, v in decode_views(d):
                dec.setdefault(b or 0, []).append((v["dense_backend"], v["fastest_backend"]))
    decode = {"batches": sorted(dec), "picks": [_vote([r for r, _ in dec[b]], n) for b in sorted(dec)],
              "fastest": [_vote([f for _, f in dec[b]], n) for b in sorted(dec)]} if dec else None
    return {"lengths": list(rec["lengths"]), "backends": _vote([c["dense_backend"] for c in rec["configs"]], n),
            "decode": decode}


def _dispatch_plan(export_dir, method: str, value, expect: dict) -> dict | None:
    """The dispatch plan of one operating point from blasst.json's ``dispatch`` record (BLASST
    ``value`` None: the file's target), or None: no record, or none for this point (every exported
    layer sparse)."""
    from sparsecal.formats.dispatch import find_config
    from sparsecal.formats.exports import BLASST_JSON, load_blasst

    folder = Path(export_dir) if Path(export_dir).is_dir() else Path(export_dir).parent
    if not (folder / BLASST_JSON).is_file():
        return None
    try:
        doc = load_blasst(folder, expect)
    except UserError as e:
        if method != "bsfa":
            raise
        raise UserError(f"{e} (BSFA reads {BLASST_JSON} only for its dispatch record: sparsify(..., dispatch=False) "
                        "runs BSFA without it)") from None
    rec = doc.get("dispatch")
    entry = find_config(rec, method, doc["target_sparsity"] if value is None else value)
    if entry is None:
        return None
    return {"lengths": list(rec["lengths"]), "sparse": entry["sparse"], "backends": entry["dense_backend"],
            "sparsity": entry["sparsity"], "decode": _decode_batches(entry.get("decode")),
            "decode_group": _decode_batches(entry.get("decode_group"))}


def _decode_batches(dec: dict | None) -> dict | None:
    """A config's decode entry as the plan holds it: {"decision", "modes" (its decode modes),
    "batches" [NB] ascending measured batches ([] for a record that does not say), "entries" [NB or
    1] the single-batch entries (formats.dispatch.decode_views)}; None without one."""
    if not dec:
        return None
    from sparsecal.formats.dispatch import decode_views

    views = decode_views(dec)
    return {"decision": dec["decision"], "modes": set(views[0][1]["modes"]),
            "batches": [b for b, _ in views if b is not None], "entries": [v for _, v in views]}


def _exact_dense(state, query, key, value, scale: float, first: str | None, spec, window, kwargs):
    """The layer's exact dense attention (kernels/layer_dense.py: SDPA, ``first`` the backend tried
    first; a decode step whose ``first`` is formats.dispatch.OWN_DENSE: the project's dense decode
    kernel where it runs the step, own_dense_decode, else SDPA with Flash first), in float32 for
    ``precision="fp32"``; counts nothing. query [B, H, Nq, D] -> [B, Nq, H, D]."""
    from sparsecal.formats.dispatch import OWN_DENSE
    from sparsecal.kernels.layer_dense import layer_attention

    dtype = query.dtype
    if state.precision == "fp32":
        query, key, value = query.float(), key.float(), value.float()
    if first == OWN_DENSE:
        chunk = spec.chunk if spec else None
        if own_dense_runs(query, window, chunk, kwargs):
            return own_dense_decode(state, query, key, value, scale).to(dtype).transpose(1, 2).contiguous()
        first = "FLASH_ATTENTION"
    with _sdpa_first(first) if first else contextlib.nullcontext():
        out = layer_attention(query, key, value, scale, window=window, chunk=spec.chunk if spec else None,
                              softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    return (out if out.dtype == dtype else out.to(dtype)).transpose(1, 2).contiguous()


def own_dense_runs(query, window, chunk, kwargs) -> bool:
    """Whether the project's dense decode kernel runs this step as SDPA would: one query token, no
    sliding window, chunk, softcap or attention sinks, a head dim the Triton kernels compile for and
    the kernel's tuned launches cover (<= formats.dispatch.OWN_DENSE_MAX_D, where the bench times it),
    and the tensors where Triton runs (CUDA, or the CPU under Triton's interpreter, TRITON_INTERPRET=1)."""
    from sparsecal.formats.dispatch import OWN_DENSE_MAX_D
    from sparsecal.formats.geometry import TRITON_HEAD_DIMS
    from sparsecal.kernels.jit import interpreting

    d = query.shape[-1]
    return (query.shape[2] == 1 and not window and not chunk and not kwargs.get("softcap")
            and kwargs.get("s_aux") is None and d in TRITON_HEAD_DIMS and d <= OWN_DENSE_MAX_D
            and (query.is_cuda or (query.device.type == "cpu" and interpreting())))


DECODE_DENSE = ("reproducible", "fastest")


def _decode_dense(choice: str) -> str:
    """What a dense decode step under a dispatch record runs first, checked: "reproducible" (the
    record's ``dense_backend``: the fastest backend whose decode gives the same bits run to run, never
    cuDNN; what evaluations need, so that paired outcomes differ only by the method) or "fastest" (its
    ``fastest_backend``, cuDNN where it won: the fastest dense decode the break-even file measured,
    at the cost of run-to-run reproducibility; a record written before it runs the reproducible pick)."""
    if choice not in DECODE_DENSE:
        raise UserError(f"unknown decode_dense '{choice}'; use one of {', '.join(DECODE_DENSE)}.")
    return choice


def own_dense_decode(state, query, key, value, scale: float):
    """formats.dispatch.OWN_DENSE: kernels/sparse/decode_group.py ``group_decode_triton(..., dense=True)``
    (decode_group_dense.py's DENSE_TABLE launch: a fixed split count and merge order per shape, so
    reproducible). query [B, H, 1, D], key/value [B, Hkv, L, D] -> [B, H, 1, D] in query's dtype."""
    from sparsecal.kernels.sparse.decode_group import group_decode_triton

    return group_decode_triton(query, key, value, scale, state.block_m, state.block_n, dense=True)[0]


def dense_first(state, mode: str, length: int, batch: int | None = None) -> str | None:
    """Where a call skips nothing by construction (``dense``, BLASST outside its law's lengths, a
    window that covers every candidate, BSFA's dense decode), it runs what ``dense`` runs: under a
    dispatch record the bucket's SDPA backend of that phase (this is returned; below the shortest
    length, the shortest's; decode: the picks of the largest measured batch <= ``batch`` (below
    every one, or no batch given: the smallest), Flash where the record picked cuDNN,
    formats.dispatch.decode_backend; OWN_DENSE: the project's dense decode kernel, _exact_dense),
    else the kernels with skipping off (None). Decode: only under a record with decode entries."""
    backends = None if state.dense_backends is None else (
        state.dense_backends["backends"] if mode == "prefill" else state.dense_backends.get("decode"))
    if backends is None:
        return None
    fastest = _fastest(state, mode)
    if mode == "decode":
        backends = backends["fastest" if fastest else "picks"][batch_index(backends["batches"], batch)]
    from sparsecal.formats.dispatch import bucket

    return _pick(backends, bucket(state.dense_backends["lengths"], length), mode, fastest)


def _fastest(state, mode: str) -> bool:
    """A decode call whose dense step may run the record's fastest backend (decode_dense="fastest")."""
    return mode == "decode" and state.decode_dense == "fastest"


def _pick(backends: list, j: int | None, mode: str, fastest: bool = False) -> str:
    """The bucket's backend (below the shortest length, the shortest's); decode: Flash where that is
    cuDNN (formats.dispatch.decode_backend: its decode is not reproducible run to run), unless
    ``fastest`` (sparsify's decode_dense="fastest": the record's fastest of all, cuDNN included)."""
    from sparsecal.formats.dispatch import decode_backend

    pick = backends[0 if j is None else j]
    return decode_backend(pick) if mode == "decode" and not fastest else pick


def decode_plan(state) -> dict | None:
    """The plan's decode entry that covers this state's decode: the one of its decision (head: the
    record's ``decode``, group: ``decode_group``) with an entry for its decode mode; None otherwise
    (decode then runs as without dispatch)."""
    entries = [] if state.plan is None else [state.plan.get("decode"), state.plan.get("decode_group")]
    return next((d for d in entries if d and d["decision"] == state.decision and state.decode in d["modes"]), None)


def decode_entry(state, dec: dict, batch: int | None) -> dict:
    """The entry of the largest measured batch <= ``batch`` (below every measured batch, or no
    batch given: the smallest); a ``batch`` outside the measured ones is said once on stderr (the
    break-even moves with the batch). Python ints only: no tensor is read."""
    got = dec["batches"]
    if not got or not batch:
        return dec["entries"][0]
    if (batch < got[0] or batch > got[-1]) and not state.said_batch:
        import sys

        which = got[0] if batch < got[0] else got[-1]
        print(f"note: the decode dispatch was measured at batch{'es' if len(got) > 1 else ''} "
              f"{', '.join(map(str, got))}, this decode runs batch {batch}: it follows batch {which}'s break-even "
              f"(measure it: sparsecal bench break-even --phases decode --decode-batch {batch}).", file=sys.stderr)
        state.said_batch = True
    return dec["entries"][batch_index(got, batch)]


def batch_index(batches: list, batch: int | None) -> int:
    """Index of the largest measured batch <= ``batch`` in ascending ``batches`` (0 below every one,
    with none measured, or without a batch)."""
    return max(bisect.bisect_right(batches, batch or 0) - 1, 0)


def dispatched_dense(state, layer: int, mode: str, length: int, batch: int | None = None) -> str | None:
    """The SDPA backend to try first when the dispatch plan runs this prefill, or this decode step
    of ``batch`` rows against ``length`` cached tokens, dense (the bucket's fastest; below the
    shortest calibrated length, the shortest's), None when it runs sparse or there is no plan for it
    (decode: no decode entry for the state's decision and decode mode; decode_plan). A decode step follows the
    entry of the largest measured batch <= ``batch`` (decode_entry)."""
    plan = state.plan if mode == "prefill" else decode_plan(state)
    if plan is None:
        return None
    if mode == "decode":
        plan = decode_entry(state, plan, batch)
    from sparsecal.formats.dispatch import bucket

    lengths = state.plan["lengths"]
    sparse = plan["sparse"] if mode == "prefill" else plan["modes"][state.decode]["sparse"]
    j = bucket(lengths, length)
    if j is not None and sparse[layer][j]:
        return None
    fastest = _fastest(state, mode)
    key = "backends" if mode == "prefill" else "fastest_backend" if fastest else "dense_backend"
    return dense_first(state, mode, length, batch) or _pick(plan[key], j, mode, fastest)


_BACKENDS: dict = {}  # SDPBackend name -> the enum member (looked up once)


class _SdpaFirst:
    """SDPA's backend priority with one backend first (the rest in their current order, so MATH
    still runs whatever the others cannot), restored on exit. Only the order changes, not which
    backends are enabled; sdpa_kernel(set_priority=True) does the same at ~3x the host cost per
    call, and is the fall-back where torch lacks the priority accessors."""

    __slots__ = ("ctx", "prev", "want")

    def __init__(self, backend: str):
        if backend not in _BACKENDS:
            from torch.nn.attention import SDPBackend

            _BACKENDS[backend] = getattr(SDPBackend, backend)
        self.want, self.prev, self.ctx = _BACKENDS[backend], None, None

    def __enter__(self):
        get = getattr(torch._C, "_get_sdp_priority_order", None)
        if get is None or not hasattr(torch._C, "_set_sdp_priority_order"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            from sparsecal.formats.dispatch import SDPA_BACKENDS

            rest = [getattr(SDPBackend, b) for b in SDPA_BACKENDS if getattr(SDPBackend, b) != self.want]
            self.ctx = sdpa_kernel([self.want, *rest], set_priority=True)
            return self.ctx.__enter__()
        prev, want = get(), int(self.want)
        if prev[0] != want:  # already first: nothing to set, nor to restore (a layer per decode step asks)
            self.prev = prev
            torch._C._set_sdp_priority_order([want] + [b for b in prev if b != want])
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        if self.prev is not None:
            torch._C._set_sdp_priority_order(self.prev)
        return False


def _sdpa_first(backend: str) -> _SdpaFirst:
    return _SdpaFirst(backend)
