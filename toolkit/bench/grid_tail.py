"""How long a prefill grid's tail is, on the CPU: the order the Gluon prefill kernels launch their
programs in (``kernels/sparse/prefill_gluon_ws._program``) run through a greedy list scheduler over a
cost per query block read from the benchmark's own input (``sparse_inputs.structured_qkv``) at a BSFA
or BLASST operating point. The model behind the grid order's ``CHUNK_UP_TO`` (data/bench/NOTES.md
"heads side by side in chunks", s45): a model of the tail, not a timing; L2 reuse, which decides
where chunking stops paying, is not in it.

Cost of query block i of head h: its kept candidate tiles and its diagonal tiles 1 each, its skipped
candidates ``skipped_cost`` (a skipped tile still loads K and runs Q.K^T; 0.45 was solved from the
paired kernel's 0 / 50 / 75 % rows, NOTES "prefill SPEC forms"). The paired kernel's program holds
blocks 2p and 2p + 1, which share one K/V ring, and costs twice the slower of the two.

    python -m sparsecal.bench.grid_tail [--tokens 16384] [--head-dim 64] [--heads 32] [--group 1]
        [--sparsity 0.5] [--sms 132] [--chunks 1,4,8]

The ws kernel's programs (one block each) run two an SM, the paired kernel's one.

Shape legend: H query heads, P query blocks (BM = 128), Kb key blocks (BN = 64), C heads side by side.
"""
from __future__ import annotations

import argparse
import heapq
import math

import torch

from sparsecal.bench.harness import run_cli
from sparsecal.bench.sparse_inputs import blasst_log_lambda_for, bsfa_thresholds_for, structured_qkv
from sparsecal.formats.errors import UserError
from sparsecal.formats.geometry import cdiv, num_candidates, num_reachable, scan_order
from sparsecal.kernels.capture.reference import block_scores, pad_blocks, scan_rows

BM, BN = 128, 64


def block_tile_stats(n: int, d: int, heads: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bmax, gap) [H, P, Kb] f32 of the bench's input on the CPU, from the capture reference's scores
    and forward scan: each key block's max scaled score over a query block's rows, and its BLASST
    forward gap (the rows' max of row max less the running max including the block), -inf where
    unreachable."""
    q, k, _ = structured_qkv(n, d, heads, heads // group, seed=seed, device="cpu")
    qs, kp = q[0].float() * d ** -0.5, pad_blocks(k[0].float(), BN)
    p, kb = cdiv(n, BM), cdiv(n, BN)
    bmax = torch.full((heads, p, kb), -math.inf)
    gap = torch.full((heads, p, kb), -math.inf)
    for i in range(p):
        r0, r1 = i * BM, min((i + 1) * BM, n)
        nr, a = num_reachable(i, n, BM, BN), num_candidates(i, BM, BN)
        rm = block_scores(qs, kp, r0, r1, nr, BN, group).view(heads, r1 - r0, nr, BN).amax(-1)   # [H, m, nr]
        bmax[:, i, :nr] = rm.amax(1)
        gap[:, i, :nr] = scan_rows(rm, scan_order("forward", a, nr), rm.amax(-1))[0].amax(1)
    return bmax, gap


def block_costs(bmax, gap, n: int, method: str, sparsity: float, skipped_cost: float = 0.45) -> torch.Tensor:
    """Cost [H, P] of each query block at the operating point the benchmark sets for ``method``."""
    _, p, kb = bmax.shape
    cand = torch.arange(kb).view(1, 1, -1) < (torch.arange(p) * (BM // BN)).view(1, -1, 1)
    if method == "bsfa":
        skip = (bmax < bsfa_thresholds_for(bmax, n, BM, BN, sparsity)[..., None]) & cand
    else:
        skip = (gap < blasst_log_lambda_for(gap, n, BM, BN, sparsity)) & cand
    reach = (bmax > -math.inf).sum(-1).float()
    skipped = skip.sum(-1).float()
    return reach - skipped * (1.0 - skipped_cost)


def grid_order(heads: int, programs: int, chunk: int) -> list[tuple[int, int]]:
    """(head, rank) in launch order of a grid (programs x C, H / C) as ``_program`` maps it: program id 0
    fastest; rank programs - 1 is the heaviest block (or pair), launched first."""
    out = []
    for pid1 in range(heads // chunk):
        for pid0 in range(programs * chunk):
            out.append((pid1 * chunk + pid0 % chunk, programs - 1 - pid0 // chunk))
    return out


def makespan(order, cost: torch.Tensor, slots: int) -> float:
    """The greedy list schedule's end: each program starts on the first slot to free."""
    free = [0.0] * slots
    for h, i in order:
        heapq.heappush(free, heapq.heappop(free) + float(cost[h, i]))
    return max(free)


def tail_table(cost: torch.Tensor, slots: int, chunks, paired: bool) -> dict[int, float]:
    """Makespan / (work / slots) per chunk; ``paired``: programs of two blocks (twice the slower)."""
    if paired:
        if cost.shape[1] % 2:
            cost = torch.cat([cost, torch.zeros_like(cost[:, :1])], 1)
        cost = 2 * torch.maximum(cost[:, 0::2], cost[:, 1::2])
    bound = float(cost.sum()) / slots
    return {c: makespan(grid_order(cost.shape[0], cost.shape[1], c), cost, slots) / bound for c in chunks}


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise UserError(f"--{name} takes positive integers separated by commas, got {text!r}.")
    return vals


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparsecal.bench.grid_tail", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--sms", type=int, default=132, help="multiprocessors (an H100 SXM has 132)")
    ap.add_argument("--chunks", default="1,4,8")
    args = ap.parse_args(argv)
    chunks = _ints(args.chunks, "chunks")
    if args.sms < 1 or args.tokens < BM or args.head_dim < 8 or args.group < 1 or args.heads % args.group:
        raise UserError("--sms >= 1, --tokens >= 128, --head-dim >= 8 and a --group that divides --heads, please.")
    if not 0.0 < args.sparsity < 1.0 or any(args.heads % c for c in chunks):
        raise UserError("--sparsity lies in (0, 1) and every --chunks value divides --heads.")
    seed = args.tokens + args.head_dim + args.group  # the prefill benchmark's input for this shape
    bmax, gap = block_tile_stats(args.tokens, args.head_dim, args.heads, args.group, seed)
    print("| method | kernel (program slots) | " + " | ".join(f"C = {c}" for c in chunks) + " |")
    print("|---|---|" + "---|" * len(chunks))
    for method in ("bsfa", "blasst"):
        cost = block_costs(bmax, gap, args.tokens, method, args.sparsity)
        for paired in (False, True):
            slots = args.sms * (1 if paired else 2)
            t = tail_table(cost, slots, chunks, paired)
            cells = " | ".join(f"{t[c]:.3f}" for c in chunks)
            print(f"| {method} | {'paired' if paired else 'ws'} ({slots}) | {cells} |")


if __name__ == "__main__":
    run_cli(main)
