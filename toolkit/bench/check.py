"""Every Triton kernel against its plain-torch reference on the GPU, in one run (no timing):

    python3 -m sparsecal.bench.check [--out data/bench/kernel-checks-h100.json] [--commit <sha>] [--sections a,b]

- capture, two-pass (kernels/capture/instrumented.py) and the dense forward: ``capture_instrumented.check_case``
  on harness.CHECK_CASES (8 shapes: bf16/fp16/fp32, GQA 1-16 and MQA, D 64/128/256, 128x64, 64x32, 80x48),
  every TileStats field (t*, running-max rescales and shortfall included) and every reduced key
  (rescale_count, rescale_excess, shortfall_count included);
- capture, one order (kernels/capture/single_order.py, forward_stats.py, mass.py):
  ``capture_single_order.check_single`` on the same shapes, every scan order;
- sparse prefill and decode (kernels/sparse/): ``sparse.check_kernels`` (BSFA, BLASST in three
  orders, window; split-K decode);
- soft-capping (``softcap``, Gemma 2's c * tanh(s / c) on every score), D = 256 and MQA with 16
  query heads in every family: ``check_softcap`` on SOFTCAP_CASES (capture both paths, dense,
  sparse prefill BSFA/BLASST/window, sparse decode both schedules, each against its capped
  reference), and ``check_refusals`` (fp32 query tiles no GPU kernel can hold raise ValueError).

Writes the rows with provenance and prints one line per family; exits 1 when a check fails.

Shape legend: H query heads, Hkv KV heads, N tokens, D head dim, P query blocks, Kb key blocks.
"""
from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path

import torch

from sparsecal.bench.capture_instrumented import check_case, field_errors, rescales_ok
from sparsecal.bench.capture_single_order import check_single, one_order, reduced_errors
from sparsecal.bench.harness import CHECK_CASES, log, random_qkv, result_file, run_section
from sparsecal.bench.sparse import check_kernels
from sparsecal.bench.sparse_inputs import blasst_log_lambda_for, bsfa_thresholds_for, decode_tile_max
from sparsecal.formats.geometry import ORDERS
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.kernels.capture.instrumented import instrumented_attention_triton
from sparsecal.kernels.capture.pipeline import capture_triton
from sparsecal.kernels.capture.reduce_reference import reduce_tiles
from sparsecal.kernels.capture.reference import instrumented_attention
from sparsecal.kernels.dense import attention_dense
from sparsecal.kernels.dense_reference import attention_reference
from sparsecal.kernels.softcap import soft_cap
from sparsecal.kernels.sparse.decode import SCHEDULES, sparse_decode_triton
from sparsecal.kernels.sparse.prefill import sparse_attention_triton
from sparsecal.kernels.sparse.reference import sparse_attention, sparse_decode

SOFTCAP_CASES = [  # (N, KV heads, group, D, BM, BN, dtype, softcap; 0 = off)
    (1000, 1, 16, 256, 128, 64, torch.bfloat16, 4.0),   # MQA with 16 query heads, D = 256, a cap that bites
    (777, 2, 4, 128, 128, 64, torch.float16, 4.0),
    (640, 1, 2, 64, 128, 64, torch.float32, 50.0),      # Gemma 2's attention cap
    (513, 2, 8, 256, 64, 32, torch.bfloat16, 0.0),      # D = 256 uncapped, GQA 8, 64x32 blocks
    (300, 1, 4, 256, 64, 32, torch.float32, 4.0),       # fp32 at D = 256 on 64-row query blocks
]
OUT_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _two_pass(q, k, v, scale, cfg, r, ref_out, cap, tol) -> dict:
    """instrumented_attention_triton's TileStats and the fused capture path against the reference."""
    out, t = instrumented_attention_triton(q, k, v, scale, cfg, softcap=cap)
    f = field_errors(t, r)
    n = q.shape[2]
    a, b = reduce_tiles(t, n, cfg), reduce_tiles(r, n, cfg)
    _, fused = capture_triton(q, k, v, scale, cfg, softcap=cap)
    ks = reduced_errors(fused, b)
    err = float((out.double() - ref_out.double()).abs().max())
    ok = (err < tol and all(x.get("inf_pattern_equal", True) for x in f.values())
          and all(f[x]["max_abs_err"] < 1e-3 for x in ("bmax", "gap", "qinit_err", "joint_err", "dec_gap"))
          and all(f[x]["max_abs_err"] < 1e-4 for x in ("mass", "dec_mass"))
          and f["tstar_step"]["mismatch_share"] < 0.01 and rescales_ok(f)
          and torch.equal(a["bsfa_kept"], b["bsfa_kept"])
          and _reduced_ok(fused, ks))
    return {"ok": bool(ok), "out_max_abs_err": err, "fields": f, "fused_keys": ks}


