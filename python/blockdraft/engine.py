"""Speculative generation with a DFlash drafter: draft a block, verify it with the target.

Per step and per sequence: the proposer drafts up to ``B - 1`` tokens after the anchor (the
last verified token); the target runs ``[anchor, d1 .. dm]`` through its KV cache; the longest
prefix of drafts the target agrees with is accepted, plus one token chosen by the target (the
bonus); the target's KV cache is cropped to the accepted positions, and the hidden states of
the ``accepted + 1`` verified rows become new drafter context.

Greedy decoding reproduces the target's own greedy output. Sampling uses rejection sampling
with the drafter's (greedy, hence one-hot) proposal: a draft ``d`` is accepted with probability
``p(d)``, and on rejection a token is drawn from ``p`` without ``d``, renormalised; this is the
standard lossless scheme with ``q = onehot(d)``, so the output follows the target's own
sampling distribution exactly.

Drafting is batched over sequences through ``propose_batch`` when at least two sequences are
active (falling back to ``propose`` per sequence when it declines); the target verifies one
sequence at a time, each with its own KV cache, which keeps the output exact for prompts of
different lengths without padding.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.attention as _attention
from torch import Tensor
from torch.nn.attention import SDPBackend

from blockdraft import faults
from blockdraft.proposer import DFlashProposer, DFlashState

log = logging.getLogger(__name__)

GrammarBitmaskFn = Callable[[int, Sequence[int]], "Tensor | None"]
"""``fn(prompt_index, generated_tokens) -> packed int32 bitmask [ceil(V/32)] of the tokens allowed
next`` (``None`` = no constraint)."""

DEFAULT_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
"""The attention backends the target's forwards may use by default, in priority order: every
backend except cuDNN (see :class:`SpeculativeEngine`, ``sdpa_backends``)."""

_SDPA_SELECTABLE = frozenset(
    {
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.OVERRIDEABLE,
    }
)


def _validate_sdpa_backends(backends: object) -> tuple[SDPBackend, ...] | None:
    """``sdpa_backends`` as a tuple (``None`` stays ``None``); TypeError/ValueError if bad."""
    if backends is None:
        return None
    if isinstance(backends, SDPBackend):
        backends = (backends,)
    if isinstance(backends, (str, bytes)) or not isinstance(backends, Iterable):
        raise TypeError(
            "sdpa_backends must be None or a sequence of torch.nn.attention.SDPBackend members, "
            f"not {type(backends).__name__}"
        )
    got = tuple(backends)
    if not got:
        raise ValueError("sdpa_backends must name at least one backend (None = torch's choice)")
    for b in got:
        if not isinstance(b, SDPBackend):
            raise TypeError(
                "sdpa_backends must hold torch.nn.attention.SDPBackend members, "
                f"not {type(b).__name__} ({b!r})"
            )
        if b not in _SDPA_SELECTABLE:
            raise ValueError(f"sdpa_backends: {b!r} is not a selectable attention backend")
    if len(set(got)) != len(got):
        raise ValueError(f"sdpa_backends names a backend twice: {got!r}")
    return got


def _sdpa_kernel_has_priority() -> bool:
    """Whether ``torch.nn.attention.sdpa_kernel`` takes ``set_priority`` (newer torch)."""
    try:
        return "set_priority" in inspect.signature(_attention.sdpa_kernel).parameters
    except (TypeError, ValueError):
        return False


def _accepts_logits_to_keep(target: Any) -> bool:
    """Whether the target's forward names a ``logits_to_keep`` parameter (Hugging Face causal
    LMs do): then the prefill asks it for the last row's logits only."""
    fn = getattr(target, "forward", target)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get("logits_to_keep")
    return p is not None and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


@dataclass
class GenerationStats:
    """What one ``generate`` call measured.

    Attributes:
        acceptance_lengths: per prompt, the tokens each speculative step produced (accepted
            drafts + 1).
        mean_tau: mean tokens per speculative step over all prompts (tau).
        num_new_tokens: generated tokens over all prompts.
        elapsed_s: wall time of the whole call.
        tokens_per_s: ``num_new_tokens / elapsed_s``.
        ttft_s: per prompt, seconds from the call's start to its first token.
        batched_proposals / single_proposals: how drafts were obtained.
    """

    acceptance_lengths: list[list[int]]
    mean_tau: float
    num_new_tokens: int
    elapsed_s: float
    tokens_per_s: float
    ttft_s: list[float]
    batched_proposals: int = 0
    single_proposals: int = 0


