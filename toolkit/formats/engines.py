"""Serving engines' skip-softmax tiles: where each engine decides, in which units, and which
sparsecal geometry (BM x BN) calibrates for it. Facts and their public sources are listed in
docs/formats.md ("Engine tiles"); this module is the table the CLI presets and the exports check.

Every engine skips a key tile when, over the rows of its query tile, the tile's row maxima sit
more than -ln(lambda) below the running max, lambda = threshold_scale_factor / kv_len: the rule
sparsecal's gap statistics record. Engines that compare in log2 units (scores pre-multiplied by
softmax_scale * log2(e), threshold log2(lambda)) make the same decision as ln(lambda) on scores
in natural-log units, so a factor carries over when, and only when, the tiles are the same.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparsecal.formats.errors import UserError, unknown

SCALED_SCORES = "softmax_scale * q.k (the model's attention logits, natural-log units)"


@dataclass(frozen=True)
class Tiles:
    """Where an engine makes its skip decision: a query tile of ``block_m`` rows (prefill) against a
    key tile of ``block_n`` keys; decode rows are tiles of their own against ``block_n`` keys."""

    engine: str
    kernel: str
    block_m: int
    block_n: int
    log_base: str             # "e" or "2": the units the kernel compares in
    score_scale: str          # what the compared scores are
    decode: str               # how the decode decision differs, in words
    source: str               # public source (repository and path) of the numbers

    def geometry(self) -> dict:
        """What every export records about the tiles it was calibrated on."""
        return {"engine": self.engine, "kernel": self.kernel, "block_m": self.block_m, "block_n": self.block_n,
                "decode_block_m": 1, "decode_block_n": self.block_n, "log_base": self.log_base,
                "score_scale": self.score_scale, "decode": self.decode}


def _hopper_kv_step(head_dim: int | None) -> int:
    """TensorRT-LLM's Hopper fmha_v2 warp-specialized BF16/FP16 kernels: 64 query rows per warpgroup
    against 256 keys up to head_dim 64, 128 keys up to 128, 64 keys above."""
    if head_dim is None:
        raise UserError("--engine trtllm-hopper needs the model's head_dim (its key tile depends on it); give "
                        "--block-m 64 --block-n 256|128|64 instead.")
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


def engine_tiles(engine: str, head_dim: int | None = None) -> Tiles:
    """The tiles of ``engine`` (one of ENGINES) for a model of ``head_dim``."""
    if engine == "sparsecal":
        return Tiles("sparsecal", "sparsecal Triton sparse prefill/decode (kernels/sparse)", 128, 64, "e",
                     SCALED_SCORES, "one row per tile, heads decide separately",
                     "this repository: kernels/sparse/prefill.py, docs/design.md")
    if engine == "modelopt":
        return Tiles("modelopt", "Model-Optimizer flash_skip_softmax (calibration and HF eager/Triton backends)",
                     128, 128, "e", "the attention logits Hugging Face eager attention passes to softmax (the "
                     "Triton backend compares in log2 after multiplying by softmax_scale * log2(e): same decision)",
                     "one row against 128-key tiles (br = 1), heads decide separately",
                     "NVIDIA/Model-Optimizer modelopt/torch/sparsity/attention_sparsity/config.py (br, bc = 128), "
                     "methods/flash_skip_softmax.py")
    if engine == "trtllm":
        return Tiles("trtllm", "trtllm-gen FMHA (Blackwell; TensorRT-LLM, and SGLang / vLLM through FlashInfer)",
                     128, 128, "2", "scores * softmax_scale * log2(e) against log2(factor / kv_len): the same "
                     "decision as ln(lambda) on scaled scores",
                     "128-key tiles; the query heads of a GQA group share one tile and skip together",
                     "NVIDIA/TensorRT-LLM cpp/tensorrt_llm/kernels/trtllmGenKernels/fmha (kernels named "
                     "...SkipsSoftmaxQ128Kv128...), flashinfer-ai/flashinfer PR 2477")
    if engine == "trtllm-hopper":
        return Tiles("trtllm-hopper", "TensorRT-LLM fmha_v2 warp-specialized prefill (Hopper); XQA decode", 64,
                     _hopper_kv_step(head_dim), "e", "exp(tile row max - running max) < factor / kv_len (the "
                     "kernel's own statement of the rule)",
                     "XQA: the query heads of a GQA group share one tile and skip together",
                     "NVIDIA/TensorRT-LLM cpp/kernels/fmha_v2/src/fmha/warpspec/compute.h, kernel_traits.h, "
                     "setup.py (q_step x kv_step in the kernel names)")
    raise unknown("engine", engine, ENGINES)


ENGINES = ("sparsecal", "modelopt", "trtllm", "trtllm-hopper")
# Export formats, the engines that read them, and the file each is written to.
FORMATS = {
    "modelopt": (("modelopt",), "modelopt.config.json"),
    "trtllm": (("trtllm", "trtllm-hopper"), "trtllm.yaml"),
    "sglang": (("trtllm",), "sglang.env"),
    "vllm": (("modelopt",), "vllm.serve"),
}
# Formats whose engine reads Model-Optimizer's config.json block (the a * exp(b * S) law, ``ignore``).
BLOCK_FORMATS = ("modelopt", "vllm")


def parse_formats(text: str | None) -> list[str]:
    """``--format modelopt,trtllm`` (or ``all``) -> the format names, in FORMATS order."""
    if not text:
        return []
    names = [x.strip() for x in text.split(",") if x.strip()]
    if "all" in names:
        return list(FORMATS)
    for n in names:
        if n not in FORMATS:
            raise unknown("export format", n, list(FORMATS) + ["all"])
    return [f for f in FORMATS if f in names]


def matching_tiles(fmt: str, block_m: int, block_n: int, head_dim: int | None) -> Tiles | None:
    """The engine tiles of ``fmt`` that a run of block_m x block_n calibrates, or None."""
    for eng in FORMATS[fmt][0]:
        if eng == "trtllm-hopper" and head_dim is None:
            continue
        t = engine_tiles(eng, head_dim)
        if (t.block_m, t.block_n) == (block_m, block_n):
            return t
    return None


def check_format_geometry(fmt: str, run: str, block_m: int, block_n: int, head_dim: int | None) -> Tiles:
    """The tiles ``fmt`` is written for, or one UserError line saying how to capture for it."""
    t = matching_tiles(fmt, block_m, block_n, head_dim)
    if t is not None:
        return t
    eng = FORMATS[fmt][0][0]
    want = engine_tiles(eng, head_dim)
    raise UserError(f"--format {fmt} needs a run captured at {eng}'s {want.block_m} x {want.block_n} tiles, but {run} "
                    f"was captured at {block_m} x {block_n}: capture for it with `sparsecal capture --engine {eng} "
                    f"...` and fit with `sparsecal fit RUN --engine {eng}`.")


def check_run_geometry(engine: str, run: str, block_m: int, block_n: int, head_dim: int | None) -> Tiles:
    """``sparsecal fit --engine``: the run must have been captured at the engine's tiles."""
    t = engine_tiles(engine, head_dim)
    if (t.block_m, t.block_n) != (block_m, block_n):
        raise UserError(f"{run} was captured at {block_m} x {block_n} tiles, but {engine} skips on {t.block_m} x "
                        f"{t.block_n} tiles: capture for it with `sparsecal capture --engine {engine} ...`.")
    return t


