"""Evaluation: ``sparsecal eval``, accuracy of every method against dense on held-out prompts.

    command.py     the command: checks before the model loads, per sample dense then each method
    methods.py     the ``--methods`` grammar
    inputs.py      export identity, method/length/Nmax checks, calibration prompts, disjointness
    model.py       switch method, prefill to final hidden states, greedy decode with skip counts
    metrics.py     KL, top-1 agreement and perplexity in position chunks
    store.py       the EVAL directory: manifest, resumable rows
    summary.py     summary tables, dashboard rows, the bench join
"""