def _reduced_ok(got: dict, ks: dict) -> bool:
    """capture_single_order.check_single's criteria on reduced_errors' rows."""
    return bool(list(got) == list(ks)
                and all(x["same_shape"] and x["same_dtype"] and x.get("inf_equal", True) for x in ks.values())
                and all(x["within"] for x in ks.values())
                and ks["bsfa_kept"]["moved_share"] == 0
                and all(x.get("moved_share", 0) < 0.01 for x in ks.values()))


def _one_order(q, k, v, scale, bm, bn, r, ref_out, cap, tol) -> dict:
    """The single-order capture in every order against reduce_tiles of the reference's order."""
    rows, ok = {}, True
    for o, order in enumerate(ORDERS):
        cfg = StatsConfig(block_m=bm, block_n=bn, orders=(order,), raw=True)
        out, got = capture_triton(q, k, v, scale, cfg, softcap=cap)
        ks = reduced_errors(got, reduce_tiles(one_order(r, o), q.shape[2], cfg))
        err = float((out.double() - ref_out.double()).abs().max())
        rows[order] = {"out_max_abs_err": err, "ok": bool(err < tol and _reduced_ok(got, ks)), "keys": ks}
        ok &= rows[order]["ok"]
    return {"ok": bool(ok), "orders": rows}


def _dense(q, k, v, scale, cap, tol) -> dict:
    out, lse = attention_dense(q, k, v, scale, softcap=cap)
    ref, ref_lse = attention_reference(q, k, v, scale, softcap=cap)
    err, lse_err = float((out.double() - ref).abs().max()), float((lse.double() - ref_lse).abs().max())
    return {"ok": bool(err < tol and lse_err < 1e-3), "out_max_abs_err": err, "lse_max_abs_err": lse_err}


def _prefill(q, k, v, scale, bm, bn, r, cap, tol) -> dict:
    """BSFA, window and BLASST in every order, cut at half the reachable tiles of the capped input."""
    n = q.shape[2]
    cases = [{"thresholds": bsfa_thresholds_for(r.bmax, n, bm, bn, 0.5)}, {"window": 2}]
    cases += [{"log_lambda": blasst_log_lambda_for(r.gap[:, o], n, bm, bn, 0.5), "order": order}
              for o, order in enumerate(ORDERS)]
    rows, ok = [], True
    for kw in cases:
        got, sk = sparse_attention_triton(q, k, v, scale, bm, bn, softcap=cap, **kw)
        want, c = sparse_attention(q, k, v, scale, bm, bn, softcap=cap, **kw)
        err, same = float((got.double() - want.double()).abs().max()), bool(torch.equal(sk[0].cpu(), c.skipped.cpu()))
        rows.append({"method": sorted(kw)[0], "order": kw.get("order"), "max_abs_err": err, "skip_counts_equal": same,
                     "skipped": int(c.skipped.sum())})
        ok &= err < tol and same
    return {"ok": bool(ok), "rows": rows}


