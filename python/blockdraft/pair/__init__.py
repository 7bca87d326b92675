"""Everything about a target + drafter pair: the drafter's config fields
(:class:`DrafterShape`), the named shapes and random pairs built at them, the checks that a
drafter fits a target and that a prompt fits the context, and (:mod:`blockdraft.pair.load`)
which pair a command runs and loading it.

:mod:`blockdraft.pair.load` is not imported here: it reads model directories and loads
weights through transformers, which the target and proposer modules that import the checks
do not need.
"""

from __future__ import annotations

from blockdraft.pair.checks import check_context, check_fits, context_problem
from blockdraft.pair.shape import (
    DEMO_SHAPE,
    SHAPES,
    DrafterShape,
    Shape,
    default_dtype,
    random_drafter,
    random_pair,
    random_target,
)

__all__ = [
    "DEMO_SHAPE",
    "SHAPES",
    "DrafterShape",
    "Shape",
    "check_context",
    "check_fits",
    "context_problem",
    "default_dtype",
    "random_drafter",
    "random_pair",
    "random_target",
]
