"""Launch sweep of the group decode kernel (issue 28 part 1), in one GPU call: per shape, every
candidate launch configuration of the dense path (kernels/sparse/decode_group_dense.py, the attend
pass with skipping off as the configuration before the table) and of the 50% / 75% BSFA group
decision (the attend pass: num_warps, num_stages, programs per SM), each checked against the
reference, timed as CUDA-graph replays in round-robin rounds beside every SDPA backend; writes the
rows, the winners and the winning table (``DENSE_TABLE`` entries keyed by (D, G bucket, length
bucket)) with provenance.

    python -m sparsecal.bench.decode --sweep [--dims 128,64] [--groups 1,4,8]
        [--lengths 16384,32768,65536] [--batch 16] [--rounds 5] [--out data/bench/decode-sweep-h100.json]
    TRITON_INTERPRET=1 python -m sparsecal.bench.decode --sweep --quick   # CPU, tiny shapes (a test)

Checks: before the shapes, every dense candidate on ragged contiguous and paged batches (splits 1,
3 and its own: the merge kernel and the fused merge compiled and run) against
``reference.sparse_decode_ragged``; per shape, each candidate's row 0 against
``reference.sparse_decode`` and (dense) every row against the best SDPA's output, (sparse) counts
equal to the default launch's. A candidate that fails a check or does not build is recorded and never
wins.

Shape legend
    B batch   H query heads   Hkv KV heads   G = H / Hkv   D head dim   L cached tokens
"""
from __future__ import annotations

import json
import math
import statistics
import time

import torch
import triton

from sparsecal.bench.decode_inputs import BM, BN, HEADS, SPARSITIES, bisect, bsfa_at, counted, decode_qkv, sdpa_variants
from sparsecal.bench.harness import graph_replay, log
from sparsecal.evaluation.speed_stats import ROUND_ORDER, round_order
from sparsecal.formats.files import atomic_write_text
from sparsecal.formats.provenance import provenance
from sparsecal.kernels.sparse.decode_group import (
    SPARSE_DEFAULT,
    SparseLaunch,
    decode_tile_maxima,
    group_decode_triton,
    sparse_launch_for,
)
from sparsecal.kernels.sparse.decode_group_dense import DENSE_DEFAULT, DenseLaunch, buckets
from sparsecal.kernels.sparse.reference import sparse_decode, sparse_decode_ragged

TOL_BF16 = 3e-2
SPARSE_LAUNCHES = (SPARSE_DEFAULT, SparseLaunch(warps=2, pps=8), SparseLaunch(warps=2, pps=16),
                   SparseLaunch(warps=1, pps=16), SparseLaunch(warps=1, pps=32))   # the decision passes' candidates (decode_group.SparseLaunch)
FUSE_CHUNKS = (2, 8)   # the table's sparse launch again with the fused merge, these many splits at a time (s40)
STAGES = (2, 3, 4)     # and with the other of these pipeline depths (a V load waits on the previous tile's decision)
PPS_SCALES = (0.5, 2)  # and with these multiples of its programs per SM (s42: w2s2p16 7.6-10.5 % faster at D=128 G=8 32K)


def sparse_candidates(d: int, group: int, length: int, quick: bool) -> tuple:
    """The decision passes' launches for one shape, each once: SPARSE_LAUNCHES, the table's launch
    itself, with the fused merge (FUSE_CHUNKS), with the other stage counts (STAGES), with K read
    the other way (plain loads or TMA; s42: the table holds both) at its own and at 2 / 3 stages,
    each load form at the table's programs per SM and its PPS_SCALES multiples, and with step_if (the
    softmax step only on tiles some head keeps) the other way from the table's (alone and with the
    fused merge; s43: the table holds both); quick: the default, the last, one fused launch, the
    fused launch with step_if flipped and one TMA launch."""
    launch = sparse_launch_for(d, group, length)
    table = launch.as_dict()
    fused = tuple(SparseLaunch(**{**table, "fuse": c}) for c in FUSE_CHUNKS)
    staged = tuple(SparseLaunch(**{**table, "stages": n}) for n in STAGES if n != table["stages"])
    loads = tuple(SparseLaunch(**{**table, "tma": tma, "pps": max(1, int(table["pps"] * f))})
                  for tma in (table["tma"], not table["tma"]) for f in (1,) + PPS_SCALES)
    loads += tuple(SparseLaunch(**{**table, "stages": n, "tma": not table["tma"]}) for n in (2, 3))
    flip = not table["step_if"]
    step_if = (SparseLaunch(**{**table, "step_if": flip}), SparseLaunch(**{**table, "step_if": flip, "fuse": 2}))
    if quick:
        return SPARSE_DEFAULT, SPARSE_LAUNCHES[-1], fused[0], step_if[1], SparseLaunch(**{**table, "tma": True})
    return tuple(dict.fromkeys(SPARSE_LAUNCHES + (launch,) + fused + staged + loads + step_if))


