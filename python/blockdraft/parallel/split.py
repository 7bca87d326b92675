"""Which sizes a tensor-parallel split divides, and each rank's part of them.

Attention heads, K/V heads and the MLP's intermediate size are split evenly over the ranks:
rank ``r`` of ``n`` owns the ``r``-th of ``n`` equal, consecutive parts. Sizes that do not
divide are refused up front (no K/V head is replicated and no rank gets a ragged part), so every
rank runs the same shapes.
"""

from __future__ import annotations

from collections.abc import Mapping

from blockdraft._core import ConfigError


def check_split(what: str, sizes: Mapping[str, int], tp: int) -> None:
    """Refuse a split of ``sizes`` (name -> count) over ``tp`` ranks that some count does not
    divide.

    Raises:
        ConfigError: naming ``what`` (the model), every count that does not divide, and ``tp``.
        ValueError: ``tp`` below 1.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"the tensor-parallel size must be an int >= 1, not {tp!r}")
    bad = [f"{name}={count}" for name, count in sizes.items() if count % tp]
    if bad:
        names = bad[0] if len(bad) == 1 else f"{', '.join(bad[:-1])} and {bad[-1]}"
        verb = "is" if len(bad) == 1 else "are"
        raise ConfigError(
            f"tensor parallelism {tp} does not split {what}: {names} {verb} not divisible by {tp}"
        )


def part(total: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s consecutive ``total // size`` of ``range(total)`` (``size`` divides
    ``total``: :func:`check_split`)."""
    if total % size:
        raise ValueError(f"{size} ranks do not split {total}")
    each = total // size
    return slice(rank * each, (rank + 1) * each)


__all__ = ["check_split", "part"]
