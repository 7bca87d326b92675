"""The target's log-probabilities of the tokens a step emitted, for the requests that asked.

A token's log-probability is the log-softmax of the target's raw logits at the row that
produced it (the verify row of an accepted draft or of the next token, or the prompt's last
row for the first token), before penalties, temperature, top-k/top-p and masks (vLLM's
default, ``raw_logprobs``). Only the emitted rows of requests with ``logprobs`` set are
read, on the logits' device, and one small transfer brings the values back: a step without
such a request does nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from blockdraft.engine.request import Request
from blockdraft.results import TokenLogprob


def emitted_logprobs(
    requests: Sequence[Request], logits: Tensor, rows: Sequence[int], emitted: Sequence[Sequence[int]]
) -> list[list[TokenLogprob] | None]:
    """Per request, one :class:`TokenLogprob` per emitted token (``None`` for a request
    without ``logprobs``).

    Args:
        requests: the step's requests.
        logits: ``[R, V]``: request ``i``'s ``rows[i]`` rows back to back.
        rows: how many rows each request has in ``logits``.
        emitted: request ``i``'s emitted tokens; token ``j`` came from its row ``j``.
    """
    out: list[list[TokenLogprob] | None] = [None] * len(requests)
    picked: list[int] = []
    tokens: list[int] = []
    offset = 0
    for r, n, toks in zip(requests, rows, emitted):
        if r.logprobs is not None:
            picked.extend(range(offset, offset + len(toks)))
            tokens.extend(toks)
        offset += n
    if not picked:
        return out
    k = max(r.logprobs or 0 for r in requests)
    index = torch.tensor(picked, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].cpu().tolist()
    top_v: list[list[float]] = []
    top_i: list[list[int]] = []
    if k > 0:
        top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        top_v, top_i = top.values.cpu().tolist(), top.indices.cpu().tolist()
    at = 0
    for i, (r, toks) in enumerate(zip(requests, emitted)):
        if r.logprobs is None:
            continue
        got = []
        for tok in toks:
            alts = tuple(zip(top_i[at][: r.logprobs], top_v[at][: r.logprobs])) if r.logprobs else ()
            got.append(TokenLogprob(int(tok), float(chosen[at]), alts))
            at += 1
        out[i] = got
    return out


__all__ = ["emitted_logprobs"]
