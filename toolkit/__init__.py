"""sparsecal: calibration and analysis toolkit for block-sparse attention (BSFA, BLASST).

The import package is assembled from the repository's top-level folders (see pyproject):
``sparsecal`` = toolkit/, ``sparsecal.kernels`` = kernels/, ``sparsecal.analysis`` = analysis/,
``sparsecal.dashboard`` = dashboard/. Importing it is cheap: heavy modules (torch, transformers)
are imported by the subpackages that need them.
"""

__version__ = "0.1.0"
SCHEMA_VERSION = 1


def __getattr__(name):
    """``sparsecal.sparsify`` / ``densify`` / ``register`` without importing torch at package import."""
    if name in ("sparsify", "densify", "register"):
        from . import sparse_backend

        return getattr(sparse_backend, name)
    raise AttributeError(f"module 'sparsecal' has no attribute {name!r}")
