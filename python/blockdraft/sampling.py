"""The target's sampling distribution and the speculative acceptance rules.

Greedy: a draft is accepted while it equals the target's argmax. Sampling: standard rejection
sampling, lossless for any draft distribution ``q``: draft ``d`` is accepted with probability
``min(1, p(d) / q(d))``, and on rejection the token is drawn from ``norm(max(0, p - q))``; when
every draft is accepted the bonus token is drawn from ``p``. Greedy drafts are the case
``q = onehot(d)``: accept with probability ``p(d)``, else draw from ``p`` without ``d``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen.

    Attributes:
        temperature: 0 = greedy; else sampling at this temperature.
        top_p / top_k: nucleus and top-k filtering of the target distribution (1.0 / 0: off).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def validate_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raises ``ValueError`` (``TypeError`` for non-numbers) naming a bad sampling setting."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, not {type(top_k).__name__}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], not {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, not {top_k}")


_GREEDY = SamplingParams()


def as_sampling(sampling: object) -> SamplingParams:
    """``sampling`` as given, or greedy settings (``SamplingParams()``) for ``None``.

    Raises:
        TypeError: neither a :class:`SamplingParams` nor ``None``.
    """
    if sampling is None:
        return _GREEDY
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams or None, not {type(sampling).__name__}")
    return sampling


def allowed_ids(bitmask: Tensor, vocab: int) -> Tensor:
    """Packed int32 ``[..., ceil(V/32)]`` -> ``[..., V]`` bool (bit ``j`` of word ``w``
    allows id ``32 * w + j``)."""
    ids = torch.arange(vocab, device=bitmask.device)
    return ((bitmask.to(torch.int64)[..., ids // 32] >> (ids % 32)) & 1).to(torch.bool)


def target_probs(
    logits: Tensor, temperature: float, top_p: float, top_k: int, allowed: Tensor | None = None
) -> Tensor:
    """The target's sampling distribution per row.

    logits ``[R, V]`` -> probabilities ``[R, V]`` fp32: softmax at ``temperature`` over the
    allowed ids, restricted to the ``top_k`` most likely (0 = all), then to the smallest set of
    most likely ids whose mass reaches ``top_p``, renormalised.
    """
    scores = logits.float() / temperature
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_rows(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row of ``probs [N, V]`` drawn from it: [N] int64 on ``probs``' device.

    A generator on another device than ``probs`` (a host generator for rows on the GPU, the
    usual kind) draws on its own device, so the random stream is the same wherever the rows
    live.
    """
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator)[:, 0].to(probs.device)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One id drawn from ``probs [V]`` (:func:`sample_rows` of one row)."""
    return int(sample_rows(probs[None], generator)[0])


def accept_draft(
    p: Tensor, draft: int, q: Tensor | None, generator: torch.Generator | None
) -> tuple[bool, int]:
    """Rejection sampling of one draft against the target distribution ``p [V]``.

    ``q [V]``: the distribution the draft was drawn from (``None``: a greedy draft, ``q =
    onehot(draft)``). Returns ``(True, draft)`` when accepted, else ``(False, token)`` with the
    token drawn from ``norm(max(0, p - q))``.
    """
    u = float(torch.rand((), generator=generator, device=p.device))
    q_d = 1.0 if q is None else float(q[draft])
    if q_d > 0 and u * q_d < float(p[draft]):
        return True, draft
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q.to(p.dtype)).clamp_min(0.0)
    total = float(residual.sum())
    if total <= 0.0:
        # p is (numerically) no more than q everywhere, so a rejection had probability ~0.
        return True, draft
    return False, draw(residual / total, generator)


__all__ = [
    "SamplingParams",
    "accept_draft",
    "allowed_ids",
    "as_sampling",
    "draw",
    "target_probs",
    "validate_sampling",
]
