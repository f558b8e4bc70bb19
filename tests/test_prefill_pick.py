"""kernels/sparse/prefill_pick.py: which prefill kernel a call gets (the rule measured on the H100,
data/bench/NOTES.md "prefill-gluon-ws"), and that without a Hopper GPU every call runs the Triton
twin with the same results."""
import pytest
import torch

from sparsecal.kernels.sparse.prefill import method_code, sparse_attention_triton
from sparsecal.kernels.sparse.prefill_pick import WS_FROM, pick, sparse_prefill

DENSE, BSFA, BLASST, WINDOW = (method_code(*a) for a in ((None, None, None, True), (1, None, None, False),
                                                         (None, -1.0, None, False), (None, None, 2, False)))


@pytest.mark.parametrize("d,method,expected,kernel", [
    (64, BSFA, None, "gluon_ws"), (64, DENSE, None, "gluon_ws"), (64, WINDOW, 0.9, "gluon_ws"),
    (64, BSFA, 0.0, "gluon_ws"), (64, BSFA, 0.9, "gluon_ws"),  # D = 64: the ws kernel at every sparsity (s47)
    (64, BLASST, 0.9, "gluon_ws"), (64, BLASST, None, "gluon_ws"),
    (128, DENSE, None, "gluon_ws"),                     # skipping off: the warp-specialized kernel is faster
    (128, BSFA, None, "gluon"), (128, BLASST, WS_FROM - 0.01, "gluon"),  # little or unknown skipping
    (128, BSFA, WS_FROM, "gluon_ws"), (128, BLASST, 0.9, "gluon_ws"),
    (128, WINDOW, 0.9, "gluon"), (256, BSFA, 0.9, "triton"), (96, DENSE, None, "triton")])
def test_pick(d, method, expected, kernel):
    assert pick(d, method, expected) == kernel


@pytest.mark.parametrize("d", [64, 128])
def test_without_hopper_every_call_runs_the_triton_twin(d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 200, d, generator=g) for _ in range(3))
    thr = torch.full((2, 2), 0.5)
    for hint in (None, 0.9):
        got, sk = sparse_prefill(q, k, v, d ** -0.5, 128, 64, thresholds=thr, expected_sparsity=hint)
        want, sk_want = sparse_attention_triton(q, k, v, d ** -0.5, 128, 64, thresholds=thr)
        assert torch.equal(got, want) and torch.equal(sk, sk_want)
