"""Evaluation: ``sparsecal eval``, accuracy of every method against dense on held-out prompts.

    command.py     the command: checks before the model loads, the rows, the timing phase, the summary
    rows.py        a batch of prompts of one length through every method (dense first): one row each
    methods.py     the ``--methods`` grammar
    inputs.py      export identity, method/length/Nmax checks, calibration prompts, disjointness
    model.py       switch method, prefill to final hidden states, greedy decode with skip counts
    metrics.py     KL, top-1 agreement and perplexity in position chunks
    store.py       the EVAL directory: manifest, resumable rows
    summary.py     summary tables, dashboard rows, the bench join
    intervals.py, paired.py   intervals and exact paired tests; timing.py the timing phase;
    laws.py, report.py        BLASST law notes; the printed summary
"""
