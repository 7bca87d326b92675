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

from blockdraft.engine.device_accept import decide_on_device, draw_uniforms, on_device
from blockdraft.engine.request import Request
from blockdraft.sampling import Penalties, accept_draft, allowed_ids, draw, target_probs


def argmax_only(r: Request) -> bool:
    """Greedy with nothing to apply to the target's logits: a plain argmax, taken on the
    device."""
    return r.params.greedy and on_device(r)


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
    if all(argmax_only(r) for r in requests):
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
    the distribution request ``i``'s drafts were sampled from (``None``: greedy drafts).

    Requests :func:`~blockdraft.engine.device_accept.on_device` accepts are decided together
    where the logits are, and one small tensor comes back (greedy alone: the argmax of each
    row); only the others' rows travel to the host, to be decided there row by row."""
    qs = list(draft_q) if draft_q is not None else [None] * len(requests)
    starts: list[int] = []
    offset = 0
    for d in drafts:
        starts.append(offset)
        offset += len(d) + 1
    where = [on_device(r) for r in requests]
    dev = [i for i, d in enumerate(where) if d]
    host_idx = [i for i, d in enumerate(where) if not d]
    out: list[tuple[int, int] | None] = [None] * len(requests)
    if dev:
        rows = logits if not host_idx else logits.index_select(0, _row_index(dev, drafts, starts, logits.device))
        sub, sub_drafts = [requests[i] for i in dev], [drafts[i] for i in dev]
        if all(r.params.greedy for r in sub):
            # Greedy alone: one argmax and one read of a token per row, the cheapest step.
            choices: list[int] = torch.argmax(rows, dim=-1).tolist()
            at = 0
            for i, d in zip(dev, sub_drafts):
                out[i] = _greedy_accept(d, choices[at : at + len(d) + 1])
                at += len(d) + 1
        else:
            got: list[list[int]] = decide_on_device(sub, sub_drafts, rows, [qs[i] for i in dev],
                                                    draw_uniforms(sub, sub_drafts)).tolist()
            for i, (a, nxt) in zip(dev, got):
                out[i] = (a, nxt)
    if host_idx:
        # Only these requests' rows travel to the host: copying the whole [R, V] would move
        # every other request's rows too.
        host = logits if not dev else logits.index_select(0, _row_index(host_idx, drafts, starts, logits.device))
        host = host.cpu()
        at = 0
        for i in host_idx:
            rows_i = len(drafts[i]) + 1
            out[i] = _host_accept(requests[i], drafts[i], host[at : at + rows_i], qs[i])
            at += rows_i
    return [x for x in out if x is not None]


def accept_drafted(drafts: Tensor, logits: Tensor) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Greedy acceptance (for requests :func:`argmax_only` covers) of drafts still on the
    device, ``drafts [n, k]``, against their verify logits ``[n * (k + 1), V]``: the drafts and
    every row's argmax come back in one read. Returns the drafts as lists and per request
    ``(accepted drafts, next token)``."""
    n, k = drafts.shape
    flat = read_drafted(drafts, logits)
    tokens = [flat[i * k : (i + 1) * k] for i in range(n)]
    at = n * k
    decided = [_greedy_accept(d, flat[at + i * (k + 1) : at + (i + 1) * (k + 1)]) for i, d in enumerate(tokens)]
    return tokens, decided


def read_drafted(drafts: Tensor, logits: Tensor) -> list[int]:
    """The step's one read from the device: ``drafts`` flattened, then every row's argmax."""
    flat: list[int] = torch.cat((drafts.reshape(-1), torch.argmax(logits, dim=-1))).tolist()
    return flat


def _row_index(which: Sequence[int], drafts: Sequence[list[int]], starts: Sequence[int],
               device: torch.device) -> Tensor:
    """The verify rows of the requests ``which``, in order."""
    return torch.tensor([starts[i] + k for i in which for k in range(len(drafts[i]) + 1)], device=device)


def _greedy_accept(drafts: Sequence[int], choices: Sequence[int]) -> tuple[int, int]:
    for j, d in enumerate(drafts):
        if d != choices[j]:
            return j, choices[j]
    return len(drafts), choices[len(drafts)]


def _host_accept(r: Request, drafts: Sequence[int], rows: Tensor, q: Tensor | None) -> tuple[int, int]:
    penalties = _penalties(r, rows.shape[-1])
    q = None if q is None else q.cpu()
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


__all__ = ["accept_blocks", "accept_drafted", "argmax_only", "first_tokens", "read_drafted"]