def preset_blocks(engine: str, head_dim: int | None, given: dict) -> tuple[int, int]:
    """``sparsecal capture --engine``: (BM, BN) of the engine; an explicit --block-m/--block-n
    (``given``: the values the user typed, by option name) must agree with it."""
    t = engine_tiles(engine, head_dim)
    for name, want in (("block-m", t.block_m), ("block-n", t.block_n)):
        if given.get(name) is not None and given[name] != want:
            raise UserError(f"--engine {engine} captures at {t.block_m} x {t.block_n} tiles, but --{name} "
                            f"{given[name]} was given: leave out --{name}, or leave out --engine.")
    return t.block_m, t.block_n


# What each consumer of a format does where lambda = factor / kv_len >= 1 (kv_len <= factor): none
# runs dense there as sparsecal's runtime does. (short name, consumer, what it does, source): a
# behaviour saying "dense" leaves attention exact, any other changes the output. docs/formats.md
# "Served lengths" cites the commits read.
MO = "NVIDIA/Model-Optimizer modelopt/torch/sparsity/attention_sparsity/"
CONSUMERS = {
    "modelopt": (
        ("Model-Optimizer HF", "Model-Optimizer HF path",
         "skips every tile, the diagonal included: the output changes",
         MO + "methods/flash_skip_softmax.py (block_max - cummax > ln(lambda) keeps a tile; never true at >= 0)"),
        ("Model-Optimizer vLLM plugin", "Model-Optimizer vLLM plugin",
         "turns skipping off for the launch (lambda from the batch's longest sequence): dense",
         MO + "plugins/vllm.py (_resolve_skip_softmax_calibration)")),
    "trtllm": (
        ("trtllm-gen", "TensorRT-LLM trtllm-gen (Blackwell)",
         "skips every tile but each row's first: the output changes",
         "NVIDIA/TensorRT-LLM trtllm-gen FMHA (docs/formats.md, Consumer decision rules)"),
        ("fmha_v2", "TensorRT-LLM fmha_v2 prefill (Hopper)",
         "exp(gap) < lambda holds for every candidate tile: the output changes",
         "NVIDIA/TensorRT-LLM cpp/kernels/fmha_v2/src/fmha/warpspec/compute.h"),
        ("XQA decode", "TensorRT-LLM XQA decode (Hopper)", "turns skipping off where kv_len < factor: dense",
         "NVIDIA/TensorRT-LLM cpp/kernels/xqa/test/refAttention.cpp (disableSkipForShortSeq)")),
    "sglang": (
        ("trtllm-gen", "SGLang on FlashInfer trtllm-gen (SM100/SM103)",
         "skips every tile but each row's first: the output changes",
         "sgl-project/sglang python/sglang/srt/layers/attention/trtllm_mha_backend.py"),
        ("XQA decode", "SGLang decode on SM90/SM120 (FlashInfer XQA)",
         "never receives the decode factor: dense at every length",
         "flashinfer-ai/flashinfer flashinfer/decode.py (trtllm_batch_decode_with_kv_cache: backend auto)")),
    "vllm": (
        ("Model-Optimizer vLLM plugin", "vLLM through Model-Optimizer's plugin",
         "turns skipping off for the launch (lambda from the batch's longest sequence): dense",
         MO + "plugins/vllm.py (_resolve_skip_softmax_calibration)"),),
}


