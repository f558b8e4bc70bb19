"""Integrations: what takes a fitted run to kernels and serving engines.

    sparsify.py    ``sparsify`` / ``densify`` / ``register``: the sparse kernels as a transformers
                   AttentionInterface, driven by an export
    export.py      ``sparsecal export``: a run's fit -> thresholds.bsfa.pt, thresholds.safetensors,
                   blasst.json
    exports.py     the torch side of the export files (the .pt pickle, thresholds as tensors)
"""
