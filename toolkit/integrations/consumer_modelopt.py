"""Model-Optimizer in the loop: an exported ``sparse_attention_config`` block read by Model-Optimizer's
own loader, applied through its Hugging Face path, and its skip decisions counted exactly.

What runs is Model-Optimizer's code (nvidia-modelopt 0.47.0 from PyPI, the ``consumers`` extra);
sparsecal only wires it up and counts. Sources (NVIDIA/Model-Optimizer, tag 0.47.0, package
``modelopt/torch/sparsity/attention_sparsity/``):

- ``plugins/sparse_attn_config.py`` ``load_from_checkpoint_metadata``: block -> the serving
  ``sparse_cfg``: ``*{ignored}*`` -> enable False first, then ``*attn*`` with method
  ``triton_skip_softmax``, backend ``triton``, ``threshold_scale_factor`` and
  ``target_sparse_ratio``; the vLLM plugin matches it first-hit (``match_sparse_config``).
- ``model_sparsify.sparsify`` / ``conversion.set_sparse_attention_by_cfg``: the HF path applies
  ``default`` then every pattern in order, each matching module taking the LAST matching
  pattern's attributes: the loader's order (ignore first, catch-all last) would re-enable the
  ignored layers there. ``hf_path_config`` therefore puts the catch-all first and the ignores
  after it, which gives the loader's first-hit meaning on the HF path (tests pin both).
- ``calibration/calibrate.py`` ends by setting ``calibration_params`` ({phase: {a, b}}) and
  ``target_sparse_ratio`` on every module's method: ``apply`` does the same with the block's law.
- ``methods/flash_skip_softmax.py`` (the HF eager path, backend ``pytorch``: F.softmax patched
  inside each attention module): ``calc_correction_factor_and_p`` decides; its stats hold the
  per-call sparsity as a float and ``total_blocks``; ``ExactCounter`` turns them back into integer
  counts (dense = round((1 - s) * B * H * total_blocks)), where Model-Optimizer's own summary
  truncates per call (``int(s * total_blocks)``).

On the CPU only the pytorch backend runs, so every enabled pattern runs ``flash_skip_softmax``
with backend ``pytorch`` (Model-Optimizer's calibration method: the same 128 x 128 rule its
calibrator measured); the model must use eager attention (``sparsify`` sets it).
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

from sparsecal.formats.errors import UserError

PHASES = ("prefill", "decode")
INSTALL = "install Model-Optimizer with `pip install nvidia-modelopt==0.47.0` (`make install` does it)"


def _mtsa():
    try:
        import modelopt.torch.sparsity.attention_sparsity as mtsa
        from modelopt.torch.sparsity.attention_sparsity.plugins import sparse_attn_config
    except ImportError:
        raise UserError(f"Model-Optimizer is not installed: {INSTALL}.") from None
    return mtsa, sparse_attn_config


def resolve_block(block: dict) -> tuple[dict, str]:
    """(serving sparse_cfg, preset name) of ``block`` by Model-Optimizer's own loader, as vLLM's
    plugin reads a checkpoint's config.json; one line if the loader does not recognise it."""
    _, sac = _mtsa()
    got = sac.load_from_checkpoint_metadata(SimpleNamespace(sparse_attention_config=block))
    if got is None:
        raise UserError("Model-Optimizer's load_from_checkpoint_metadata does not recognise this "
                        "sparse_attention_config; export it again with `sparsecal export RUN --format modelopt`.")
    return got


def hf_path_config(serving: dict) -> tuple[dict, dict, dict]:
    """The serving config as ``mtsa.sparsify`` takes it on the HF path: (config, calibration_params
    {phase: {a, b}}, target_sparse_ratio {phase: S}). Enabled patterns run flash_skip_softmax on
    the pytorch backend; the law moves to the method instances (``apply``); the catch-all pattern
    comes first and the disabled ones after it (the HF path lets the last match win)."""
    cfg = serving.get("sparse_cfg", serving)
    on, off, params, target = {}, {}, None, None
    for pattern, layer in cfg.items():
        layer = dict(layer)
        if pattern == "default" or not layer.get("enable", True):
            off[pattern] = layer
            continue
        tsf = layer.pop("threshold_scale_factor", None)
        target = layer.pop("target_sparse_ratio", None) or target
        if isinstance(tsf, dict):
            params = {m: {"a": float(v["a"]), "b": float(v["b"])} for m, v in tsf.items() if m in PHASES}
        layer.update(method="flash_skip_softmax", backend="pytorch")
        on[pattern] = layer
    if not on or not params:
        raise UserError("the sparse_attention_config enables no calibrated skip_softmax layer; export it again "
                        "with `sparsecal export RUN --format modelopt`.")
    default = {"default": off.pop("default")} if "default" in off else {}
    return {"sparse_cfg": {**default, **on, **off}}, params, dict(target or {})


