"""Building FlashInfer's Hopper fmha_v2 prefill module (what ``trtllm_fmha_v2_prefill`` JIT-builds)
for one head dim, in two variants:

- ``stock``: FlashInfer's own module source (``gen_fmha_v2_module``), with the kernel list narrowed
  to the head dims asked for, no ALiBi, no soft-capping, no softmax-stats output (the JIT would
  otherwise compile 88 kernels; the kernels kept are generated unchanged).
- ``stat``: the same kernels compiled with ``-DSKIP_SOFTMAX_STAT``, the kernel's own skip counters
  (``total_blocks`` / ``skipped_blocks``, atomically added by each compute warpgroup at its end;
  FlashInfer never defines the macro). The counters' two device pointers are set, in a copy of
  ``fmha_v2_run.cu``, to the last 8 bytes of the caller's workspace buffer, which the fmha_v2
  allocator fills from the front. ``stat_counts(workspace)`` reads them back.

Both build through FlashInfer's JIT (``gen_jit_spec`` + ninja + nvcc, ``-gencode
arch=compute_90a``) into ``FLASHINFER_WORKSPACE_BASE``, or load a prebuilt ``.so`` from
``prebuilt`` (built on a machine with nvcc and the same flashinfer). ``use_module(mod)`` makes
``flashinfer.prefill.trtllm_fmha_v2_prefill`` run on ``mod``.

Needs flashinfer-python 0.7.2.post1 importable (imported lazily: CPU tests never import it).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

LAYOUT = "SEPARATE_Q_K_V"
STAT_MARK = "run_fmha_v2(params_v2, launch_params"
STAT_LINES = (
    "#ifdef SKIP_SOFTMAX_STAT\n"
    "  // sparsecal: the skip counters live in the workspace's last 8 bytes\n"
    "  params_v2.skip_softmax_total_blocks = reinterpret_cast<uint32_t*>(\n"
    "      static_cast<char*>(workspace_buffer.data_ptr()) + workspace_buffer_size_in_bytes - 8);\n"
    "  params_v2.skip_softmax_skipped_blocks = params_v2.skip_softmax_total_blocks + 1;\n"
    "#endif\n"
)


def restrict_kernels(head_dims: tuple[int, ...], skip_variants: tuple[bool, ...] = (False, True)) -> None:
    """Narrow fmha_v2's kernel enumeration to plain causal/padding bf16 kernels of ``head_dims``."""
    from flashinfer.jit.attention.fmha_v2 import fmha_library as lib

    orig = getattr(lib, "_sparsecal_orig_valid", lib.is_kernel_spec_valid)
    lib._sparsecal_orig_valid = orig

    def valid(kspec) -> bool:
        return (orig(kspec) and kspec.head_size in head_dims and not kspec.alibi
                and not kspec.enable_attn_logit_softcapping and not kspec.return_softmax_stats
                and kspec.enable_skip_softmax in skip_variants)

    lib.is_kernel_spec_valid = valid


def _stat_spec(uri: str):
    """A JitSpec like gen_fmha_v2_module's, compiled with SKIP_SOFTMAX_STAT and the counter lines."""
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.attention.fmha_v2.fmha_library import generate_jit_sources
    from flashinfer.jit.core import current_compilation_context, gen_jit_spec
    from flashinfer.jit.utils import write_if_different

    gen = jit_env.FLASHINFER_GEN_SRC_DIR / uri
    gen.mkdir(parents=True, exist_ok=True)
    sources = generate_jit_sources(uri, LAYOUT, "bf16", "bf16", compilation_context=current_compilation_context)
    csrc = jit_env.FLASHINFER_CSRC_DIR
    run_src = (csrc / "fmha_v2_run.cu").read_text()
    if run_src.count(STAT_MARK) != 1:
        raise RuntimeError("fmha_v2_run.cu changed: the counter lines have no unique place")
    write_if_different(gen / "fmha_v2_run.cu", run_src.replace(STAT_MARK, STAT_LINES + "  " + STAT_MARK))
    write_if_different(gen / "fmha_v2_jit_binding.cu", (csrc / "fmha_v2_jit_binding.cu").read_text())
    sources += [gen / "fmha_v2_run.cu", gen / "fmha_v2_jit_binding.cu"]
    flags = current_compilation_context.get_nvcc_flags_list(supported_major_versions=[9, 12])
    flags += [f"-I{csrc / 'fmha_v2'}", f"-I{gen}", f"-I{jit_env.FLASHINFER_INCLUDE_DIR}",
              "-Wno-deprecated-gpu-targets", "-DSKIP_SOFTMAX_STAT"]
    return gen_jit_spec(uri, sources, extra_cuda_cflags=flags)


def spec(variant: str, head_dim: int):
    """The JitSpec of ``variant`` ('stock' or 'stat') for ``head_dim`` (kernels restricted)."""
    from flashinfer.jit.attention.modules import gen_fmha_v2_module

    if variant == "stock":
        restrict_kernels((head_dim,))
        return gen_fmha_v2_module(LAYOUT, torch.bfloat16)
    if variant == "stat":
        restrict_kernels((head_dim,), (True,))
        return _stat_spec(f"sparsecal_fmha_v2_stat_d{head_dim}")
    raise ValueError(variant)


def build(variant: str, head_dim: int, prebuilt: Path | None = None) -> tuple[object, dict]:
    """Load ``prebuilt/<spec name>.so`` when there, else JIT-build; returns (module, info)."""
    import tvm_ffi

    s = spec(variant, head_dim)
    t0 = time.perf_counter()
    so = (Path(prebuilt) / f"{s.name}.so") if prebuilt else None
    mod, how = None, "jit"
    if so is not None and so.is_file():
        try:
            mod, how = tvm_ffi.load_module(str(so)), f"prebuilt {so.name}"
        except Exception as e:  # a prebuilt that does not load here: JIT-build instead
            how = f"jit (prebuilt failed: {type(e).__name__}: {str(e)[:200]})"
    if mod is None:
        mod = s.build_and_load()
    return mod, {"variant": variant, "name": s.name, "how": how, "seconds": round(time.perf_counter() - t0, 1)}


def use_module(mod) -> None:
    """Route ``flashinfer.prefill.trtllm_fmha_v2_prefill`` to ``mod``."""
    import flashinfer.prefill as fp

    fp.get_trtllm_fmha_v2_module = lambda *a, **k: mod


def zero_stat(workspace: torch.Tensor) -> None:
    """Clear the stat module's counters (the workspace's last 8 bytes)."""
    workspace.view(torch.uint8)[-8:].zero_()


def stat_counts(workspace: torch.Tensor) -> tuple[int, int]:
    """(total_blocks, skipped_blocks) the stat module added since ``zero_stat``."""
    tail = workspace.view(torch.uint8)[-8:].cpu().view(torch.int32).tolist()
    return int(tail[0]) & 0xFFFFFFFF, int(tail[1]) & 0xFFFFFFFF


def main(argv=None) -> None:
    """Build (here, for sm_90a without a GPU: FLASHINFER_CUDA_ARCH_LIST=9.0a) and print the .so paths."""
    import argparse

    ap = argparse.ArgumentParser(description="Build FlashInfer fmha_v2 modules for one head dim.")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--variants", default="stock,stat")
    a = ap.parse_args(argv)
    for variant in a.variants.split(","):
        s = spec(variant, a.head_dim)
        t0 = time.perf_counter()
        s.build()
        print(variant, s.get_library_path(), f"{time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
