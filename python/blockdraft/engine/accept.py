"""The target's choices for a step: the first token after a prompt, and how much of each
drafted block is accepted (greedy, masked or sampled; see :mod:`blockdraft.sampling`).

Everything that shapes a request's target distribution applies at every verify row, after the
tokens before that row (the drafts accepted so far included): penalties
(:class:`~blockdraft.sampling.Penalties`), the stop tokens masked until ``min_tokens``, the
grammar mask. Acceptance then compares drafts against that distribution, so the output is the
one target-only decoding with the same settings gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from blockdraft.engine.request import Request
from blockdraft.sampling import Penalties, accept_draft, allowed_ids, draw, target_probs


def _device_greedy(r: Request) -> bool:
    """Greedy with nothing to apply to the target's logits: a plain argmax, taken on the
    device."""
    return r.params.greedy and r.mask_fn is None and not r.params.penalised and not r.holds_stops()


def _allowed(r: Request, extra: Sequence[int], vocab: int) -> Tensor | None:
    mask = r.bitmask(extra)
    allowed = None if mask is None else allowed_ids(mask.to(torch.int32).cpu(), vocab)
    if r.holds_stops(len(extra)):
        stops = [t for t in r.stops if 0 <= t < vocab]
        without = torch.ones(vocab, dtype=torch.bool) if allowed is None else allowed.clone()
        without[stops] = False
        # A grammar that allows only stop tokens wins over min_tokens: a choice must remain.
        if bool(without.any()):
            allowed = without
    return allowed


def _host_choice(r: Request, row: Tensor, extra: Sequence[int],
                 penalties: Penalties | None) -> tuple[Tensor | None, int]:
    """``(target distribution or None when greedy, the greedy choice or -1)`` for one fp32
    row after the generated tokens and ``extra`` (``penalties``: theirs, when any is on)."""
    if penalties is not None:
        row = penalties.apply(row)
    allowed = _allowed(r, extra, row.shape[-1])
    if r.params.greedy:
        if allowed is not None:
            row = row.masked_fill(~allowed, float("-inf"))
        return None, int(torch.argmax(row))
    p = r.params
    probs = target_probs(row[None], p.temperature, p.top_p, p.top_k,
                         None if allowed is None else allowed[None])[0]
    return probs, -1


def _penalties(r: Request, vocab: int) -> Penalties | None:
    return Penalties(r.params, vocab, r.prompt, r.out) if r.params.penalised else None


def first_tokens(requests: Sequence[Request], logits: Tensor) -> list[int]:
    """Each request's token after its prompt from its last prompt row ``logits[i]`` ``[n, V]``."""
    if all(_device_greedy(r) for r in requests):
        picked: list[int] = torch.argmax(logits, dim=-1).tolist()
        return picked
    rows = logits.cpu()  # the target's dtype; rows become fp32 only when looked at
    out = []
    for r, row in zip(requests, rows):
        probs, choice = _host_choice(r, row.float(), [], _penalties(r, row.shape[-1]))
        out.append(choice if probs is None else draw(probs, r.generator))
    return out


def accept_blocks(
    requests: Sequence[Request],
    drafts: Sequence[list[int]],
    logits: Tensor,
    draft_q: Sequence[Tensor | None] | None = None,
) -> list[tuple[int, int]]:
    """Per request ``(accepted drafts, next token)`` from the verify logits ``[R, V]``
    (request ``i``'s ``1 + len(drafts[i])`` rows back to back). ``draft_q[i]`` ``[len, V]``:
    the distribution request ``i``'s drafts were sampled from (``None``: greedy drafts)."""
    greedy_rows: list[int] | None = None
    if any(_device_greedy(r) for r in requests):
        # One argmax on the device and one small transfer for every greedy request.
        greedy_rows = torch.argmax(logits, dim=-1).tolist()
    starts: list[int] = []
    offset = 0
    for d in drafts:
        starts.append(offset)
        offset += len(d) + 1
    # Only the rows of requests decided on the host travel there: copying the whole [R, V]
    # would move every greedy request's rows too.
    host_rows = [starts[i] + k for i, (r, d) in enumerate(zip(requests, drafts)) if not _device_greedy(r)
                 for k in range(len(d) + 1)]
    host: Tensor | None = None
    if host_rows:
        if len(host_rows) == logits.shape[0]:
            host = logits.cpu()
        else:
            host = logits.index_select(0, torch.tensor(host_rows, device=logits.device)).cpu()
    out: list[tuple[int, int]] = []
    at = 0  # the next host row
    for i, (r, d) in enumerate(zip(requests, drafts)):
        rows = len(d) + 1
        if _device_greedy(r):
            assert greedy_rows is not None
            out.append(_greedy_accept(d, greedy_rows[starts[i] : starts[i] + rows]))
        else:
            assert host is not None
            q = draft_q[i] if draft_q is not None else None
            out.append(_host_accept(r, d, host[at : at + rows], q))
            at += rows
    return out


def _greedy_accept(drafts: Sequence[int], choices: Sequence[int]) -> tuple[int, int]:
    for j, d in enumerate(drafts):
        if d != choices[j]:
            return j, choices[j]
    return len(drafts), choices[len(drafts)]


def _host_accept(r: Request, drafts: Sequence[int], rows: Tensor, q: Tensor | None) -> tuple[int, int]:
    penalties = _penalties(r, rows.shape[-1])
    for j in range(len(drafts) + 1):
        probs, choice = _host_choice(r, rows[j].float(), drafts[:j], penalties)
        if probs is None:
            ok, token = j < len(drafts) and drafts[j] == choice, choice
        elif j == len(drafts):
            return j, draw(probs, r.generator)
        else:
            ok, token = accept_draft(probs, drafts[j], None if q is None else q[j], r.generator)
        if not ok:
            return j, token
        if penalties is not None:
            penalties.add(drafts[j])
    raise AssertionError("unreachable")


__all__ = ["accept_blocks", "first_tokens"]
