"""Drafts for many sequences at once, by whichever of the proposer's paths fits each.

The caller decides how many drafts each sequence wants; :func:`draft_many` decides how they are
made: sampled drafts in one forward per group of sequences with the same settings and draft
count (at most :meth:`~blockdraft.DFlashProposer.propose_batch_max` each; every sequence draws
from its own random source, so its drafts are those it would get alone), greedy drafts in
batched forwards of at most :meth:`~blockdraft.DFlashProposer.propose_batch_max`
sequences, and :meth:`~blockdraft.DFlashProposer.propose` per sequence for a sequence under a grammar mask
or in a batch the proposer declines. A sequence whose proposal raises gets the error in its
slot; the others go on.

With ``on_device``, when every sequence wants the same number of greedy drafts without a mask,
the drafts stay on the device (:meth:`~blockdraft.DFlashProposer.propose_on_device` per
group of at most :meth:`~blockdraft.DFlashProposer.propose_batch_max` sequences): the host
launches the drafter's work and goes on, and a consumer on the device (the target's verify)
takes them without the host waiting for the drafter. The drafts come back to the host later,
with whatever is read then (``Drafts.pending``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from blockdraft.proposer.state import DFlashState
from blockdraft.sampling import SamplingParams

if TYPE_CHECKING:
    from blockdraft.proposer.proposer import DFlashProposer

Mask = Tensor | Sequence[int] | Callable[[], Tensor | None]
"""A grammar mask for a sequence's drafts: packed allowed-token bits (see
:meth:`~blockdraft.DFlashProposer.propose`), or a call that gives them (or ``None``: any token) when the
sequence is drafted, so an error making them is that sequence's."""

SampledDraft = tuple[SamplingParams, torch.Generator | None]
"""A sequence's sampling settings and random source, to draft by sampling."""


@dataclass
class Drafts:
    """What :func:`draft_many` made, one slot per sequence.

    Attributes:
        tokens: each sequence's drafts (``[]`` when it wanted none or its proposal failed).
        q: for sampled drafts, the distribution ``[len(tokens[i]), V]`` each draft was drawn
            from (fp32, on the drafter's device); ``None`` for greedy drafts.
        errors: the exception a sequence's proposal raised, or ``None``.
        batched: batched forwards that drafted.
        single: proposals of one sequence.
        pending: with ``on_device``, every sequence's drafts ``[n, k]`` int64 on the device,
            not read yet: ``tokens`` holds ``[]`` for each, and whoever consumes them reads
            them back with its own results (the engine: with its verify's choices). ``None``
            when the drafts are in ``tokens``.
    """

    tokens: list[list[int]]
    q: list[Tensor | None]
    errors: list[BaseException | None]
    batched: int = 0
    single: int = 0
    pending: Tensor | None = None


