"""Every Triton kernel against its plain-torch reference on the GPU, in one run (no timing):

    python3 -m sparsecal.bench.check [--out data/bench/kernel-checks-h100.json] [--commit <sha>]

- capture, two-pass (kernels/capture/instrumented.py) and the dense forward: ``capture_instrumented.check_case``
  on harness.CHECK_CASES (5 shapes: bf16/fp16/fp32, GQA 1-4, D 64/128, 128x64, 64x32, 80x48);
- capture, one order (kernels/capture/single_order.py, forward_stats.py, mass.py):
  ``capture_single_order.check_single`` on the same shapes, every scan order;
- sparse prefill and decode (kernels/sparse/): ``sparse.check_kernels`` (BSFA, BLASST in three
  orders, window; split-K decode).

Writes the rows with provenance and prints one line per family; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparsecal.bench.capture_instrumented import check_case
from sparsecal.bench.capture_single_order import check_single
from sparsecal.bench.harness import CHECK_CASES, result_file, run_section
from sparsecal.bench.sparse import check_kernels


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data/bench/kernel-checks-h100.json"))
    ap.add_argument("--commit", default=None, help="commit to record (the device copy's .git may be stale or absent)")
    args = ap.parse_args(argv)
    result, save = result_file("kernel-checks", args.out, args.commit)
    run_section(result, "capture_instrumented", lambda: [check_case(c) for c in CHECK_CASES], save)
    run_section(result, "capture_single_order", lambda: [check_single(c) for c in CHECK_CASES], save)
    run_section(result, "sparse", check_kernels, save)
    oks = {"capture_instrumented": all(c["ok"] for c in result.get("capture_instrumented", [{"ok": False}])),
           "capture_single_order": all(c["ok"] for c in result.get("capture_single_order", [{"ok": False}])),
           "sparse": bool(result.get("sparse", {}).get("ok"))}
    result["ok"] = oks
    save()
    for name, ok in oks.items():
        print(f"{name}: {'ok' if ok else 'FAILED'}", flush=True)
    print(f"-> {args.out}")
    sys.exit(0 if all(oks.values()) and "errors" not in result else 1)


if __name__ == "__main__":
    main()
