"""The floor of sparsecal: file formats and the facts every layer shares, without torch.

    version.py       __version__ and SCHEMA_VERSION (written into every file, checked on read)
    errors.py        UserError: one line that says what is wrong and what to do (exit code 2)
    files.py         atomic writes and the checked JSON-manifest reader (kind, schema, remedy)
    geometry.py      block geometry of causal tiles as integer arithmetic, scan orders
    stats_config.py  StatsConfig: what a capture computes and how it bins it
    tensors.py       safetensors files with the (idx, val) encoding of mostly-zero histograms
    run.py           the run directory: manifest, atomic samples, resume
    exports.py       export files: BSFA thresholds (safetensors side), blasst.json
    results.py       Accuracy-speedup result files (eval and bench rows)
    provenance.py    machine, versions, commit and date of a result

Everything here imports only the standard library, numpy, safetensors and polars, so the
dashboard and the analysis read every file the capture writes without loading torch.
"""