def dense_candidates(d: int, group: int, quick: bool) -> dict:
    """name -> DenseLaunch or "attend" (<= 17): the attend pass (before the table), the default
    launch in the new loop, then wave-fitted splits with larger tiles (one wave or two, 3 or 4
    stages, the fused merge, with one wave or two: where the calls are short the merge launch is a
    larger share), more stages, evict-first loads, more programs per SM with 1, 2 or 4 warps (the
    CUDA-core products, slower everywhere in the first sweep, are left out), and one-wave fused
    launches reading K/V by TMA."""
    big = DenseLaunch(block_n=128, warps=8, stages=3 if d <= 64 else 2, waves=2)
    cands = [DENSE_DEFAULT, DenseLaunch(waves=1), DenseLaunch(stages=4, waves=2, evict=True), big,
             DenseLaunch(block_n=128, warps=4, stages=3, waves=2), DenseLaunch(warps=2, stages=4, pps=8),
             DenseLaunch(warps=2, stages=3, pps=16), DenseLaunch(warps=1, stages=4, pps=16),
             DenseLaunch(warps=1, stages=3, pps=32), DenseLaunch(block_n=128, warps=4, stages=4, waves=2),
             DenseLaunch(block_n=128, warps=4, stages=3, waves=1), DenseLaunch(block_n=128, warps=4, stages=3, waves=2,
                                                                             fuse=True),
             DenseLaunch(block_n=128, warps=4, stages=3, waves=1, fuse=True)]   # the chunked fused merge (s39)
    cands += [DenseLaunch(block_n=n, warps=4, stages=st, waves=1, fuse=True, tma=True)   # TMA loads (s40)
              for n, st in ((128, 3), (128, 2), (64, 3))]
    if quick:
        cands = [DENSE_DEFAULT, DenseLaunch(block_n=32, dot=False, waves=2, fuse=True, evict=True),
                 DenseLaunch(block_n=32, waves=1, fuse=True, tma=True)]
    return {"attend": "attend"} | {c.name(): c for c in cands}


def _paged(k, v, lens: list, page: int):
    """Page pools [P, Hkv, page, D] holding rows k/v [B, Hkv, Lmax, D] in shuffled pages, and the
    block table [B, max_pages] int32 (unused slots -1)."""
    b, hkv, _, d = k.shape
    n_pages = [-(-n // page) for n in lens]
    pool_k = torch.zeros(sum(n_pages) + 2, hkv, page, d, dtype=k.dtype, device=k.device)
    pool_v = torch.zeros_like(pool_k)
    table = torch.full((b, max(n_pages)), -1, dtype=torch.int32, device=k.device)
    order = torch.randperm(pool_k.shape[0], generator=torch.Generator().manual_seed(3)).tolist()
    for i, n in enumerate(n_pages):
        for j in range(n):
            p = order.pop()
            table[i, j] = p
            stop = min((j + 1) * page, lens[i])
            pool_k[p, :, : stop - j * page] = k[i, :, j * page: stop]
            pool_v[p, :, : stop - j * page] = v[i, :, j * page: stop]
    return pool_k, pool_v, table


CHECK_SHAPES = ((8, 8, 64), (8, 2, 128), (8, 1, 64))   # (H, Hkv, D) of the dense configuration check


def check_shapes(dims) -> list:
    """The (H, Hkv, D) of CHECK_SHAPES at the head dims ``dims``."""
    return [shape for shape in CHECK_SHAPES if shape[2] in dims]


def check_dense_configs(device, configs: dict, quick: bool, dims: tuple = (64, 128)) -> list:
    """Every dense configuration on ragged batches (contiguous and paged, page 64, lengths 1,
    awkward, a page multiple, longer), G 1 / 4 / 8 at D 64 and G 4 at D 128 (those of ``dims``:
    the head dims a sweep times; on a cold H100 the check of both took ~3.5 minutes, s42), splits
    1 / 3 / its own, against the reference."""
    lens = [1, 77, 128, 333]
    shapes = [(4, 4, 64)] if quick else check_shapes(dims)
    rows = []
    for h, hkv, d in shapes:
        q, k, v = decode_qkv(len(lens), max(lens), d, h // hkv, seed=d + h, dtype=torch.bfloat16, device=device,
                             heads=h)
        lt = torch.tensor(lens, dtype=torch.int32, device=device)
        pk, pv, table = _paged(k, v, lens, 64)
        want, *_ = sparse_decode_ragged(q, k, v, lt, d ** -0.5, 64, 32, log_lambda=-math.inf)
        for name, cfg in configs.items():
            for splits in ((None,) if quick else (None, 1, 3)):
                for layout, kk, vv, bt in (("ragged", k, v, None), ("paged", pk, pv, table)):
                    try:
                        got, sk, vsk = group_decode_triton(q, kk, vv, d ** -0.5, 64, 32, dense=True, lengths=lt,
                                                           block_table=bt, splits=splits, dense_launch=cfg)
                        err = float((got.double() - want.double()).abs().max())
                        ok = err < TOL_BF16 and not sk.any() and not vsk.any()
                    except Exception as e:  # noqa: BLE001  (a configuration that does not build fails its check)
                        err, ok = f"{type(e).__name__}: {str(e)[:200]}", False
                    rows.append({"config": name, "G": h // hkv, "D": d, "layout": layout, "splits": splits,
                                 "max_abs_err": err, "ok": ok})
    return rows


def _time_round_robin(fns: dict, rounds: int, quick: bool) -> tuple[dict, dict]:
    """({name: [ms per round]}, {name: error}) of CUDA-graph replays (wall clock of a call in quick), the
    candidates in ``speed_stats.round_order``."""
    runners, errors = {}, {}
    for name, fn in fns.items():
        try:
            fn()
            if quick:
                runners[name] = fn
                continue
            runners[name] = graph_replay(fn)
        except Exception as e:  # noqa: BLE001  (recorded; the candidate never wins)
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
    times = {name: [] for name in runners}
    for r in range(rounds):
        for name in round_order(runners, r):
            run = runners[name]
            if quick:
                t = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - t) * 1e3)
            else:
                times[name].append(float(triton.testing.do_bench(run, warmup=5, rep=20, return_mode="median")))
    return times, errors


