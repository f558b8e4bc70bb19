"""The attention methods an evaluation compares, and the grammar of ``--methods``.

    SPEC   := ITEM ("," ITEM)*
    ITEM   := "dense" | "sdpa" | "vfa" [":" DECODE] | NAME ":" VALUE [":" DECODE] | VALUE [":" DECODE]
              (a bare VALUE continues the previous NAME)
    NAME   := "bsfa" (VALUE = k, an integer) | "blasst" (VALUE = target sparsity in (0, 1))
            | "window" (VALUE = B candidate blocks kept per query block, an integer >= 0)
            | "window_sink" (VALUE = B >= 1: key block 0, the sink, and the B - 1 candidates
              nearest the diagonal: window B's budget with StreamingLLM's sink)
            | "blasst_sl" (VALUE = target: BLASST in the sink_local scan order at the export's
              lambda law for the target, calibrated in the export's own order)
            | "vsa" (VALUE = target: VFA with BLASST skipping against the frozen max)
    DECODE := how decode steps run: bsfa "dense" (default, the BSFA paper's) | "topk" (the k
              highest tile maxima of the row) | "thresholds" (thresholds calibrated on decode
              rows); the others "sparse" (default) | "dense" (prefill-only: sparse prefill,
              dense decode); blasst also "group" (sparse decode with the group decision: a KV
              group skips a tile only when all its heads would, at the export's group law)

``vfa`` is exact attention with the running max initialised from the Q-init estimate and the sink
and local blocks, then frozen (kernels/sparse/vfa.py; it skips nothing, its rows show what the
frozen max does to rounding); integrations/sparsify_variants.py says how each variant runs.

so ``dense,bsfa:16,32:topk,blasst:0.5,0.5:dense,window:32`` is six methods. The reference every
method is compared with is ``dense``: the project's own kernel path with skipping off, in the
model's dtype. Two noise-floor methods measure what rounding alone moves: ``dense:fp32`` (the same
path with attention computed from float32 Q, K, V; always evaluated) and ``sdpa`` (the model's own
attention implementation, on request). Each ``Method`` has a label (``bsfa:16:topk``, the key of
its rows; a default decode mode is not written), the dashboard's ``method``/``config`` pair
(``bsfa``/``k=16 decode=topk``) and the keyword arguments ``sparsecal.sparsify`` takes.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparsecal.formats.errors import UserError

GRAMMAR = ("dense | sdpa | vfa[:DECODE] | bsfa:K[:DECODE][,K...] | blasst:T[:DECODE][,T...] | window:B[:DECODE][,B...]"
           " | window_sink:B | blasst_sl:T | vsa:T (each [:DECODE][,VALUE...]), joined by commas")
DENSE_CONFIG = "dense"
FP32 = "fp32"
_PARAM = {"bsfa": "k", "blasst": "target", "window": "blocks", "window_sink": "blocks", "blasst_sl": "target",
          "vsa": "target"}
DECODES = {"bsfa": ("dense", "topk", "thresholds"), "blasst": ("sparse", "dense", "group"), "window": ("sparse", "dense"),
           **{m: ("sparse", "dense") for m in ("window_sink", "blasst_sl", "vsa", "vfa")}}
_TARGETS = ("blasst", "blasst_sl", "vsa")  # methods whose VALUE is a target sparsity
_BARE = {"dense": None, "sdpa": None, "dense:fp32": FP32, "vfa": None, "vfa:sparse": None, "vfa:dense": "dense"}
FLOORS = ("dense:fp32", "sdpa", "dense+dispatch")  # labels of the noise-floor methods
DISPATCHED = ("bsfa", "blasst")  # methods the export's dispatch record can run dense per layer
DISPATCH_TAG = "+dispatch"       # label suffix of a method evaluated with the dispatch record


@dataclass(frozen=True)
class Method:
    """One operating point: ``name`` in dense/sdpa/bsfa/blasst/window, its value (None for dense
    and sdpa) and its decode mode (None: the name's default; for dense "fp32" marks the check)."""

    name: str
    value: float | int | None = None
    decode: str | None = None
    dispatch: bool = False  # sparsify(..., dispatch=True): the export's dispatch record (bsfa, blasst)

    @property
    def is_floor(self) -> bool:
        """A noise-floor method: exact dense attention computed another way."""
        return self.label in FLOORS

    @property
    def decode_mode(self) -> str | None:
        if self.name not in DECODES:
            return None
        return self.decode or DECODES[self.name][0]

    @property
    def label(self) -> str:
        if self.value is None:
            return (self.name if self.decode is None else f"{self.name}:{self.decode}") + (
                DISPATCH_TAG if self.dispatch else "")
        tail = "" if self.decode in (None, DECODES[self.name][0]) else f":{self.decode}"
        return f"{self.name}:{self.value:g}{tail}" + (DISPATCH_TAG if self.dispatch else "")

    @property
    def config(self) -> str:
        if self.value is None:
            return {"dense": DENSE_CONFIG, "sdpa": "sdpa", "dense:fp32": "fp32 attention", "vfa": "frozen max",
                    "dense+dispatch": "dense dispatch",
                    "vfa:dense": "frozen max decode=dense"}[self.label]
        tail = "" if self.decode in (None, DECODES[self.name][0]) else f" decode={self.decode}"
        return f"{_PARAM[self.name]}={self.value:g}{tail}" + (" dispatch" if self.dispatch else "")

    @property
    def sparsify_kwargs(self) -> dict:
        """Keyword arguments of ``sparsecal.sparsify`` besides the model and export (sdpa: none,
        the model keeps its own attention)."""
        if self.name == "sdpa":
            return {}
        if self.name == "dense":
            return {"method": "dense", "precision": "fp32" if self.decode == FP32 else "model",
                    "dispatch": self.dispatch}
        if self.name == "vfa":
            return {"method": "vfa", "decode": self.decode_mode, "dispatch": self.dispatch}
        if self.decode_mode == "group":  # sparse decode, one decision per KV group and tile
            return {"method": self.name, _PARAM[self.name]: self.value, "decode": "sparse", "dispatch": self.dispatch,
                    "decode_decision": "group"}
        return {"method": self.name, _PARAM[self.name]: self.value, "decode": self.decode_mode,
                "dispatch": self.dispatch}


def _bad(text: str, why: str) -> UserError:
    return UserError(f"--methods '{text}': {why}; the grammar is {GRAMMAR} "
                     "(e.g. dense,bsfa:16,32:topk,blasst:0.5,0.5:dense,window:32).")


def _value(text: str, name: str, raw: str):
    try:
        if name in _TARGETS:
            v = float(raw)
            if not 0.0 < v < 1.0:
                raise ValueError
            return v
        v = int(raw)
        if v < (1 if name in ("bsfa", "window_sink") else 0):
            raise ValueError
        return v
    except ValueError:
        want = ("a target sparsity between 0 and 1" if name in _TARGETS else
                {"bsfa": "a positive integer k", "window": "a whole number of blocks",
                 "window_sink": "a positive whole number of blocks"}[name])
        raise _bad(text, f"'{raw}' is not {want} for {name}") from None


def _decode(text: str, name: str, raw: str | None) -> str | None:
    if raw is None:
        return None
    if raw not in DECODES[name]:
        raise _bad(text, f"'{raw}' is not a decode mode of {name} (one of {', '.join(DECODES[name])})")
    return None if raw == DECODES[name][0] else raw


def _item(text: str, raw: str, current: str | None) -> tuple[Method, str | None]:
    """One ITEM and the NAME a following bare VALUE continues."""
    if raw in _BARE:
        return Method(raw.split(":")[0], None, _BARE[raw]), None
    parts = raw.split(":")
    if parts[0] == "vfa":
        raise _bad(text, f"'{raw}' is not a method: vfa takes no value, only a decode mode (vfa:sparse, vfa:dense)")
    if parts[0] in _PARAM:
        name, parts = parts[0], parts[1:]
        if not parts or len(parts) > 2:
            raise _bad(text, f"'{raw}' is not NAME:VALUE[:DECODE]")
    elif not parts[0][:1].isdigit():
        raise _bad(text, f"unknown method '{parts[0]}'" if len(parts) > 1 else f"'{raw}' is not a method")
    elif current is None:
        raise _bad(text, f"the value '{raw}' follows no method name")
    else:
        name = current
        if len(parts) > 2:
            raise _bad(text, f"'{raw}' is not VALUE[:DECODE]")
    decode = _decode(text, name, parts[1].strip() if len(parts) == 2 else None)
    return Method(name, _value(text, name, parts[0].strip()), decode), name


def parse_methods(text: str) -> list[Method]:
    """Parse a ``--methods`` value into distinct methods, in the order given."""
    out: list[Method] = []
    current = None
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            raise _bad(text, "an item is empty")
        method, current = _item(text, raw, current)
        out.append(method)
    dupes = sorted({m.label for m in out if out.count(m) > 1})
    if dupes:
        raise _bad(text, f"{', '.join(dupes)} is given twice")
    return out


def with_dense(methods: list[Method]) -> list[Method]:
    """Dense first (every comparison needs it), the fp32 check second, then the others in the
    order given."""
    first = [Method("dense"), Method("dense", None, FP32)]
    return first + [m for m in methods if m not in first]
