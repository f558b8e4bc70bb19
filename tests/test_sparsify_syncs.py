"""No host synchronisation on sparsify's per-layer attention path: one prefill and one decode step
of a tiny random Llama under every method (the Triton kernels in the interpreter: the CUDA path's
host wrappers; vfa / vsa run their plain-torch reference on every device), with and without an
export's dispatch record.

Inside ``sparse_attention_fn`` (the triton interpreter's own tensor traffic left out) the test
counts the calls that synchronise the host with a CUDA device, as they are made on the CPU:

    scalar  aten._local_scalar_dense: what .item(), int(t), bool(t), float(t) of a tensor call
    h2d     aten.lift_fresh: a tensor made from host data (torch.tensor(python_list), a Python
            list used as an index, a tensor-from-scalar assignment); on CUDA the list cases are a
            blocking pageable host-to-device copy, and the scalar ones cost a tensor each
    d2h     Tensor.tolist / .numpy / .cpu: a device-to-host copy on CUDA

On the CPU none of them waits for anything, but they are the very calls that do on CUDA, so
their count is the regression check: every case reaches zero, except a prefill given an explicit
4D attention mask, which must read the mask once per forward to refuse padding (``MASK_READS``).
"""
import math
import sys
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import sparsecal
from sparsecal.formats.exports import write_blasst
from sparsecal.integrations.exports import write_bsfa

from helpers import INTERPRETER_WARNINGS, dispatch_export, make_checkpoint

pytestmark = INTERPRETER_WARNINGS

PREFILL = 400  # 4 query blocks of 128, up to 6 candidate key blocks of 64: every method skips or freezes
MASK_READS = 1  # a 4D mask is compared with the causal mask once per forward (the first layer that sees it)
HOST_FUNCS = ("tolist", "numpy", "cpu")
NONE = {"scalar": 0, "h2d": 0, "d2h": 0}


def _counting() -> bool:
    """Inside sparsify's attention function and outside the triton interpreter's own traffic."""
    f, inside = sys._getframe(2), False
    while f is not None:
        name = f.f_code.co_filename
        if "triton/runtime/interpreter" in name:
            return False
        inside = inside or (f.f_code.co_name == "sparse_attention_fn" and name.endswith("sparsify.py"))
        f = f.f_back
    return inside


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _counting():
            self.counts["scalar"] += 1
        elif func is torch.ops.aten.lift_fresh.default and _counting():
            self.counts["h2d"] += 1
        return func(*args, **(kwargs or {}))


class _Methods(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_FUNCS and _counting():
            self.counts["d2h"] += 1
        return func(*args, **(kwargs or {}))


def count_syncs(fn) -> dict:
    """{"scalar", "h2d", "d2h"} counts of the calls ``fn()`` makes inside sparse_attention_fn."""
    counts = Counter()
    with _Methods(counts), _Ops(counts):
        fn()
    return {k: counts[k] for k in NONE}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, module_seed):
    """(model, export dir): 2 layers, 4 heads over 2 KV heads, head dim 64; BSFA thresholds -inf (k 1
    and 2), BLASST lambda = 1 / L in prefill and decode (the sparse kernels run)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("syncs")
    path = make_checkpoint(root / "tiny", module_seed, heads=4, kv_heads=2, layers=2)
    exp = root / "e"
    exp.mkdir()
    write_bsfa(exp, torch.full((2, 2, 4, 4), -math.inf), [1, 2], 128, 64, "mean", {"model": "tiny"})
    write_blasst(exp, {"algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": 1.0, "decode": 1.0},
                       "target_sparsity": 0.5, "targets": [], "model": "tiny", "num_layers": 2, "num_heads": 4,
                       "q_block_size": 128, "k_block_size": 64, "schema_version": 1})
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval(), exp


def prefill_and_step(model, seed: int, n: int = PREFILL, mask: bool = False) -> dict:
    """Counts of one n-token prefill (``mask``: with an explicit 4D causal mask) and one decode step."""
    from transformers import DynamicCache

    ids = torch.randint(0, 300, (1, n + 1), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache(config=model.config)
    kw = {"attention_mask": torch.ones(n, n, dtype=torch.bool).tril()[None, None]} if mask else {}
    with torch.no_grad():
        pre = count_syncs(lambda: model(ids[:, :n], past_key_values=cache, use_cache=True, **kw))
        dec = count_syncs(lambda: model(ids[:, n:], past_key_values=cache, use_cache=True))
    return {"prefill": pre, "decode": dec}


CASES = [("bsfa", {"k": 2}), ("bsfa", {"k": 2, "decode": "topk"}), ("blasst", {}),
         ("blasst", {"decode_decision": "group"}), ("window", {"blocks": 1}), ("window_sink", {"blocks": 2}),
         ("blasst_sl", {}), ("blasst_sl", {"decode_decision": "group"}), ("vfa", {}), ("vsa", {}), ("dense", {})]


@pytest.mark.parametrize("method,kw", CASES, ids=[f"{m}-{'-'.join(map(str, k.values()))}" for m, k in CASES])
def test_no_syncs_per_layer(tiny, method, kw, seed):
    model, exp = tiny
    sparsecal.sparsify(model, exp, method=method, backend="triton", **kw)
    try:
        got = prefill_and_step(model, seed)
        assert model.sparsecal_stats["reachable"].sum() > 0  # the step ran sparsify's own kernels, counted
    finally:
        sparsecal.densify(model)
    assert got == {"prefill": NONE, "decode": NONE}


def test_no_syncs_under_a_dispatch_record(tiny, tmp_path, seed):
    """333 tokens under the record of helpers.dispatch_export: layer 0 prefills sparse, layer 1
    through SDPA; under a record with decode entries (test_dispatch_decode), decode steps that the
    plan runs dense go through SDPA (``dense``) or the top-k kernel (BSFA topk at layer 0)."""
    from test_dispatch_decode import _export as decode_export

    model, _ = tiny
    runs = [(dispatch_export(tmp_path / "p"), "bsfa", {"k": 1}),
            (decode_export(tmp_path / "d", (0.1, 0.1), 0.2), "dense", {}),
            (decode_export(tmp_path / "t", (0.1, 0.7)), "bsfa", {"k": 1, "decode": "topk"})]
    for exp, method, kw in runs:
        sparsecal.sparsify(model, exp, method=method, backend="triton", **kw)
        try:
            assert prefill_and_step(model, seed, n=333) == {"prefill": NONE, "decode": NONE}, (exp.name, method)
        finally:
            sparsecal.densify(model)


def test_a_mask_is_read_once_per_forward(tiny, seed):
    """An explicit 4D mask is compared with the causal one (padding is refused) by the first layer
    only: one scalar read per forward, not one per layer."""
    model, exp = tiny
    sparsecal.sparsify(model, exp, method="bsfa", k=2, backend="triton")
    try:
        got = prefill_and_step(model, seed, mask=True)
        with pytest.raises(RuntimeError, match="unpadded"):  # the check still refuses padding
            padded = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
            padded[..., 0] = False
            with torch.no_grad():
                model(torch.zeros(1, 8, dtype=torch.long), attention_mask=padded)
    finally:
        sparsecal.densify(model)
    assert got == {"prefill": dict(NONE, scalar=MASK_READS), "decode": NONE}
