"""sparsecal: calibration and analysis toolkit for block-sparse attention (BSFA, BLASST).

One import package assembled from the repository's top-level folders (see pyproject.toml and
docs/architecture.md): ``sparsecal`` = toolkit/ (formats, capture, integrations, evaluation,
bench, cli), ``sparsecal.kernels`` = kernels/, ``sparsecal.analysis`` = analysis/,
``sparsecal.dashboard`` = dashboard/. Importing it is cheap: torch and transformers load only
with the subpackages that need them.

The user-facing API is ``sparsecal.sparsify`` / ``densify`` / ``register``
(sparsecal.integrations.sparsify). Modules inside the package import their layer's modules
directly, never this one.
"""
from sparsecal.formats.version import SCHEMA_VERSION, __version__

__all__ = ["SCHEMA_VERSION", "__version__", "densify", "register", "sparsify"]


def __getattr__(name):
    """``sparsecal.sparsify`` / ``densify`` / ``register`` without importing torch at package import."""
    if name in ("sparsify", "densify", "register"):
        from sparsecal.integrations import sparsify as module

        return getattr(module, name)
    raise AttributeError(f"module 'sparsecal' has no attribute {name!r}")