def _bsfa_point(q, k, v, scale: float, target: float) -> torch.Tensor:
    """BSFA thresholds [H, 1] whose group-decision counted sparsity is nearest ``target``."""
    length = k.shape[2]
    tmax = decode_tile_maxima(q, k, scale, BN)
    p = bisect(lambda x: counted(*group_decode_triton(q, k, v, scale, BM, BN, thresholds=bsfa_at(tmax, length, x),
                                                      decision="group")[1:], length)[0], 0.0, 1.0, target)
    return bsfa_at(tmax, length, p)


def shape_candidates(q, k, v, quick: bool) -> dict:
    """name -> (fn, info) of one shape: SDPA backends, dense candidates, sparse candidates."""
    scale = q.shape[-1] ** -0.5
    _, h, _, d = q.shape
    hkv = k.shape[1]
    out = {} if quick else {n: (fn, {"kind": "sdpa"}) for n, fn in sdpa_variants(q, k, v).items()}
    for name, cfg in dense_candidates(d, h // hkv, quick).items():
        out[f"dense_{name}"] = (lambda cfg=cfg: group_decode_triton(q, k, v, scale, BM, BN, dense=True, dense_launch=cfg),
                                {"kind": "dense", "config": cfg if cfg == "attend" else cfg.as_dict()})
    for s in SPARSITIES[-1:] if quick else SPARSITIES:
        thr = _bsfa_point(q, k, v, scale, s)
        for cfg in sparse_candidates(d, h // hkv, k.shape[2], quick):
            out[f"bsfa_group_s{int(s * 100)}_{cfg.name()}"] = (
                lambda thr=thr, cfg=cfg: group_decode_triton(q, k, v, scale, BM, BN, thresholds=thr, decision="group",
                                                             launch=cfg),
                {"kind": "sparse", "target": s, "thresholds": thr, "config": cfg.as_dict()})
    return out


def _check(name: str, fn, info: dict, q, k, v, sdpa_out, refs: dict, counts0: dict) -> dict:
    """A candidate's row-0 error against the reference, (dense) every row against the best SDPA,
    (sparse) counts and V-skip share against the first launch of its sparsity."""
    try:
        got, sk, vsk = fn()
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    scale = q.shape[-1] ** -0.5
    key = "dense" if info["kind"] == "dense" else info["target"]
    if key not in refs:
        kw = {"log_lambda": -math.inf} if key == "dense" else {"thresholds": info["thresholds"], "decision": "group"}
        refs[key] = sparse_decode(q[:1], k[:1], v[:1], scale, BM, BN, **kw)
    want, c = refs[key]
    row = {"err_row0": float((got[:1].double() - want.double()).abs().max())}
    ok = row["err_row0"] < TOL_BF16 and torch.equal(sk[0], c.skipped) and torch.equal(vsk[0], c.v_skipped)
    if info["kind"] == "dense":
        if sdpa_out is not None:
            row["err_vs_sdpa"] = float((got.double() - sdpa_out.double()).abs().max())
            ok &= row["err_vs_sdpa"] < TOL_BF16
    else:
        ref_counts = counts0.setdefault(key, (sk.clone(), vsk.clone()))
        ok &= torch.equal(sk, ref_counts[0]) and torch.equal(vsk, ref_counts[1])
        row["sparsity"], row["v_skip"] = counted(sk, vsk, k.shape[2])
        row["ideal"] = 1.0 / (1.0 - row["v_skip"] / 2.0)
    return row | {"ok": bool(ok)}


def sweep_shape(d: int, group: int, batch: int, length: int, rounds: int, quick: bool, device) -> dict:
    """Every candidate of one shape: checked, timed (graph replays, round-robin), winners."""
    q, k, v = decode_qkv(batch, length, d, group, seed=length + 7 * group + d, dtype=torch.bfloat16, device=device,
                         heads=HEADS if not quick else 4)
    cands = shape_candidates(q, k, v, quick)
    times, errors = _time_round_robin({n: fn for n, (fn, _) in cands.items()}, rounds, quick)
    ms = {n: statistics.median(t) for n, t in times.items()}
    sdpa = {n: t for n, t in ms.items() if cands[n][1]["kind"] == "sdpa"}
    best = min(sdpa, key=sdpa.get) if sdpa else None
    sdpa_out = cands[best][0]() if best else None
    refs, counts0, rows = {}, {}, []
    for name, (fn, info) in cands.items():
        row = {"variant": name, "kind": info["kind"], "config": info.get("config"), "ms": ms.get(name),
               "rounds_ms": times.get(name), "error": errors.get(name)}
        if info["kind"] != "sdpa":
            row |= _check(name, fn, info, q, k, v, sdpa_out, refs, counts0)
            row["ok"] = row["ok"] and name in ms
            row["target"] = info.get("target")
        if best and name in ms:
            row["speedup_vs_sdpa"] = ms[best] / ms[name]
            if "ideal" in row:
                row["of_ideal"] = row["speedup_vs_sdpa"] / row["ideal"]
        rows.append(row)
    del q, k, v, cands, sdpa_out
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"d": d, "group": group, "batch": batch, "length": length, "best_sdpa": best,
            "best_sdpa_ms": sdpa.get(best), "rows": rows, "winners": winners(rows)}


def winners(rows: list) -> dict:
    """The fastest checked candidate of the dense path and of each sparsity (name, config, ms,
    speedup over the best SDPA, share of the ideal)."""
    out = {}
    for key, pick in (("dense", lambda r: r["kind"] == "dense"),
                      ("s50", lambda r: r["kind"] == "sparse" and r["target"] == 0.5),
                      ("s75", lambda r: r["kind"] == "sparse" and r["target"] == 0.75)):
        ok = [r for r in rows if pick(r) and r.get("ok") and r.get("ms")]
        if ok:
            w = min(ok, key=lambda r: r["ms"])
            out[key] = {x: w.get(x) for x in ("variant", "config", "ms", "speedup_vs_sdpa", "v_skip", "of_ideal")}
    return out


def table_of(shapes: list) -> dict:
    """The winning dense launch per table key "D,G bucket,length bucket,batch bucket" (DENSE_TABLE's
    entries)."""
    table = {}
    for s in shapes:
        w = s.get("winners", {}).get("dense")
        if w:
            table[",".join(map(str, buckets(s["d"], s["group"], s["length"], s["batch"])))] = w["config"]
    return table


def run(args, device: str, quick: bool, out) -> dict:
    """The sweep (module docstring); writes ``out`` after every shape."""
    if quick:
        dims, groups, lengths, batch, rounds = [64], [4], [200], 1, 1
    else:
        dims, groups, lengths = ([int(x) for x in a.split(",")] for a in (args.dims, args.groups, args.lengths))
        batch, rounds = args.batch, args.rounds
    result = {"benchmark": "decode-sweep", "provenance": provenance(), "args": vars(args) | {"out": str(out)},
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "round_order": ROUND_ORDER}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1, default=str))

    configs = {}
    for d in dims:
        for g in groups:
            configs |= dense_candidates(d, g, quick)
    result["check"] = check_dense_configs(device, configs, quick, tuple(dims))
    bad = [r for r in result["check"] if not r["ok"]]
    log(f"dense configuration check: {len(result['check']) - len(bad)} ok, {len(bad)} failed {bad[:3]}")
    save()
    result["shapes"] = []
    for d in dims:
        for g in groups:
            for n in lengths:
                t0 = time.perf_counter()
                try:
                    result["shapes"].append(sweep_shape(d, g, batch, n, rounds, quick, device))
                except Exception as e:  # noqa: BLE001  (a failing shape is recorded and the sweep goes on)
                    result["shapes"].append({"d": d, "group": g, "length": n, "error": f"{type(e).__name__}: {e}"[:500]})
                log(f"sweep D={d} G={g} L={n} ({time.perf_counter() - t0:.1f} s): "
                    + json.dumps(result["shapes"][-1].get("winners", result["shapes"][-1].get("error")), default=str))
                result["table"] = table_of(result["shapes"])
                save()
    return result