@dataclass
class GenerationResult:
    """Generated tokens per prompt (prompt excluded, stop token included) and stats."""

    tokens: list[list[int]]
    stats: GenerationStats


@dataclass
class _Seq:
    index: int
    prompt_len: int
    cache: Any
    state: DFlashState
    out: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    done: bool = False


def _validate_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], not {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, not {top_k}")


def _allowed(bitmask: Tensor, vocab: int) -> Tensor:
    """Packed int32 ``[ceil(V/32)]`` -> ``[V]`` bool."""
    ids = torch.arange(vocab, device=bitmask.device)
    return ((bitmask.to(torch.int64)[ids // 32] >> (ids % 32)) & 1).to(torch.bool)


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


class SpeculativeEngine:
    """A reusable target + drafter pair with its proposer (pool, paged K/V).

    Args:
        target: a Hugging Face causal LM (``output_hidden_states`` and a ``DynamicCache``).
        drafter: a loaded DFlash drafter matching the target.
        proposer: an existing proposer for this pair (default: one is built).
        max_seq_len: longest prompt + generation (default: the target's
            ``max_position_embeddings``, else 4096).
        max_active: most sequences decoded at once (default: the proposer's ``max_batch``);
            prompts beyond it wait for the next wave, so the pool needs blocks for only this
            many windows.
        sdpa_backends: the scaled-dot-product-attention backends the target's forwards may
            use, in priority order (a sequence of :class:`torch.nn.attention.SDPBackend`);
            every target call runs inside ``torch.nn.attention.sdpa_kernel(backends,
            set_priority=True)`` (without ``set_priority`` on a torch that lacks it). Default:
            :data:`DEFAULT_SDPA_BACKENDS` (flash, memory-efficient, math), i.e. everything but
            cuDNN: on Hopper torch's own choice for the verify forward is cuDNN attention,
            whose execution plans depend on the KV length, which changes on every speculative
            step (150-220 ms steps were once attributed to it); flash and memory-efficient
            attention need no plans. With torch 2.11 on an H200 (random 8B bf16 target, 512 to
            16K context) both choices measured the same, 34-59 ms per step. ``None`` leaves
            torch's choice alone. The selection sets torch's global SDPA flags for the duration
            of each target call (restored afterwards). A different backend rounds differently:
            bf16 greedy output can differ from a run with another selection.
        proposer_kwargs: passed to :class:`DFlashProposer` when one is built.

    Raises:
        TypeError / ValueError: a bad ``sdpa_backends``.

    Cost per step: the prefill asks the target for the last row's logits only (through
    ``logits_to_keep=1`` when its forward takes it, else by slicing), and greedy verification
    without a grammar mask picks the target's tokens with one argmax on the device and compares
    token lists on the host; the sampling and masked paths move the verify logits to the host
    in the target's dtype and convert to fp32 only the rows they look at. Logits stay in the
    target's dtype: bf16 -> fp32 is exact, so an argmax over either picks the same id (ties:
    the lowest, as ``torch.argmax``).
    """

    def __init__(
        self,
        target: Any,
        drafter: Any,
        *,
        proposer: DFlashProposer | None = None,
        max_seq_len: int | None = None,
        max_active: int | None = None,
        sdpa_backends: Sequence[SDPBackend] | SDPBackend | None = DEFAULT_SDPA_BACKENDS,
        **proposer_kwargs: Any,
    ) -> None:
        self.sdpa_backends = _validate_sdpa_backends(sdpa_backends)
        self._sdpa_priority = _sdpa_kernel_has_priority()
        self._keep_last_logits = _accepts_logits_to_keep(target)
        log.debug(
            "target forward takes logits_to_keep: %s; sdpa backends: %s (priority: %s)",
            self._keep_last_logits, self.sdpa_backends, self._sdpa_priority,
        )
        self.target = target
        self.drafter = drafter
        if max_seq_len is None:
            cfg = getattr(target, "config", None)
            max_seq_len = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        self.max_seq_len = max_seq_len
        self.max_active = max_active
        self.proposer = proposer or DFlashProposer(
            drafter, target, max_seq_len=max_seq_len, **proposer_kwargs
        )
        self.layer_ids = list(self.proposer.target_layer_ids)
        self.device = next(target.parameters()).device

    # ------------------------------------------------------------------ target calls

    def _attention_backends(self) -> contextlib.AbstractContextManager[Any]:
        """The ``sdpa_kernel`` selection for one target call (nothing when ``None``)."""
        if self.sdpa_backends is None:
            return contextlib.nullcontext()
        backends = list(self.sdpa_backends)
        if self._sdpa_priority:
            return _attention.sdpa_kernel(backends, set_priority=True)
        return _attention.sdpa_kernel(backends)

    def _target_forward(
        self, ids: list[int], cache: Any, *, last_only: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Run ``ids`` through the target after ``cache``.

        Returns ``(logits, ctx rows [T, k*H])``: logits ``[T, V]`` in the target's dtype, or
        ``[1, V]`` (the last row's) with ``last_only``.
        """
        if faults._ACTIVE is not None:
            faults.hit("target_forward")
        inp = torch.tensor([ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {}
        if last_only and self._keep_last_logits:
            kwargs["logits_to_keep"] = 1
        with self._attention_backends():
            out = self.target(
                input_ids=inp,
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
                **kwargs,
            )
        logits = out.logits[0]
        if last_only and "logits_to_keep" not in kwargs:
            # The target computed every row: copy the last one out so the rest can be freed
            # (a slice would keep the whole [T, V] storage alive).
            logits = logits[-1:].clone()
        # Only the captured layers outlive this call: drop every other hidden state (and any
        # all-row logits) before the concatenation allocates.
        hs = out.hidden_states
        picked = [hs[i + 1][0] for i in self.layer_ids]
        del out, hs
        rows = torch.cat(picked, dim=-1)
        return logits, rows

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.target.config)

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        grammar_bitmask_fn: GrammarBitmaskFn | None = None,
        generator: torch.Generator | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after each prompt.

        Args:
            prompts: token ids per prompt (each non-empty; lengths may differ).
            max_new_tokens: most tokens generated per prompt (>= 1).
            temperature: 0 = greedy; else sampling at this temperature.
            top_p, top_k: nucleus / top-k filtering of the target distribution when sampling.
            stop_token_ids: a sequence ends after producing one of these (included).
            grammar_bitmask_fn: see :data:`GrammarBitmaskFn`; the target's choice is masked
                at every position, and drafts are masked with the current position's mask.
            generator: random source for sampling (default: torch's global one).
            progress: called with the number of new tokens after every step.

        Returns:
            the tokens per prompt and :class:`GenerationStats`.

        Raises:
            ValueError: bad arguments. Every proposer state is freed on any exit, including
            exceptions and ``KeyboardInterrupt``.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
        _validate_sampling(temperature, top_p, top_k)
        try:
            prompt_ids = [[operator.index(t) for t in p] for p in prompts]
        except TypeError as exc:
            raise TypeError(f"prompts must hold int token ids: {exc}") from None
        if not prompt_ids:
            raise ValueError("no prompts given")
        vocab = int(self.proposer._embed.shape[0])
        for i, p in enumerate(prompt_ids):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if not all(0 <= t < vocab for t in p):
                raise ValueError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab})")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt {i}: {len(p)} + {max_new_tokens} new tokens exceed max_seq_len "
                    f"{self.max_seq_len}"
                )
        stops = frozenset(int(t) for t in (stop_token_ids or ()))
        run = _Run(self, temperature, top_p, top_k, stops, grammar_bitmask_fn, generator)
        seqs: list[_Seq] = []
        t0 = time.perf_counter()
        ttft: dict[int, float] = {}
        counts = {"batched": 0, "single": 0}
        wave = max(1, self.max_active or self.proposer.max_batch)
        try:
            # Waves of at most `wave` live sequences keep the pool's demand bounded.
            for first in range(0, len(prompt_ids), wave):
                group = list(enumerate(prompt_ids))[first : first + wave]
                seqs.extend(self._run_wave(group, run, max_new_tokens, t0, ttft, counts, progress))
        finally:
            for s in seqs:
                self.proposer.free_state(s.state)
        elapsed = time.perf_counter() - t0
        steps = [s.steps for s in seqs]
        flat = [x for st in steps for x in st]
        total = sum(len(s.out) for s in seqs)
        stats = GenerationStats(
            acceptance_lengths=steps,
            mean_tau=(sum(flat) / len(flat)) if flat else 0.0,
            num_new_tokens=total,
            elapsed_s=elapsed,
            tokens_per_s=total / elapsed if elapsed > 0 else 0.0,
            ttft_s=[ttft[i] for i in range(len(seqs))],
            batched_proposals=counts["batched"],
            single_proposals=counts["single"],
        )
        return GenerationResult([s.out for s in seqs], stats)

    def _run_wave(
        self,
        group: list[tuple[int, list[int]]],
        run: _Run,
        max_new_tokens: int,
        t0: float,
        ttft: dict[int, float],
        counts: dict[str, int],
        progress: Callable[[int], None] | None,
    ) -> list[_Seq]:
        """Prefill and decode one group of prompts to completion; frees each finished state.

        On any exception every state of the group is freed before it propagates.
        """
        prop = self.proposer
        seqs: list[_Seq] = []
        try:
            for i, p in group:
                st = prop.alloc_state_for(len(p) + max_new_tokens)
                seq = _Seq(i, len(p), self._new_cache(), st)
                seqs.append(seq)
                logits, rows = self._target_forward(p, seq.cache, last_only=True)
                first_tok = run.choose(seq, logits, [])[0]
                del logits
                prop.commit_ctx(st, rows, range(len(p)))
                seq.out.append(first_tok)
                ttft[i] = time.perf_counter() - t0
                if run.finish_check(seq, max_new_tokens):
                    prop.free_state(st)
                if progress is not None:
                    progress(1)
            while True:
                active = [s for s in seqs if not s.done]
                if not active:
                    break
                want = {
                    s.index: min(prop.block_gamma - 1, max_new_tokens - len(s.out) - 1)
                    for s in active
                }
                drafts: dict[int, list[int]] = {s.index: [] for s in active}
                need = [s for s in active if want[s.index] > 0]
                plain = need if run.mask_fn is None else []
                width = prop.propose_batch_max()
                if len(plain) >= 2 and width >= 2:
                    for c in range(0, len(plain), width):
                        chunk = plain[c : c + width]
                        got = None
                        if len(chunk) >= 2:
                            got = prop.propose_batch(
                                [s.state for s in chunk],
                                [s.out[-1] for s in chunk],
                                [s.prompt_len + len(s.out) - 1 for s in chunk],
                                max(want[s.index] for s in chunk),
                            )
                        if got is not None:
                            counts["batched"] += 1
                            for s, d in zip(chunk, got):
                                drafts[s.index] = d[: want[s.index]]
                        else:
                            for s in chunk:
                                drafts[s.index] = self._propose_one(s, want[s.index], run)
                                counts["single"] += 1
                else:
                    for s in need:
                        drafts[s.index] = self._propose_one(s, want[s.index], run)
                        counts["single"] += 1
                for s in active:
                    before = len(s.out)
                    self._verify(s, drafts[s.index], run, max_new_tokens)
                    if progress is not None:
                        progress(len(s.out) - before)
        finally:
            for s in seqs:
                prop.free_state(s.state)
        return seqs

    def _propose_one(self, s: _Seq, num: int, ctx: _Run) -> list[int]:
        mask = ctx.bitmask(s, [])
        return self.proposer.propose(
            s.state, s.out[-1], s.prompt_len + len(s.out) - 1, num, grammar_bitmask=mask
        )

    def _verify(self, s: _Seq, drafts: list[int], ctx: _Run, max_new_tokens: int) -> None:
        start = s.prompt_len + len(s.out) - 1  # the anchor's position
        logits, rows = self._target_forward([s.out[-1], *drafts], s.cache)
        accepted, nxt = ctx.accept(s, logits, drafts)
        # Keep the target's K/V of the anchor and the accepted drafts only.
        remove = len(drafts) - accepted
        if remove > 0:
            s.cache.crop(-remove)
        self.proposer.after_verify(s.state, accepted)
        new = [*drafts[:accepted], nxt]
        s.steps.append(len(new))
        for tok in new:
            s.out.append(tok)
            if ctx.finish_check(s, max_new_tokens):
                break
        if not s.done:
            self.proposer.commit_ctx(s.state, rows[: accepted + 1], range(start, start + accepted + 1))
        else:
            self.proposer.free_state(s.state)


class _Run:
    """Per-call sampling settings and the accept/choose rules."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        temperature: float,
        top_p: float,
        top_k: int,
        stops: frozenset[int],
        mask_fn: GrammarBitmaskFn | None,
        generator: torch.Generator | None,
    ) -> None:
        self.engine = engine
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.stops = stops
        self.mask_fn = mask_fn
        self.generator = generator

    def bitmask(self, s: _Seq, extra: Sequence[int]) -> Tensor | None:
        if self.mask_fn is None:
            return None
        return self.mask_fn(s.index, [*s.out, *extra])

    def finish_check(self, s: _Seq, max_new_tokens: int) -> bool:
        if s.out[-1] in self.stops or len(s.out) >= max_new_tokens:
            s.done = True
        return s.done

    def _uniform(self, device: torch.device) -> float:
        return float(torch.rand((), generator=self.generator, device=device))

    def _draw(self, probs: Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator)[0])

    def _allowed_row(self, s: _Seq, extra: Sequence[int], vocab: int) -> Tensor | None:
        mask = self.bitmask(s, extra)
        return None if mask is None else _allowed(mask.to(torch.int32).cpu(), vocab)

    @property
    def device_greedy(self) -> bool:
        """Greedy without a grammar mask: the target's choices are a plain argmax, taken on the
        logits' device."""
        return self.temperature <= 0 and self.mask_fn is None

    def choose(self, s: _Seq, logits: Tensor, extra: Sequence[int]) -> list[int]:
        """The target's own choice from the first row of ``logits`` [R, V] (after ``extra``)."""
        if self.device_greedy:
            return [int(torch.argmax(logits[0], dim=-1).item())]
        row = logits[0].cpu().float()
        allowed = self._allowed_row(s, extra, row.shape[-1])
        if self.temperature <= 0:
            if allowed is not None:
                row = row.masked_fill(~allowed, float("-inf"))
            return [int(torch.argmax(row))]
        probs = target_probs(row[None], self.temperature, self.top_p, self.top_k,
                             None if allowed is None else allowed[None])[0]
        return [self._draw(probs)]

    def accept(self, s: _Seq, logits: Tensor, drafts: list[int]) -> tuple[int, int]:
        """``(accepted drafts, next token)`` from the verify logits ``[1 + len(drafts), V]``."""
        if self.device_greedy:
            # One argmax on the device, one small transfer; accept on the host.
            choices: list[int] = torch.argmax(logits, dim=-1).tolist()
            for j, d in enumerate(drafts):
                if d != choices[j]:
                    return j, choices[j]
            return len(drafts), choices[len(drafts)]
        logits = logits.cpu()  # the target's dtype; rows become fp32 only when looked at
        vocab = logits.shape[-1]
        for j in range(len(drafts) + 1):
            allowed = self._allowed_row(s, drafts[:j], vocab)
            row = logits[j].float()
            if self.temperature <= 0:
                if allowed is not None:
                    row = row.masked_fill(~allowed, float("-inf"))
                choice = int(torch.argmax(row))
                if j < len(drafts) and drafts[j] == choice:
                    continue
                return j, choice
            probs = target_probs(row[None], self.temperature, self.top_p, self.top_k,
                                 None if allowed is None else allowed[None])[0]
            if j == len(drafts):
                return j, self._draw(probs)
            d = drafts[j]
            # q is one-hot at d: accept with probability min(1, p(d) / 1).
            if self._uniform(probs.device) < float(probs[d]):
                continue
            residual = probs.clone()
            residual[d] = 0.0
            total = float(residual.sum())
            if total <= 0.0:
                # p was (numerically) all on d, so rejecting d had probability ~0.
                return j, d
            return j, self._draw(residual / total)
        raise AssertionError("unreachable")


def generate(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    grammar_bitmask_fn: GrammarBitmaskFn | None = None,
) -> GenerationResult:
    """Speculative generation for one or many prompts (a one-off :class:`SpeculativeEngine`).

    See :meth:`SpeculativeEngine.generate` for the arguments. Build a
    :class:`SpeculativeEngine` once to reuse its proposer (pool and paged K/V) across calls.
    """
    if not prompts:
        raise ValueError("no prompts given")
    gamma = int(drafter.config.block_size)
    longest = max(len(p) for p in prompts) + max_new_tokens
    block = 16
    # Enough blocks for every live sequence's whole window (one wave), and no more.
    per_seq = -(-(longest + gamma + 1) // block)
    wave = min(len(prompts), 16)
    engine = SpeculativeEngine(
        target,
        drafter,
        max_seq_len=longest,
        max_batch=wave,
        num_blocks=per_seq * wave,
        kv_block_size=block,
    )
    return engine.generate(
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_token_ids=stop_token_ids,
        grammar_bitmask_fn=grammar_bitmask_fn,
    )
