"""The target's sampling distribution and the speculative acceptance rules.

Greedy: a draft is accepted while it equals the target's argmax. Sampling: standard rejection
sampling, lossless for any draft distribution ``q``: draft ``d`` is accepted with probability
``min(1, p(d) / q(d))``, and on rejection the token is drawn from ``norm(max(0, p - q))``; when
every draft is accepted the bonus token is drawn from ``p``. Greedy drafts are the case
``q = onehot(d)``: accept with probability ``p(d)``, else draw from ``p`` without ``d``.

Penalties (:class:`Penalties`) change the target's logits before everything else, at every
verify row after the tokens before it; ``p`` is then the penalised distribution, so greedy
and sampled output with penalties equal target-only decoding with the same penalties.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen.

    Attributes:
        temperature: 0 = greedy; else sampling at this temperature.
        top_p / top_k: nucleus and top-k filtering of the target distribution (1.0 / 0: off).
        presence_penalty / frequency_penalty: OpenAI's penalties, in [-2, 2]: subtracted
            from the logit of every token already generated, once (presence) and once per
            time it was generated (frequency). 0: off.
        repetition_penalty: the Hugging Face / vLLM penalty, > 0: the logit of every token
            of the prompt or the generated text is divided by it when positive, multiplied
            when negative. 1: off.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        validate_sampling(self.temperature, self.top_p, self.top_k)
        validate_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on (the target's logits then depend on the tokens so far)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


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


def validate_penalties(presence: float, frequency: float, repetition: float) -> None:
    """Raises ``ValueError`` (``TypeError`` for non-numbers) naming a bad penalty."""
    values = (("presence_penalty", presence), ("frequency_penalty", frequency),
              ("repetition_penalty", repetition))
    for name, value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    for name, value in values[:2]:
        if not -2.0 <= value <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], not {value}")
    if not 0.0 < repetition < math.inf:
        raise ValueError(f"repetition_penalty must be > 0 and finite, not {repetition}")


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


class Penalties:
    """A request's penalties at one position: what the prompt and the tokens generated so far
    make of the target's logits (:attr:`SamplingParams.presence_penalty` and the others).

    The repetition penalty counts the prompt and the generated tokens (as Hugging Face and
    vLLM do); presence and frequency count the generated tokens only (as OpenAI does). The
    repetition penalty applies first, then frequency and presence are subtracted.

    Args:
        params: the request's settings.
        vocab: the logits' width ``V``; ids outside ``[0, V)`` count for nothing.
        prompt / generated: the tokens before the position.
    """

    def __init__(self, params: SamplingParams, vocab: int, prompt: Sequence[int],
                 generated: Sequence[int]) -> None:
        self.params = params
        self.vocab = vocab
        self.counts = _bincount(generated, vocab)  # [V] fp32: times each id was generated
        self.seen: Tensor | None = None  # [V] bool: in the prompt or generated
        if params.repetition_penalty != 1:
            self.seen = (_bincount(prompt, vocab) + self.counts) > 0

    def add(self, token: int) -> None:
        """One more generated token (the next position's penalties)."""
        if 0 <= token < self.vocab:
            self.counts[token] += 1
            if self.seen is not None:
                self.seen[token] = True

    def apply(self, logits: Tensor) -> Tensor:
        """``logits [..., V]`` (fp32) penalised (a new tensor; the input is left as it was)."""
        p = self.params
        out = logits
        counts = self.counts.to(out.device)
        if self.seen is not None:
            scaled = torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty)
            out = torch.where(self.seen.to(out.device), scaled, out)
        if p.frequency_penalty != 0:
            out = out - p.frequency_penalty * counts
        if p.presence_penalty != 0:
            out = out - p.presence_penalty * (counts > 0).to(out.dtype)
        return out


def _bincount(ids: Sequence[int], vocab: int) -> Tensor:
    t = torch.as_tensor(list(ids), dtype=torch.int64)
    t = t[(t >= 0) & (t < vocab)]
    return torch.bincount(t, minlength=vocab).to(torch.float32)


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


def inverse_cdf(mass: Tensor, u: Tensor) -> Tensor:
    """One index per row of the non-negative ``mass [N, V]`` (each row with some mass, not
    necessarily normalised), chosen by the uniforms ``u [N]`` in ``[0, 1)``: the first index
    whose cumulative mass exceeds ``u`` times the row's total. Never an index of zero mass.
    [N] int64 on ``mass``' device."""
    cdf = torch.cumsum(mass.float(), dim=-1)
    idx = torch.searchsorted(cdf, u[:, None].to(cdf.device, cdf.dtype) * cdf[:, -1:], right=True)[:, 0]
    # u·total rounds up to the total in rare cases: the answer is then the last index with mass.
    last_with_mass = mass.shape[-1] - 1 - torch.argmax(torch.flip(mass > 0, dims=[-1]).to(torch.int8), dim=-1)
    return torch.minimum(idx, last_with_mass)


def sample_rows(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row of ``probs [N, V]`` drawn from it: [N] int64 on ``probs``' device.

    One uniform per row comes from ``generator`` on its own device (a host generator for rows
    on the GPU, the usual kind, draws on the host, so the random stream is the same wherever
    the rows live, and only the uniforms travel) and picks the index by :func:`inverse_cdf`.
    """
    where = generator.device if generator is not None else probs.device
    u = torch.rand(probs.shape[0], generator=generator, device=where)
    return inverse_cdf(probs, u.to(probs.device, non_blocking=True))


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
    "Penalties",
    "SamplingParams",
    "accept_draft",
    "allowed_ids",
    "as_sampling",
    "draw",
    "inverse_cdf",
    "target_probs",
    "validate_penalties",
    "validate_sampling",
]
