"""How many drafts each request verifies in a step: the engine's scheduling decision.

A verify of ``K + 1`` rows costs the target about as much as a decode while the step's rows
are few (the weights are read once whatever the rows); past that, every row costs compute. A
draft is worth its row only while the chance that it is accepted (that it and every draft
before it agree with the target) is worth that cost. So each step, per request:

- ``K = 0`` (a plain decode, no drafting) for a while once the request's recent per-draft
  acceptance falls below ``min_accept``: its drafts would not pay for the drafter's forward and
  the verify rows;
- else, while the step's rows (``requests x B``) fit in ``free_rows``, every draft the block
  holds (``B - 1``);
- else the largest ``K`` whose last draft is still accepted with probability at least
  ``min_value`` (``p ** K >= min_value``).

``K`` is taken from :data:`DRAFT_LENGTHS` so the target's graph shapes stay few (rows per
sequence ``K + 1``). Acceptance is estimated per request from its recent steps (decayed
counts of accepted and rejected drafts over a prior). A request that stopped drafting decodes
for ``1, 2, 4, ...`` steps (up to ``max_wait``) between probes, each probe a step that drafts
again: one accepted draft ends the pause. So a request whose drafts are never accepted (a
drafter that does not fit its target, tau about 1) pays one drafting step in ``max_wait``, and
one whose first steps happened to reject everything loses a step or two, not its drafts.
Greedy output does not depend on ``K``: any ``K`` yields
the target's own tokens. A fixed ``K`` (``draft_length=K`` or :data:`ENV_DRAFT_LENGTH`) is the
lever for benchmarks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from blockdraft._core import ConfigError

ENV_DRAFT_LENGTH = "BLOCKDRAFT_DRAFT_LENGTH"
"""``adaptive`` (the default) or a fixed number of drafts per step."""

DRAFT_LENGTHS = (0, 1, 3, 7, 15)
"""The draft counts an adaptive step chooses from (clipped to the block's ``B - 1``)."""

DraftLength = int | Literal["adaptive"]


def read_draft_length(value: DraftLength | None, env: Mapping[str, str] | None = None) -> DraftLength:
    """``value``, or :data:`ENV_DRAFT_LENGTH` when it is ``None`` (default ``"adaptive"``).

    Raises:
        ConfigError: not ``"adaptive"`` nor an integer >= 0 (the message names the source).
    """
    source = "draft_length"
    if value is None:
        raw = (os.environ if env is None else env).get(ENV_DRAFT_LENGTH, "").strip()
        if not raw:
            return "adaptive"
        source = ENV_DRAFT_LENGTH
        if raw != "adaptive":
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"{ENV_DRAFT_LENGTH}={raw!r} is neither 'adaptive' nor an integer") from None
        else:
            value = "adaptive"
    if value == "adaptive":
        return "adaptive"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{source} must be 'adaptive' or an integer >= 0, not {value!r}")
    return value


def row_classes(block: int, draft_length: DraftLength) -> tuple[int, ...]:
    """Rows per sequence a verify can have, besides a decode's 1: ``K + 1`` for each ``K``
    the policy may choose (a fixed ``K``: that one), always including the full block."""
    ks = DRAFT_LENGTHS if draft_length == "adaptive" else (int(draft_length),)
    return tuple(sorted({min(k, block - 1) + 1 for k in ks if k > 0} | {block}))


@dataclass
class _Counts:
    accepted: float = 0.0
    rejected: float = 0.0
    wait: int = 0  # steps left to decode before the next probe
    pause: int = 0  # the last pause's length (doubles with each failed probe)


