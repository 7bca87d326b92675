"""What a generation call returns: the tokens per prompt, their log-probabilities when asked
for, and what the call measured."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one generated token and of its likeliest alternatives.

    Log-probabilities are the log-softmax of the target's raw logits at the position that
    produced the token (before penalties, temperature, top-k/top-p or a grammar mask), as
    vLLM reports by default: they say what the model thinks, not how the token was drawn.

    Attributes:
        token: the generated token id.
        logprob: its log-probability.
        top: the ``k`` likeliest ids as ``(id, logprob)``, likeliest first (``k`` as asked
            for; empty for 0).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationStats:
    """What one ``generate`` / ``decode`` call measured.

    Attributes:
        acceptance_lengths: per prompt, the tokens each step produced (accepted drafts + 1;
            all 1 for target-only decoding).
        mean_tau: mean tokens per step over all prompts (tau).
        num_new_tokens: generated tokens over all prompts.
        elapsed_s: wall time of the whole call.
        tokens_per_s: ``num_new_tokens / elapsed_s``.
        ttft_s: per prompt, seconds from the call's start to its first token.
        batched_proposals / single_proposals: how drafts were obtained.
        target_runtime: what ran the target: ``"blockdraft"`` (the runtime) or ``"hf"``
            (the model's own forward).
    """

    acceptance_lengths: list[list[int]]
    mean_tau: float
    num_new_tokens: int
    elapsed_s: float
    tokens_per_s: float
    ttft_s: list[float]
    batched_proposals: int = 0
    single_proposals: int = 0
    target_runtime: str = "hf"

    @classmethod
    def collect(
        cls,
        steps: list[list[int]],
        num_new_tokens: int,
        elapsed_s: float,
        ttft_s: list[float],
        target_runtime: str,
        batched: int = 0,
        single: int = 0,
    ) -> GenerationStats:
        flat = [x for s in steps for x in s]
        return cls(
            acceptance_lengths=steps,
            mean_tau=sum(flat) / len(flat) if flat else 0.0,
            num_new_tokens=num_new_tokens,
            elapsed_s=elapsed_s,
            tokens_per_s=num_new_tokens / elapsed_s if elapsed_s > 0 else 0.0,
            ttft_s=ttft_s,
            batched_proposals=batched,
            single_proposals=single,
            target_runtime=target_runtime,
        )


@dataclass
class GenerationResult:
    """Generated tokens per prompt (prompt excluded, stop token included) and stats.

    Attributes:
        logprobs: per prompt, one :class:`TokenLogprob` per generated token when the call
            asked for them (``logprobs=k``), else ``None``.
    """

    tokens: list[list[int]]
    stats: GenerationStats = field(repr=False)
    logprobs: list[list[TokenLogprob]] | None = field(default=None, repr=False)


__all__ = ["GenerationResult", "GenerationStats", "TokenLogprob"]
