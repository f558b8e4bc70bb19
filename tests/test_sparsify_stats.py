"""model.sparsecal_stats (integrations/sparsify_stats.py): the per-row counts are stored, the per-layer
totals are their sums over the batch when read; a total cannot be written; a batch of another size
reallocates the rows as zeros."""
import pytest
import torch

from sparsecal.integrations.sparsify_stats import Stats


def test_totals_are_the_rows_summed_over_the_batch(rng):
    stats = Stats().on("cpu", layers=3, heads=4, batch=2)
    assert set(stats) == {"row_skipped", "row_reachable", "skipped", "reachable"} and len(stats) == 4
    skipped = torch.randint(0, 9, (2, 4), generator=rng)
    stats.record(1, skipped, 11)
    assert torch.equal(stats["skipped"][1], skipped.sum(0)) and not stats["skipped"][[0, 2]].any()
    assert (stats["reachable"][1] == 22).all() and stats["reachable"].shape == (3, 4)
    assert torch.equal(dict(stats.items())["skipped"], stats["skipped"])
    with pytest.raises(KeyError, match="row_skipped"):
        stats["skipped"] = torch.zeros(3, 4)
    same = stats.on("cpu", 3, 4, 2)
    assert same is stats and (stats["row_reachable"][1] == 11).all()  # same shape: kept
    stats.on("cpu", 3, 4, 5)
    assert stats["row_skipped"].shape == (3, 5, 4) and not stats["skipped"].any()
    stats["vfa_rescales"] = torch.ones(3, 4)
    assert len(list(stats.held())) == 3 and "vfa_rescales" in stats
