"""Block geometry of causal attention tiles, exactly as DESIGN.md defines it.

Query block i covers rows [i*BM, min((i+1)*BM, N)); key block j covers keys [j*BN, min((j+1)*BN, N)).

- reachable:  j*BN <= min((i+1)*BM, N) - 1        -> blocks 0 .. num_reachable(i)-1
- candidate:  (j+1)*BN <= i*BM (fully visible)     -> blocks 0 .. num_candidates(i)-1  (A_i of them)
- diagonal:   reachable and not a candidate        -> always computed

A decode row r is its own block with BM = 1 and i = r, so the same formulas apply.
"""
from __future__ import annotations

import numpy as np

ORDERS = ("forward", "reverse", "sink_local")
WHERE = ("sink", "diagonal", "middle")  # where the running max stabilizes (t* categories)
PREFIXES = ("first", "local")  # running-max shortfall after the first / first local_prefix() scanned blocks
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)  # head dims the Triton kernels compile for
CAPTURE_BACKENDS = ("auto", "triton", "reference")  # capture --backend (capture/runner.py resolves them)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_reachable(i: int, n: int, bm: int, bn: int) -> int:
    """Number of key blocks reachable from query block i (all of 0 .. result-1)."""
    return (min((i + 1) * bm, n) - 1) // bn + 1


def num_candidates(i: int, bm: int, bn: int) -> int:
    """A_i: number of off-diagonal key blocks fully visible to every row of query block i."""
    return (i * bm) // bn


def block_counts(n: int, bm: int, bn: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query block: (A_i candidates, reachable) as int64 arrays of shape [ceil(n/bm)]."""
    i = np.arange(cdiv(n, bm), dtype=np.int64)
    cand = (i * bm) // bn
    reach = (np.minimum((i + 1) * bm, n) - 1) // bn + 1
    return cand, reach


def scan_order(order: str, num_cand: int, num_reach: int) -> list[int]:
    """Key blocks of one query block in scan order.

    forward:    0 .. num_reach-1 (BLASST's Algorithm 1)
    reverse:    num_reach-1 .. 0 (FA2/FA3 CUDA kernels)
    sink_local: block 0, then the diagonal blocks ascending, then the remaining candidates
                ascending (VFA's order)
    """
    if order == "forward":
        return list(range(num_reach))
    if order == "reverse":
        return list(range(num_reach - 1, -1, -1))
    if order == "sink_local":
        diag = [j for j in range(num_cand, num_reach) if j != 0]
        return [0] + diag + list(range(1, num_cand))
    raise ValueError(f"Unknown scan order '{order}'. Available: {', '.join(ORDERS)}.")


def local_prefix(num_cand: int, num_reach: int) -> int:
    """Scan steps of the shortfall's "local" prefix: min(1 + D_i, R_i) with D_i = R_i - A_i diagonal
    blocks, i.e. the sink block and the diagonal blocks in sink_local order (all R_i blocks when
    A_i = 0, where block 0 is itself diagonal); the same number of leading blocks in any order."""
    return min(1 + num_reach - num_cand, num_reach)


def where_code(j: int, num_cand: int) -> int:
    """t* category of key block j: 0 sink (j == 0), 1 diagonal (j >= A_i), 2 middle."""
    if j == 0:
        return 0
    return 1 if j >= num_cand else 2


TILE_KINDS = ("unreachable", "candidate", "diagonal")


def tile_kinds(n: int, bm: int, bn: int) -> np.ndarray:
    """[P, Kb] int8 tile kinds: 0 unreachable, 1 candidate, 2 diagonal (TILE_KINDS)."""
    p, kb = -(-n // bm), -(-n // bn)
    i, j = np.indices((p, kb))
    reach = j * bn <= np.minimum((i + 1) * bm, n) - 1
    cand = (j + 1) * bn <= i * bm
    return np.where(cand, 1, np.where(reach, 2, 0)).astype(np.int8)
