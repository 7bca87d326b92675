"""Acceptance decided where the verify logits are: greedy and rejection sampling on the device.

A request whose target distribution is the logits at a temperature, top-k and top-p (no
penalties, no grammar mask, no stop tokens held back by ``min_tokens``) is decided here for
every such request of a step at once, with a fixed number of launches whatever the batch, and
the host reads one ``[n, 2]`` tensor (accepted drafts, next token) at the end. The host path
(:mod:`blockdraft.engine.accept`) copies a sampled request's ``1 + drafts`` rows of ``V``
logits to the host and decides them row by row; here only the answer travels.

Rejection sampling is the same rule as :func:`~blockdraft.sampling.accept_draft`: draft ``d``
at row ``j`` is accepted when ``u·q_j(d) < p_j(d)`` (``q`` the draft distribution, one-hot for a
greedy draft); the first rejected row's token is drawn from ``norm(max(0, p_j - q_j))``, and
after every draft is accepted the bonus token from the last row's ``p``. The uniforms come
from each request's own generator on the host (``2·drafts + 1`` per step, drawn whether used or
not, so the stream a seed gives does not depend on where the rows live), and a token is drawn
by :func:`~blockdraft.sampling.inverse_cdf`, as every draw of the package is.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch
from torch import Tensor

from blockdraft.engine.request import Request
from blockdraft.sampling import inverse_cdf, target_probs


def on_device(r: Request) -> bool:
    """Whether ``r``'s verify rows are decided on the device: nothing but temperature,
    top-k and top-p shapes its target distribution."""
    return r.mask_fn is None and not r.params.penalised and not r.holds_stops()


def _segments(lengths: Sequence[int], offsets: Sequence[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """For rows laid out request after request (``lengths[i]`` rows each, request ``i`` from
    row ``offsets[i]``): each row's request index and its rank inside its request."""
    counts = torch.tensor(lengths, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    rank = torch.arange(offsets[-1]) - torch.tensor(offsets[:-1], dtype=torch.int64)[owner]
    return owner.to(device, non_blocking=True), rank.to(device, non_blocking=True)


def _first_rejected(ok: Tensor, owner: Tensor, rank: Tensor, n: int, last: Tensor) -> Tensor:
    """Per request the rank of its first row that is not ``ok`` (a request's last row, the
    bonus row, never is): the number of accepted drafts."""
    big = torch.iinfo(torch.int64).max
    ranks = torch.where(ok, torch.full_like(rank, big), rank)
    first = torch.full((n,), big, dtype=torch.int64, device=ok.device)
    first.scatter_reduce_(0, owner, ranks, reduce="amin")
    return torch.minimum(first, last)


def decide_on_device(
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],
    logits: Tensor,
    draft_q: Sequence[Tensor | None],
    uniforms: Sequence[Tensor | None],
) -> Tensor:
    """``[n, 2]`` int64 on the logits' device: per request (accepted drafts, next token).

    Args:
        requests: requests :func:`on_device` accepts.
        drafts: each request's drafts.
        logits: ``[R, V]``, request ``i``'s ``1 + len(drafts[i])`` rows back to back.
        draft_q: per request the ``[len(drafts[i]), V]`` distribution its drafts were drawn
            from, ``None`` for greedy drafts.
        uniforms: per request ``None`` when greedy, else ``2·len(drafts[i]) + 1`` uniforms in
            ``[0, 1)``: one per draft for acceptance, then one per row for a draw.

    Every row is first decided greedily (its argmax against its draft); the sampled
    requests' rows alone are then decided by rejection sampling, so the ``[rows, V]``
    temporaries of sampling are as large as the sampled requests' rows, not the batch's.
    """
    dev = logits.device
    n = len(requests)
    lengths = [len(d) + 1 for d in drafts]
    offsets = list(accumulate(lengths, initial=0))
    owner, rank = _segments(lengths, offsets, dev)
    starts = torch.tensor(offsets[:-1], dtype=torch.int64).to(dev, non_blocking=True)
    last = torch.tensor([x - 1 for x in lengths], dtype=torch.int64).to(dev, non_blocking=True)
    # Row j's draft (the draft it verifies); a request's last row has none (-1).
    row_draft = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.int64).to(dev, non_blocking=True)
    choice = torch.argmax(logits, dim=-1)
    ok = (row_draft >= 0) & (choice == row_draft)
    token = choice
    sampled = [i for i in range(n) if not requests[i].params.greedy]
    if len(sampled) == n:
        ok, token = _decide_sampled(requests, drafts, logits, row_draft, draft_q, uniforms)
    elif sampled:
        rows = _rows(sampled, offsets, dev)
        s_ok, s_token = _decide_sampled(
            [requests[i] for i in sampled], [drafts[i] for i in sampled], logits.index_select(0, rows),
            row_draft.index_select(0, rows), [draft_q[i] for i in sampled], [uniforms[i] for i in sampled])
        ok = ok.index_copy(0, rows, s_ok)
        token = token.index_copy(0, rows, s_token)
    accepted = _first_rejected(ok, owner, rank, n, last)
    return torch.stack([accepted, token[starts + accepted]], dim=1)