def draft_many(
    prop: DFlashProposer,
    states: Sequence[DFlashState],
    anchors: Sequence[int],
    positions: Sequence[int],
    want: Sequence[int],
    masks: Sequence[Mask | None] | None = None,
    sampling: Sequence[SampledDraft | None] | None = None,
    on_device: bool = False,
) -> Drafts:
    """Up to ``want[i]`` drafts after ``anchors[i]`` at ``positions[i]`` for each state (none
    when ``want[i] <= 0`` or the block would pass the drafter's positions): see
    :meth:`blockdraft.DFlashProposer.draft`."""
    n = len(states)
    if not len(anchors) == len(positions) == len(want) == n:
        raise ValueError(
            f"draft: {n} states, {len(anchors)} anchors, {len(positions)} positions and "
            f"{len(want)} counts (as many of each)"
        )
    if masks is not None and len(masks) != n:
        raise ValueError(f"draft: {len(masks)} masks for {n} states")
    if sampling is not None and len(sampling) != n:
        raise ValueError(f"draft: {len(sampling)} sampling settings for {n} states")
    out = Drafts(tokens=[[] for _ in range(n)], q=[None] * n, errors=[None] * n)
    # A mask makes a draft greedy and per sequence; else settings that sample draft by sampling.
    single: list[int] = []
    sampled: list[tuple[int, SampledDraft]] = []
    plain: list[int] = []
    if masks is None and sampling is None:
        # Greedy drafts without masks (a serving step's common case): one pass, no sorting.
        plain = [i for i in range(n) if want[i] > 0 and prop.can_draft(positions[i])]
        if on_device and len(plain) == n and want.count(want[0]) == n:
            plain = _draft_on_device(prop, states, anchors, positions, want[0], out)
    else:
        for i in range(n):
            if want[i] <= 0 or not prop.can_draft(positions[i]):
                continue
            how = sampling[i] if sampling is not None else None
            if masks is not None and masks[i] is not None:
                single.append(i)
            elif how is not None and not how[0].greedy:
                sampled.append((i, how))
            else:
                plain.append(i)
    width = prop.propose_batch_max()
    for group in _sampled_groups(sampled, want, width):
        if len(group) >= 2:
            # One forward for the group, each sequence drawing from its own source; if it
            # fails, each sequence is drafted alone below, so an error stays that sequence's.
            try:
                got, q = prop.propose_sampled(
                    [states[i] for i, _ in group], [anchors[i] for i, _ in group],
                    [positions[i] for i, _ in group], want[group[0][0]], group[0][1][0],
                    [how[1] for _, how in group],
                )
            except Exception:  # noqa: BLE001 - retried per sequence
                pass
            else:
                out.batched += 1
                for row, (i, _) in enumerate(group):
                    out.tokens[i] = got[row]
                    out.q[i] = q[row, : len(got[row])]
                continue
        for i, (params, generator) in group:
            try:
                got, q = prop.propose_sampled([states[i]], [anchors[i]], [positions[i]], want[i], params, generator)
                out.tokens[i] = got[0]
                out.q[i] = q[0, : len(got[0])]
                out.single += 1
            except Exception as exc:  # noqa: BLE001 - this sequence fails, the others go on
                out.errors[i] = exc
    if len(plain) >= 2 and width >= 2:
        for c in range(0, len(plain), width):
            chunk = plain[c : c + width]
            got_batch = None
            if len(chunk) >= 2:
                got_batch = prop.propose_batch(
                    [states[i] for i in chunk],
                    [anchors[i] for i in chunk],
                    [positions[i] for i in chunk],
                    max(want[i] for i in chunk),
                )
            if got_batch is not None:
                out.batched += 1
                for i, d in zip(chunk, got_batch):
                    out.tokens[i] = d[: want[i]]
            else:
                single.extend(chunk)
    else:
        single.extend(plain)
    for i in single:
        try:
            mask = masks[i] if masks is not None else None
            bits = mask() if callable(mask) else mask
            out.tokens[i] = prop.propose(states[i], anchors[i], positions[i], want[i], grammar_bitmask=bits)
            out.single += 1
        except Exception as exc:  # noqa: BLE001 - this sequence fails, the others go on
            out.errors[i] = exc
    return out


def _draft_on_device(
    prop: DFlashProposer,
    states: Sequence[DFlashState],
    anchors: Sequence[int],
    positions: Sequence[int],
    want: int,
    out: Drafts,
) -> list[int]:
    """Every sequence's ``want`` greedy drafts left on the device (``out.pending``), in groups
    of at most :meth:`~blockdraft.DFlashProposer.propose_batch_max`. Returns the sequences
    still to draft: none, or those from the first group the proposer declined (the groups
    before it are then read back into ``out.tokens``)."""
    n = len(states)
    width = max(1, prop.propose_batch_max())
    parts: list[Tensor] = []
    for c in range(0, n, width):
        idx = range(c, min(n, c + width))
        got = prop.propose_on_device([states[i] for i in idx], [anchors[i] for i in idx],
                                     [positions[i] for i in idx], want)
        if got is None:
            if parts:
                flat = torch.cat(parts).tolist()
                out.tokens[:c] = flat
            return list(range(c, n))
        if len(idx) > 1:
            out.batched += 1
        else:
            out.single += 1
        # A later group of the same size replays the same graph, whose output this may view.
        parts.append(got.clone() if idx.stop < n else got)
    out.pending = parts[0] if len(parts) == 1 else torch.cat(parts)
    return []


def _sampled_groups(
    sampled: list[tuple[int, SampledDraft]], want: Sequence[int], width: int
) -> list[list[tuple[int, SampledDraft]]]:
    """The sampled sequences in groups that one forward can draft: the same drafting settings
    (temperature, top-p, top-k: drafts are not penalised) and draft count, at most ``width``
    sequences (one each when ``width < 2``), in first-seen order."""
    groups: dict[tuple[float, float, int, int], list[tuple[int, SampledDraft]]] = {}
    for i, how in sampled:
        p = how[0]
        groups.setdefault((p.temperature, p.top_p, p.top_k, want[i]), []).append((i, how))
    size = width if width >= 2 else 1
    return [g[c : c + size] for g in groups.values() for c in range(0, len(g), size)]


__all__ = ["Drafts", "Mask", "SampledDraft", "draft_many"]