@dataclass
class DraftLengthPolicy:
    """Chooses each request's draft count per step (see the module docstring).

    Attributes:
        block: the drafter's block size ``B`` (at most ``B - 1`` drafts).
        fixed: a fixed draft count (``None``: adaptive).
        free_rows: verify rows per step that cost about a decode (the target's GEMMs read
            the weights once for up to about this many rows).
        min_value: past ``free_rows``, the least acceptance probability a step's last draft
            must have.
        min_accept: below this per-draft acceptance a request decodes without drafting.
        decay: the weight of a step's history at the next step (``0.8``: about the last
            five steps count).
        prior: pseudo-counts of accepted and rejected drafts a request starts with.
        max_wait: the longest pause between two probes of a request that stopped drafting.
    """

    block: int
    fixed: int | None = None
    free_rows: int = 128
    min_value: float = 0.3
    min_accept: float = 0.25
    decay: float = 0.8
    prior: tuple[float, float] = (0.8, 0.2)
    max_wait: int = 64
    _counts: dict[int, _Counts] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ValueError(f"block must be >= 1, not {self.block}")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), not {self.decay}")
        if not (0.0 <= self.min_value <= 1.0 and 0.0 <= self.min_accept <= 1.0):
            raise ValueError("min_value and min_accept must be in [0, 1]")
        if self.max_wait < 1:
            raise ValueError(f"max_wait must be >= 1, not {self.max_wait}")

    @classmethod
    def of(cls, block: int, draft_length: DraftLength | DraftLengthPolicy | None) -> DraftLengthPolicy:
        """``draft_length`` itself when it is a policy, else the policy for the value
        :func:`read_draft_length` reads from it (and the environment).

        Raises:
            ConfigError: a bad value (see :func:`read_draft_length`).
        """
        if isinstance(draft_length, DraftLengthPolicy):
            return draft_length
        value = read_draft_length(draft_length)
        return cls(block, fixed=None if value == "adaptive" else int(value))

    def acceptance(self, request_id: int) -> float:
        """The request's estimated chance that a draft is accepted given the one before was."""
        return self._rate(self._counts.get(request_id) or _Counts())

    def _rate(self, c: _Counts) -> float:
        a, r = c.accepted + self.prior[0], c.rejected + self.prior[1]
        return a / (a + r)

    def choose(self, request_ids: Sequence[int]) -> list[int]:
        """Draft counts for one step of these requests (before the engine's clip to each
        request's remaining tokens)."""
        most = self.block - 1
        if self.fixed is not None:
            return [min(self.fixed, most)] * len(request_ids)
        rows_free = len(request_ids) * self.block <= self.free_rows
        out = []
        for rid in request_ids:
            c = self._counts.get(rid)
            if c is not None and c.wait > 0:
                out.append(0)
                continue
            p = self.acceptance(rid)
            k = 0
            for cand in DRAFT_LENGTHS:
                if cand > most:
                    break
                if rows_free or p ** cand >= self.min_value:
                    k = cand
            out.append(k if k > 0 else min(1, most))
        return out

    def observe(self, request_id: int, offered: int, accepted: int) -> None:
        """Record a step: ``offered`` drafts verified, the first ``accepted`` of them taken.
        A step without drafts counts down a pause and lets the history fade toward the prior;
        a drafting step whose estimate falls below ``min_accept``, or a probe that took
        nothing, starts a pause twice as long as the last (one accepted draft resets it)."""
        c = self._counts.get(request_id)
        if c is None:
            c = self._counts[request_id] = _Counts()
        decay = self.decay
        c.accepted *= decay
        c.rejected *= decay
        if offered == 0:
            c.wait = max(0, c.wait - 1)
            return
        c.accepted += accepted
        c.rejected += accepted < offered
        if accepted > 0:
            c.pause = 0
        # A probe that took nothing lengthens the pause even when the faded history is back
        # above the threshold: that history is the prior's, not the request's.
        if c.pause > 0 or self._rate(c) < self.min_accept:
            c.pause = min(max(1, 2 * c.pause), self.max_wait)
            c.wait = c.pause

    def forget(self, request_id: int) -> None:
        """Drop an ended request's history."""
        self._counts.pop(request_id, None)


__all__ = [
    "DRAFT_LENGTHS",
    "ENV_DRAFT_LENGTH",
    "DraftLength",
    "DraftLengthPolicy",
    "read_draft_length",
    "row_classes",
]