def _decide_sampled(
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],
    logits: Tensor,
    row_draft: Tensor,
    draft_q: Sequence[Tensor | None],
    uniforms: Sequence[Tensor | None],
) -> tuple[Tensor, Tensor]:
    """Rejection sampling over the rows of sampled requests only (``logits`` and
    ``row_draft``, each row's draft or -1, are theirs, back to back): per row whether its
    draft is accepted and the token drawn there ``([R] bool, [R] int64)``."""
    dev = logits.device
    offsets = list(accumulate((len(d) + 1 for d in drafts), initial=0))
    everyone = range(len(requests))
    has_draft = row_draft >= 0
    safe_draft = row_draft.clamp_min(0)
    probs = _target_probs(requests, everyone, offsets, logits)
    u_accept, u_draw = _row_uniforms(everyone, drafts, uniforms, offsets, logits.shape[0], dev)

    # Each row's residual max(0, p - q) and q at its draft: a greedy draft's q is one-hot (the
    # residual is p without the draft), a sampled draft's is its row of draft_q; the last row
    # of a request has no draft (q = 0: its residual is p, the bonus token's distribution).
    p_at_draft = probs.gather(1, safe_draft[:, None])[:, 0]
    residual = probs.scatter(1, safe_draft[:, None], torch.where(has_draft, 0.0, p_at_draft)[:, None])
    q_at_draft = has_draft.to(torch.float32)
    with_q = [i for i in everyone if draft_q[i] is not None]
    if with_q:
        q_all = torch.cat([draft_q[i] for i in with_q]).to(dev, torch.float32)  # type: ignore[misc]
        index = _rows(with_q, offsets, dev, drafts_only=True)
        q_at_draft = q_at_draft.index_copy(0, index, q_all.gather(1, safe_draft[index][:, None])[:, 0])
        residual.index_copy_(0, index, (probs.index_select(0, index) - q_all).clamp_min(0.0))

    empty = residual.sum(-1) <= 0.0  # p no more than q anywhere: a rejection had probability ~0
    ok = has_draft & (((q_at_draft > 0) & (u_accept * q_at_draft < p_at_draft)) | empty)
    drawn = inverse_cdf(torch.where(empty[:, None], probs, residual), u_draw)
    return ok, drawn


def _rows(which: Sequence[int], offsets: Sequence[int], device: torch.device, *,
          drafts_only: bool = False) -> Tensor:
    """The rows of the requests ``which`` (with ``drafts_only``, without each one's last)."""
    cut = 1 if drafts_only else 0
    return torch.tensor([j for i in which for j in range(offsets[i], offsets[i + 1] - cut)],
                        dtype=torch.int64).to(device, non_blocking=True)


def _target_probs(requests: Sequence[Request], which: Sequence[int], offsets: Sequence[int],
                  logits: Tensor) -> Tensor:
    """``[R, V]`` fp32: the rows of the requests ``which`` as
    :func:`~blockdraft.sampling.target_probs` gives them (one call per distinct temperature,
    top-p and top-k), zeros elsewhere."""
    groups: dict[tuple[float, float, int], list[int]] = {}
    for i in which:
        p = requests[i].params
        groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(i)
    if len(groups) == 1 and len(which) == len(requests):
        # One setting for every row: no zeros to fill in, no rows to pick.
        ((temperature, top_p, top_k),) = groups
        return target_probs(logits, temperature, top_p, top_k)
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    for (temperature, top_p, top_k), members in groups.items():
        rows = _rows(members, offsets, logits.device)
        probs.index_copy_(0, rows, target_probs(logits.index_select(0, rows), temperature, top_p, top_k))
    return probs


def _row_uniforms(sampled: Sequence[int], drafts: Sequence[Sequence[int]], uniforms: Sequence[Tensor | None],
                  offsets: Sequence[int], num_rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Per row the uniform of its draft's acceptance and of its draw (0 for greedy rows)."""
    u_accept = torch.zeros(num_rows, dtype=torch.float32)
    u_draw = torch.zeros(num_rows, dtype=torch.float32)
    for i in sampled:
        u, k = uniforms[i], len(drafts[i])
        if u is None or u.numel() != 2 * k + 1:
            raise ValueError(f"uniforms[{i}]: want {2 * k + 1} for {k} drafts")
        u_accept[offsets[i] : offsets[i] + k] = u[:k]
        u_draw[offsets[i] : offsets[i + 1]] = u[k:]
    return u_accept.to(device, non_blocking=True), u_draw.to(device, non_blocking=True)


def draw_uniforms(requests: Sequence[Request], drafts: Sequence[Sequence[int]]) -> list[Tensor | None]:
    """Each sampled request's uniforms for :func:`decide_on_device`, from its own generator."""
    return [None if r.params.greedy else torch.rand(2 * len(d) + 1, generator=r.generator)
            for r, d in zip(requests, drafts)]


__all__ = ["decide_on_device", "draw_uniforms", "on_device"]
