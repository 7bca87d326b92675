"""Goodness-of-fit checks for sampled tokens against exact distributions."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chi2_sf(stat: float, dof: int) -> float:
    """The chi-square distribution's survival function: ``P(X >= stat)`` for ``dof`` degrees."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def assert_counts_fit(counts: torch.Tensor, expected: torch.Tensor, what: object = None) -> None:
    """Observed ``counts`` fit ``expected`` (same shape) by a chi-square test at ``1e-3``;
    cells expecting 5 or fewer are pooled and only bounded."""
    counts, expected = counts.double(), expected.double()
    keep = expected > 5
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert int(counts[~keep].sum()) <= max(10, int(expected[~keep].sum() * 3 + 10))
    assert chi2_sf(stat, int(keep.sum()) - 1) > 1e-3, (what, counts, expected)


def assert_marginals_fit(tokens: Sequence[Sequence[int]], marginals: Sequence[tuple[int, torch.Tensor]],
                         vocab: int, n: int) -> None:
    """For each ``(position, marginal)``, the ``n`` samples' tokens at that position fit the
    marginal (:func:`assert_counts_fit`)."""
    for pos, marg in marginals:
        counts = torch.bincount(torch.tensor([t[pos] for t in tokens]), minlength=vocab)
        assert_counts_fit(counts, marg * n, pos)
