"""Benchmark: how long each dashboard page takes to be interactive after a control changes, on a
run of SmolLM2's shape at 8K tokens with 64 samples (issue 7: <= 2 s per page).

The run is synthetic in the real run format (toolkit/bench/synthetic.py): 30 layers x 9 heads,
64 samples of 8192 tokens (64 query blocks x 128 key blocks), default geometry, k values, orders
and bins, fitted with `fit_run` defaults and exported. What the dashboard reads and draws depends
on this shape, not on the values (table sizes, gap_cum [1, 30, 9, 3, 101], raw tile slices
[64, 128]). Raw tiles (fp16, --raw layout: bmax/mass [30, 9, 64, 128], gap [30, 9, 3, 64, 128])
are random values masked to the causal geometry, written for every sample. An Accuracy-speedup
result file in the documented format (toolkit/formats/results.py) with made-up points gives that page
a chart to draw.

Timing is the browser test's (sparsecal.dashboard.drive): `sparsecal dashboard` on a free port,
Debian's headless Chromium; per page, one visit through the sidebar, then ``--repeats`` changes of
the page's control (PAGE_ACTIONS, alternating between two values); each time runs from just before
the input event until the script run has finished, nothing is stale and every plotly chart has
drawn. The first change after a visit can miss the caches (a new length, layer or sample).

    python -m sparsecal.bench.dashboard [--dir /tmp/sparsecal-dashboard-bench] [--repeats 5] [--out data/bench/dashboard.json]
    python -m sparsecal.bench.dashboard --run RUN --out FILE     # any fitted run, measured as it is
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from sparsecal.analysis.fit import FitRequest, fit_run
from sparsecal.bench.synthetic import write_synthetic_run
from sparsecal.formats.provenance import provenance
from sparsecal.formats.run import RunStore
from sparsecal.formats.stats_config import StatsConfig
from sparsecal.integrations.export import export_run

LENGTH, SAMPLES, LAYERS, HEADS = 8192, 64, 30, 9
TARGET_S = 2.0


def _raw_tiles(rng, cfg: StatsConfig, n: int) -> dict:
    """Random fp16 raw tiles of the --raw layout, -inf (bmax, gap) / 0 (mass) off the causal region."""
    import torch

    from sparsecal.formats.geometry import tile_kinds

    kind = tile_kinds(n, cfg.block_m, cfg.block_n)
    reach = kind > 0
    shape = (LAYERS, HEADS) + kind.shape
    bmax = np.where(reach, rng.normal(8.0, 3.0, shape), -np.inf)
    gap = np.where(reach, -rng.exponential(2.0, (LAYERS, HEADS, len(cfg.orders)) + kind.shape), -np.inf)
    mass = np.where(reach, rng.dirichlet(np.ones(kind.shape[1]), shape[:3]), 0.0)
    mass = np.where(reach, mass / np.maximum((mass * reach).sum(-1, keepdims=True), 1e-9), 0.0)
    return {k: torch.from_numpy(v.astype(np.float16)) for k, v in
            (("raw_bmax", bmax), ("raw_gap", gap), ("raw_mass", mass))}


def _results(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"method": m, "config": c, "length": LENGTH, "accuracy_rel_dense": 1.0 - 0.1 * x, "speedup": 1.0 + 2 * x}
            for m, cs in (("bsfa", ("k=64", "k=32", "k=16")), ("blasst", ("target=0.5", "target=0.7")))
            for x, c in zip((0.2, 0.5, 0.8), cs)]
    (folder / "made-up.json").write_text(json.dumps({"kind": "sparsecal-bench", "rows": rows, "provenance": {}}))
    return folder


def ensure_run(root: Path) -> RunStore:
    """The synthetic 64 x 8K run with raw tiles, fit and export (reused when complete)."""
    if (root / "export" / "blasst.json").is_file() and len(RunStore.open(root).done_ids()) == SAMPLES:
        return RunStore.open(root)
    shutil.rmtree(root, ignore_errors=True)
    t = time.perf_counter()
    store = write_synthetic_run(root, [LENGTH], SAMPLES, layers=LAYERS, heads=HEADS, a=300.0, a_decode=30.0,
                                target=0.5, seed=0, progress=lambda i, n: print(f"  sample {i}/{n}", flush=True))
    from sparsecal.formats.tensors import save_tensors

    cfg, rng = StatsConfig.from_dict(store.manifest["config"]), np.random.default_rng(1)
    for i, sid in enumerate(sorted(store.done_ids())):
        save_tensors(root / "samples" / sid / "raw.safetensors", _raw_tiles(rng, cfg, LENGTH),
                     metadata={"schema_version": store.manifest["schema_version"], "sample": sid})
        print(f"  raw tiles {i + 1}/{SAMPLES}", flush=True)
    fit_run(store, FitRequest(), warn=lambda line: print("  warning:", line))
    export_run(store, root / "export")
    print(f"run written, fitted and exported in {time.perf_counter() - t:.0f} s", flush=True)
    return store


def measure(root: Path, results: Path, repeats: int, shots: Path | None) -> dict:
    """Per page: visit seconds and ``repeats`` control-change seconds, in Chromium."""
    from playwright.sync_api import sync_playwright

    from sparsecal.dashboard import drive

    pages = {}
    log = (shots or Path("/tmp")) / "dashboard-bench-server.log"
    with drive.DashboardServer([root], results=[results], log_path=log) as srv, sync_playwright() as pw:
        browser = drive.chromium(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        t = time.perf_counter()
        drive.open_app(page, srv.url)
        first_load = time.perf_counter() - t
        for title in drive.PAGES:
            visit = drive.visit(page, title)
            if not drive.has_control(page, drive.PAGE_ACTIONS[title]):
                pages[title] = {"visit_s": visit, "skipped": f"no control {drive.PAGE_ACTIONS[title]} on the page",
                                "infos": drive.page_report(page)["infos"]}
                print(f"  {title:17s} visit {visit:5.2f} s  (no control to change: {pages[title]['infos']})")
                continue
            changes = [drive.change(page, drive.PAGE_ACTIONS[title]) for _ in range(repeats)]
            rep = drive.page_report(page)
            if shots:
                page.screenshot(path=str(shots / f"{title}.png"), full_page=True)
            pages[title] = {"action": list(drive.PAGE_ACTIONS[title]), "visit_s": visit, "change_s": changes,
                            "median_s": statistics.median(changes), "max_s": max(changes),
                            "charts": rep["charts"], "errors": rep["errors"]}
            print(f"  {title:17s} visit {visit:5.2f} s  change median {pages[title]['median_s']:.2f} s "
                  f"max {pages[title]['max_s']:.2f} s  ({rep['charts']} charts)", flush=True)
        browser.close()
    return {"first_load_s": first_load, "pages": pages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/sparsecal-dashboard-bench"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("data/bench/dashboard.json"))
    ap.add_argument("--screenshots", type=Path, default=Path("test-artifacts/dashboard-bench"))
    ap.add_argument("--run", type=Path, default=None,
                    help="measure this fitted run as it is instead of the synthetic one (nothing is written into it)")
    args = ap.parse_args()
    root = args.run or args.dir
    if args.run is None:
        ensure_run(args.dir)
    args.screenshots.mkdir(parents=True, exist_ok=True)
    m = measure(root, _results(Path(f"{args.dir}-results")), args.repeats, args.screenshots)
    worst = max(p["max_s"] for p in m["pages"].values() if "max_s" in p)
    man = RunStore.open(root).manifest
    done = RunStore.open(root).done_ids()
    run = {"path": str(root), "kind": "synthetic, SmolLM2 shape" if args.run is None else "as given",
           "model": man["model"]["id"], "layers": man["model"]["num_layers"], "heads": man["model"]["num_heads"],
           "lengths": sorted({s["length"] for s in man["samples"] if s["id"] in done}), "samples": len(done),
           "raw_tiles": any((root / "samples" / d / "raw.safetensors").is_file() for d in done),
           "fit_bytes": sum(p.stat().st_size for p in (root / "fit").iterdir())}
    result = {"benchmark": "dashboard", "run": run, "repeats": args.repeats,
              "accuracy_speedup_input": "made-up points in the toolkit/formats/results.py format (no eval/bench yet)",
              **m, "worst_change_s": worst,
              "target_s": TARGET_S, "command": "python -m sparsecal.bench.dashboard"
              + (f" --run {args.run} --out {args.out}" if args.run else ""), "provenance": provenance()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"worst page {worst:.2f} s after a control change (target <= {TARGET_S} s) -> {args.out}")


if __name__ == "__main__":
    main()