def apply(model, block: dict, order: str = "hf-safe") -> dict:
    """Sparsify ``model`` (a transformers causal LM) with ``block`` through Model-Optimizer's loader and
    HF path, then set the law on every module as its calibrator does. ``order`` "loader" keeps the
    loader's pattern order (what a user passing its output to sparsify gets). Returns {module name:
    enabled} of the sparse attention modules."""
    mtsa, _ = _mtsa()
    from modelopt.torch.sparsity.attention_sparsity.utils import get_named_sparse_attention_modules

    serving, _ = resolve_block(block)
    cfg, params, target = hf_path_config(serving)
    if order == "loader":
        cfg = {"sparse_cfg": {k: cfg["sparse_cfg"][k] for k in _loader_order(serving, cfg)}}
    mtsa.sparsify(model, cfg)
    out = {}
    for name, module in get_named_sparse_attention_modules(model):
        module._sparse_method_instance.calibration_params = params
        module._sparse_method_instance.target_sparse_ratio = dict(target)
        out[name] = bool(module.is_enabled)
    return out


def _loader_order(serving: dict, cfg: dict) -> list:
    return [k for k in serving.get("sparse_cfg", serving) if k in cfg["sparse_cfg"]]


class ExactCounter:
    """Integer skip counts of Model-Optimizer's flash_skip_softmax, per (phase, target, key).

    ``attach(model)`` wraps each enabled module's ``calc_correction_factor_and_p`` (the real method
    runs; nothing is replaced). ``dense(targets)``: Model-Optimizer's calibration mode (no mask
    applied), the method called once per target S with target_sparse_ratio = S, so one forward
    counts every target. ``masked(S)``: the module's target set to S for both phases and its mask
    applied. ``counts[(phase, S, key)] = [skipped, total]``, ``key`` set by the caller (e.g. the
    sample's length); nothing is counted while ``active`` is False."""

    def __init__(self, mass: bool = False):
        self.counts = defaultdict(lambda: [0, 0])
        self.mass = defaultdict(lambda: [0.0, 0]) if mass else None   # (phase, S, key) -> [kept mass, rows]
        self.key = None
        self.active = True
        self.targets: list | None = None
        self.methods: list = []

    def attach(self, model) -> int:
        from modelopt.torch.sparsity.attention_sparsity.utils import get_named_sparse_attention_modules

        for _, module in get_named_sparse_attention_modules(model):
            if module.is_enabled:
                self._wrap(module._sparse_method_instance)
        return len(self.methods)

    def dense(self, targets: list[float]) -> None:
        self.targets = list(targets)
        for m in self.methods:
            m.set_calibration_mode(True)

    def masked(self, target: float) -> None:
        self.targets = None
        for m in self.methods:
            m.set_calibration_mode(False)
            m.target_sparse_ratio = {p: target for p in PHASES}

    def _wrap(self, method) -> None:
        inner = method.calc_correction_factor_and_p
        self.methods.append(method)

        def counted(attn, phase):
            b, h = attn.shape[:2]
            own = method.target_sparse_ratio.get(phase)
            result = None
            for s in (self.targets if self.targets is not None else [own]):
                method.target_sparse_ratio = dict(method.target_sparse_ratio, **{phase: s})
                result = self._mass_call(method, inner, attn, phase, s) if self.mass is not None else inner(attn, phase)
                self._add(phase, s, b * h * result[1]["total_blocks"], result[1]["sparsity"][0])
            method.target_sparse_ratio = dict(method.target_sparse_ratio, **{phase: own})
            return result

        method.calc_correction_factor_and_p = counted

    def _mass_call(self, method, inner, attn, phase: str, target: float):
        """The method's call with its own element mask computed (even in calibration mode), and the
        softmax mass that mask keeps, summed over rows: the retained mass of its decision."""
        import torch

        calibrating = method._calibration_mode
        method.set_calibration_mode(False)
        try:
            result = inner(attn, phase)
        finally:
            method.set_calibration_mode(calibrating)
        if self.active:
            kept = (torch.softmax(attn.float(), -1) * result[0]).sum(-1)
            acc = self.mass[(phase, target, self.key)]
            acc[0] += float(kept.sum())
            acc[1] += kept.numel()
        return (None, result[1]) if calibrating else result

    def _add(self, phase: str, target: float, total: int, sparsity: float) -> None:
        if not self.active:
            return
        dense = round((1.0 - sparsity) * total)
        row = self.counts[(phase, target, self.key)]
        row[0] += total - dense
        row[1] += total
