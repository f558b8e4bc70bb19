"""The attention methods an evaluation compares, and the grammar of ``--methods``.

    SPEC   := ITEM ("," ITEM)*
    ITEM   := "dense" | NAME ":" VALUE | VALUE      (a bare VALUE continues the previous NAME)
    NAME   := "bsfa" (VALUE = k, an integer) | "blasst" (VALUE = target sparsity in (0, 1))
            | "window" (VALUE = B candidate blocks kept per query block, an integer >= 0)

so ``dense,bsfa:16,32,64,blasst:0.5,0.7,window:32`` is seven methods. Each ``Method`` has a label
(``bsfa:16``, the key of its rows), the dashboard's ``method``/``config`` pair (``bsfa``/``k=16``;
dense is ``dense``/``dense``) and the keyword arguments ``sparsecal.sparsify`` takes.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparsecal.formats.errors import UserError

GRAMMAR = "dense | bsfa:K[,K...] | blasst:T[,T...] | window:B[,B...], joined by commas"
DENSE_CONFIG = "dense"
_PARAM = {"bsfa": "k", "blasst": "target", "window": "blocks"}
_SPARSIFY_ARG = {"bsfa": "k", "blasst": "target", "window": "blocks"}


@dataclass(frozen=True)
class Method:
    """One operating point: ``name`` in dense/bsfa/blasst/window and its value (None for dense)."""

    name: str
    value: float | int | None = None

    @property
    def label(self) -> str:
        return self.name if self.value is None else f"{self.name}:{self.value:g}"

    @property
    def config(self) -> str:
        return DENSE_CONFIG if self.value is None else f"{_PARAM[self.name]}={self.value:g}"

    @property
    def sparsify_kwargs(self) -> dict:
        """Keyword arguments of ``sparsecal.sparsify`` besides the model and export (dense: none)."""
        return {} if self.value is None else {"method": self.name, _SPARSIFY_ARG[self.name]: self.value}


def _bad(text: str, why: str) -> UserError:
    return UserError(f"--methods '{text}': {why}; the grammar is {GRAMMAR} "
                     "(e.g. dense,bsfa:16,32,blasst:0.5,window:32).")


def _value(text: str, name: str, raw: str):
    try:
        if name == "blasst":
            v = float(raw)
            if not 0.0 < v < 1.0:
                raise ValueError
            return v
        v = int(raw)
        if v < (1 if name == "bsfa" else 0):
            raise ValueError
        return v
    except ValueError:
        want = {"bsfa": "a positive integer k", "blasst": "a target sparsity between 0 and 1",
                "window": "a whole number of blocks"}[name]
        raise _bad(text, f"'{raw}' is not {want} for {name}") from None


def parse_methods(text: str) -> list[Method]:
    """Parse a ``--methods`` value into distinct methods, in the order given."""
    out: list[Method] = []
    current = None
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            raise _bad(text, "an item is empty")
        if raw == "dense":
            out.append(Method("dense"))
            current = None
            continue
        name, sep, val = raw.partition(":")
        if sep:
            if name not in _PARAM:
                raise _bad(text, f"unknown method '{name}'")
            current = name
        elif current is None:
            raise _bad(text, f"'{raw}' is not a method" if not raw[:1].isdigit()
                       else f"the value '{raw}' follows no method name")
        else:
            val = raw
        out.append(Method(current, _value(text, current, val.strip())))
    dupes = sorted({m.label for m in out if out.count(m) > 1})
    if dupes:
        raise _bad(text, f"{', '.join(dupes)} is given twice")
    return out


def with_dense(methods: list[Method]) -> list[Method]:
    """Dense first (every comparison needs it), then the others in the order given."""
    return [Method("dense")] + [m for m in methods if m.name != "dense"]