def _decode_log_lambda(tmax: torch.Tensor, length: int, bn: int) -> float:
    """ln(lambda) between the two middle forward gaps of the decode row's candidate tiles (tmax [B, H, Kb])."""
    gaps = (tmax - torch.cummax(tmax, dim=-1).values)[..., :(length - 1) // bn].flatten().sort().values
    if gaps.numel() < 2:
        return -math.inf
    mid = gaps.numel() // 2
    return (float(gaps[mid - 1]) + float(gaps[mid])) / 2


def _decode(q, k, v, scale, bm, bn, r, cap, tol) -> dict:
    """The last row as a decode query (batch 2): BSFA, BLASST forward / reverse and top-k (half the
    candidates), both schedules."""
    qd = q[:, :, -1:].expand(2, -1, -1, -1).contiguous()
    kd, vd = k.expand(2, -1, -1, -1).contiguous(), v.expand(2, -1, -1, -1).contiguous()
    length = k.shape[2]
    ll = _decode_log_lambda(soft_cap(decode_tile_max(qd, kd, scale, bn), cap), length, bn)
    cases = [{"thresholds": bsfa_thresholds_for(r.bmax, length, bm, bn, 0.5)}, {"log_lambda": ll},
             {"log_lambda": ll, "order": "reverse"}, {"topk": max(1, (length - 1) // bn // 2)}]
    rows, ok = [], True
    for kw in cases:
        want, c = sparse_decode(qd, kd, vd, scale, bm, bn, softcap=cap, **kw)
        for schedule in SCHEDULES:
            got, sk = sparse_decode_triton(qd, kd, vd, scale, bm, bn, schedule=schedule, softcap=cap, **kw)
            err = float((got.double() - want.double()).abs().max())
            same = bool(torch.equal(sk.sum(0).cpu(), c.skipped.cpu()))
            rows.append({"method": sorted(kw)[0], "order": kw.get("order"), "schedule": schedule, "max_abs_err": err,
                         "skip_counts_equal": same, "skipped": int(c.skipped.sum())})
            ok &= err < tol and same
    return {"ok": bool(ok), "rows": rows}


def check_softcap(case) -> dict:
    """One SOFTCAP_CASES shape in every kernel family, each against its reference at the same cap;
    a cap > 0 must change the output (it bites). A family that raises is recorded, not fatal."""
    n, hkv, group, d, bm, bn, dtype, cap = case
    q, k, v = random_qkv(n, d, dtype, hkv * group, hkv, seed=n + 1, sink=True)
    scale, tol = d ** -0.5, OUT_TOL[dtype]
    cfg = StatsConfig(block_m=bm, block_n=bn)
    ref_out, r = instrumented_attention(q, k, v, scale, cfg, softcap=cap)
    res = {"case": dict(n=n, kv_heads=hkv, group=group, d=d, bm=bm, bn=bn, dtype=str(dtype), softcap=cap)}
    if cap:
        plain = instrumented_attention(q, k, v, scale, cfg)[0]
        res["cap_changes_out_by"] = float((plain.double() - ref_out.double()).abs().max())
    families = {"capture_instrumented": lambda: _two_pass(q, k, v, scale, cfg, r, ref_out, cap, tol),
                "capture_single_order": lambda: _one_order(q, k, v, scale, bm, bn, r, ref_out, cap, tol),
                "dense": lambda: _dense(q, k, v, scale, cap, tol),
                "sparse_prefill": lambda: _prefill(q, k, v, scale, bm, bn, r, cap, tol),
                "sparse_decode": lambda: _decode(q, k, v, scale, bm, bn, r, cap, tol)}
    for name, fn in families.items():
        try:
            res[name] = fn()
        except Exception as e:  # a kernel that does not build or run here is recorded, not fatal
            res[name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
            log(f"softcap {res['case']} {name} FAILED: {type(e).__name__}: {str(e)[:200]}")
    res["ok"] = bool(all(res[x]["ok"] for x in families) and (not cap or res["cap_changes_out_by"] > 10 * tol))
    log(f"softcap check n={n} d={d} group={group} {str(dtype)[6:]} cap={cap}: "
        + ", ".join(f"{x} {'ok' if res[x]['ok'] else 'FAILED'}" for x in families))
    return res


def check_refusals() -> dict:
    """fp32 inputs at D = 256 on 128-row query blocks: every kernel that holds such a query tile
    raises ValueError (its host function names the limit) instead of failing to build."""
    q, k, v = random_qkv(130, 256, torch.float32, 2, 1, seed=5)
    calls = {"capture_two_pass": lambda: capture_triton(q, k, v, 0.0625, StatsConfig()),
             "capture_single_order": lambda: capture_triton(q, k, v, 0.0625, StatsConfig(orders=("forward",))),
             "sparse_prefill": lambda: sparse_attention_triton(q, k, v, 0.0625, 128, 64, dense=True)}
    rows = {}
    for name, fn in calls.items():
        try:
            fn()
            rows[name] = "no error"
        except ValueError as e:
            rows[name] = f"ValueError: {e}"
    return {"ok": all(x.startswith("ValueError") for x in rows.values()), "rows": rows}


SECTIONS = {"capture_instrumented": lambda: [check_case(c) for c in CHECK_CASES],
            "capture_single_order": lambda: [check_single(c) for c in CHECK_CASES],
            "sparse": check_kernels,
            "softcap": lambda: [check_softcap(c) for c in SOFTCAP_CASES],
            "refusals": check_refusals}


def _section_ok(rows) -> bool:
    """A section's rows (a list of cases, or one dict) all report ok; a missing section is not ok."""
    if isinstance(rows, list):
        return bool(rows) and all(c["ok"] for c in rows)
    return bool(rows and rows.get("ok"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data/bench/kernel-checks-h100.json"))
    ap.add_argument("--commit", default=None, help="commit to record (the device copy's .git may be stale or absent)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ", ".join(SECTIONS))
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not chosen or set(chosen) - set(SECTIONS):
        ap.error(f"--sections takes names from {', '.join(SECTIONS)}")
    result, save = result_file("kernel-checks", args.out, args.commit)
    for name in chosen:
        run_section(result, name, SECTIONS[name], save)
    oks = {name: _section_ok(result.get(name)) for name in chosen}
    result["ok"] = oks
    save()
    for name, ok in oks.items():
        print(f"{name}: {'ok' if ok else 'FAILED'}", flush=True)
    print(f"-> {args.out}")
    sys.exit(0 if all(oks.values()) and "errors" not in result else 1)


if __name__ == "__main__":
    main()