def parse_serve_lengths(text: str | None) -> tuple[int, int | None] | None:
    """``--serve-lengths MIN[-MAX]`` -> (MIN, MAX or None); None when not given."""
    if text is None:
        return None
    parts = text.strip().split("-")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        nums = []
    if len(nums) not in (1, 2) or any(n < 1 for n in nums) or (len(nums) == 2 and nums[0] > nums[1]):
        raise UserError(f"--serve-lengths {text!r} is not MIN or MIN-MAX (positive token counts, MIN <= MAX); give "
                        "e.g. 1024 or 512-8192.")
    return nums[0], (nums[1] if len(nums) == 2 else None)


def parse_length_weights(text: str) -> dict[int, float]:
    """``--length-weights 1024:0.5,4096:0.5`` -> {length: weight} (repeated lengths add up)."""
    out: dict[int, float] = {}
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        n, sep, w = item.partition(":")
        try:
            n, w = int(n), float(w)
        except ValueError:
            n, w = 0, float("nan")
        if not sep or n < 1 or not (w >= 0.0) or w == float("inf"):
            raise UserError(f"--length-weights: {item!r} is not LENGTH:WEIGHT (a positive token count and a finite "
                            "weight >= 0); give e.g. 1024:0.5,4096:0.5, or a prompts file (JSONL).")
        out[n] = out.get(n, 0.0) + w
    if not out or sum(out.values()) <= 0:
        raise UserError(f"--length-weights {text!r} holds no positive weight; give e.g. 1024:0.5,4096:0.5.")
    return out
