"""Evaluating a trained drafter with the real speculative loop (:class:`SpeculativeEngine`).

tau is the mean number of tokens one speculative step produces (accepted drafts + the bonus
token), over every step of every prompt. Greedy tau also comes with a check that the output is
the target's own greedy output, and (optionally) timed comparisons against the two target-only
baselines: greedy decoding on the same runtime (:func:`blockdraft.decode`, when the engine runs
the target on blockdraft's runtime) and Hugging Face ``generate``.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from blockdraft.devices import sync
from blockdraft.engine import SpeculativeEngine
from blockdraft.engine.generate import pool_sizes
from blockdraft.sampling import SamplingParams
from blockdraft.target import decode

log = logging.getLogger(__name__)


@dataclass
class EvalReport:
    """Results of :func:`evaluate_drafter`.

    Attributes:
        tau: per temperature (``"greedy"``, ``"T=1"``, ...) the mean tokens per step.
        tokens_per_s: per temperature, generated tokens per second of the engine over one pass
            of every prompt; with a target-only comparison the ``"greedy"`` rate is instead the
            median of the timed rounds.
        target_tokens_per_s: Hugging Face ``generate``, target only, greedy (``None`` when not
            compared).
        speedup: greedy engine tokens/s over Hugging Face target-only tokens/s: with
            ``repeats`` > 1 the median of the per-repeat ratios (each repeat times the engine and
            then the target alone on every prompt, so drift of the machine hits both sides).
        runtime_tokens_per_s / runtime_speedup: the same for target-only decoding on the
            engine's runtime (``None`` on the Hugging Face target); ``runtime_tokens_per_s_runs``
            the per-repeat rates.
        speedup_runs: the per-repeat ratios (a property of the two per-repeat rate lists).
        greedy_tokens_per_s_runs / target_tokens_per_s_runs: the per-repeat rates; the
            ``tokens_per_s["greedy"]`` and ``target_tokens_per_s`` figures are their medians.
        identical: prompts whose greedy output equals the target-only output, of ``num_prompts``.
        first_divergence: per differing prompt, the index of the first differing token.
        distinct_4gram: mean over prompts of :func:`distinct_ngram_ratio` (n = 4) of the greedy
            continuation: near 0 for a continuation that loops, 1 when no 4-gram repeats.
    """

    num_prompts: int
    max_new_tokens: int
    device: str
    dtype: str
    tau: dict[str, float] = field(default_factory=dict)
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    target_tokens_per_s: float | None = None
    speedup: float | None = None
    greedy_tokens_per_s_runs: list[float] = field(default_factory=list)
    target_tokens_per_s_runs: list[float] = field(default_factory=list)
    identical: int | None = None
    first_divergence: list[int] = field(default_factory=list)
    runtime_tokens_per_s: float | None = None
    runtime_speedup: float | None = None
    runtime_tokens_per_s_runs: list[float] = field(default_factory=list)
    distinct_4gram: float | None = None

    @property
    def speedup_runs(self) -> list[float]:
        """Per repeat: engine tokens/s over target-only tokens/s."""
        return [
            e / t
            for e, t in zip(self.greedy_tokens_per_s_runs, self.target_tokens_per_s_runs)
            if t > 0
        ]

    def lines(self) -> list[str]:
        """A human-readable summary: each rate once, saying what it times.

        With a target-only comparison the greedy engine rate is the median of the timed rounds
        (the same figure the speed-up divides); the first greedy pass, which measures tau and
        also pays first-use costs (graph captures, kernel compiles), is not reported as a rate.
        """
        out = [f"{self.num_prompts} prompts x {self.max_new_tokens} new tokens on {self.device} ({self.dtype})"]
        rounds = len(self.greedy_tokens_per_s_runs)
        for key, tau in self.tau.items():
            rate = self.tokens_per_s.get(key, 0.0)
            timed = _median_of(rounds) if key == "greedy" and rounds else "one pass over the prompts"
            drafts = " (sampled drafts)" if key.endswith(" sampled") else ""
            out.append(f"  {key.removesuffix(' sampled'):>7}: tau {tau:.2f}  engine {rate:.1f} tok/s ({timed})"
                       f"{drafts}")
        if self.distinct_4gram is not None:
            out.append(f"  greedy continuations: distinct 4-gram ratio {self.distinct_4gram:.2f} (mean)")
        if self.runtime_tokens_per_s is not None:
            out.append(f"  target only, blockdraft runtime (greedy): {self.runtime_tokens_per_s:.1f} "
                       f"tok/s ({_median_of(len(self.runtime_tokens_per_s_runs))})")
        if self.target_tokens_per_s is not None:
            out.append(f"  target only, Hugging Face generate (greedy): {self.target_tokens_per_s:.1f} "
                       f"tok/s ({_median_of(len(self.target_tokens_per_s_runs))})")
            if self.runtime_speedup is not None:
                out.append(f"  speed-up over target-only decoding on the same runtime (median of the "
                           f"per-round ratios): {self.runtime_speedup:.2f}x")
            if self.speedup is not None:
                out.append(f"  speed-up over Hugging Face generate (median of the per-round ratios): "
                           f"{self.speedup:.2f}x")
            out.append(f"  identical output on {self.identical}/{self.num_prompts} prompts")
            if len(self.speedup_runs) > 1:
                runs = ", ".join(f"{x:.2f}" for x in self.speedup_runs)
                out.append(f"  speed-up per repeat (median above): {runs}")
        return out


def distinct_ngram_ratio(tokens: Sequence[int], n: int = 4) -> float:
    """Distinct ``n``-grams over all ``n``-grams of ``tokens`` (1.0 when there are none).

    A continuation stuck in a loop repeats the same few n-grams and scores near 0.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, not {n}")
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.no_grad()
def heldout_metrics(model: Any, stream: torch.Tensor, chars: int, *, seq_len: int = 512,
                    batch: int = 32) -> dict[str, float]:
    """Next-token quality of a causal LM on a held-out token stream, all of it.

    The stream is cut into consecutive windows of ``seq_len`` tokens (the last one shorter);
    every token but each window's first is predicted. ``chars`` is the character count of the
    text the stream encodes, for a figure that does not depend on the tokenizer.

    Returns:
        ``loss`` (nats per predicted token), ``perplexity``, ``accuracy`` (argmax equals the
        next token), ``p_argmax`` (the mean probability of the argmax: how sure the model is),
        ``bits_per_char`` (the summed loss over ``chars``, in bits), ``tokens``.
    """
    device = next(model.parameters()).device
    total = correct = top = count = 0.0
    windows = [stream[i : i + seq_len] for i in range(0, stream.numel() - 1, seq_len)]
    windows = [w for w in windows if w.numel() > 1]
    for i in range(0, len(windows), batch):
        group = windows[i : i + batch]
        width = max(w.numel() for w in group)
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        valid = torch.zeros(len(group), width, dtype=torch.bool)
        for row, w in enumerate(group):
            ids[row, : w.numel()] = w
            valid[row, : w.numel()] = True
        ids, valid = ids.to(device), valid.to(device)
        logits = model(input_ids=ids, attention_mask=valid.long(), use_cache=False).logits[:, :-1].float()
        nxt, mask = ids[:, 1:], valid[:, 1:]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), nxt, reduction="none")
        total += float(ce[mask].sum())
        best, arg = logits.softmax(-1).max(-1)
        correct += float((arg == nxt)[mask].sum())
        top += float(best[mask].sum())
        count += float(mask.sum())
    loss = total / max(1.0, count)
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": correct / max(1.0, count),
            "p_argmax": top / max(1.0, count), "bits_per_char": total / math.log(2) / max(1, chars),
            "tokens": count}


def _median_of(rounds: int) -> str:
    return f"median of {rounds} timed round{'' if rounds == 1 else 's'}"


def heldout_prompts(texts: Sequence[str], tokenizer: Any, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens of the first ``num_prompts`` texts long enough for it."""
    prompts: list[list[int]] = []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= 2 * prompt_tokens:
            prompts.append(ids[:prompt_tokens])
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"no text has at least {2 * prompt_tokens} tokens")
    return prompts


@torch.inference_mode()
def target_only_greedy(target: Any, prompt: Sequence[int], max_new_tokens: int,
                       stop_token_ids: Sequence[int] = ()) -> list[int]:
    """Hugging Face ``generate``, greedy, target only (cut after the first stop token)."""
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    stops = list(stop_token_ids)
    got = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=stops or None,
                          pad_token_id=stops[0] if stops else 0)
    out: list[int] = got[0, ids.shape[1]:].tolist()
    for i, t in enumerate(out):
        if t in stops:
            return out[: i + 1]
    return out


@torch.inference_mode()
def evaluate_drafter(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperatures: Sequence[float] = (0.0, 1.0),
    compare_target: bool = True,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
    backend: str = "auto",
    repeats: int = 1,
    sampled_drafts: bool = False,
) -> EvalReport:
    """tau (and tokens/s) of ``drafter`` with ``target`` on ``prompts``, one prompt at a time.

    At a temperature > 0 the drafts are the drafter's argmax; with ``sampled_drafts`` a second
    pass samples them from the drafter's own distribution (reported as ``"T=1 sampled"``).

    One warm-up prompt runs first (not counted) so that kernel compilation and allocator
    growth stay out of the timings. With ``compare_target``, ``repeats`` rounds each time the
    greedy engine and then the target-only loop over all prompts; the reported rates are
    medians and the speed-up is the median of the per-round ratios. Both sides use torch's
    own attention backend choice (the engine's ``sdpa_backends=None``).

    Raises:
        ValueError: ``repeats`` < 1 or no prompts.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats}")
    if not prompts:
        raise ValueError("no prompts given")
    device = next(target.parameters()).device
    longest = max(len(p) for p in prompts) + max_new_tokens
    block = int(drafter.config.block_size)
    # One prompt at a time: pools for the longest one alone.
    target_pages, drafter_pages = pool_sizes([longest - max_new_tokens], max_new_tokens, block)
    def make_engine(sampled: bool) -> SpeculativeEngine:
        return SpeculativeEngine(
            target, drafter, max_seq_len=longest, max_active=1, max_batch=1,
            target_pages=target_pages, num_pages=drafter_pages, page_size=16, backend=backend,
            sdpa_backends=None, sampled_drafts=sampled,
            draft_length=block - 1,  # the drafter's own acceptance, not the scheduler's choice
        )

    engine = make_engine(False)
    report = EvalReport(len(prompts), max_new_tokens, str(device), str(next(target.parameters()).dtype))
    stops = list(stop_token_ids)
    engine.generate([prompts[0]], max_new_tokens=min(16, max_new_tokens), stop_token_ids=stops)
    greedy_out: list[list[int]] = []

    def run_engine(temp: float, eng: SpeculativeEngine) -> tuple[list[int], int, float, list[list[int]]]:
        """(acceptance lengths, new tokens, seconds, outputs) over every prompt."""
        # The engine samples from rows it has moved to the CPU.
        gen = torch.Generator().manual_seed(seed) if temp > 0 else None
        steps: list[int] = []
        outs: list[list[int]] = []
        tokens = 0
        sync(device)
        t0 = time.perf_counter()
        for p in prompts:
            res = eng.generate([list(p)], max_new_tokens=max_new_tokens, sampling=SamplingParams(temp),
                               stop_token_ids=stops, generator=gen)
            steps.extend(res.stats.acceptance_lengths[0])
            tokens += res.stats.num_new_tokens
            outs.append(res.tokens[0])
        sync(device)
        return steps, tokens, time.perf_counter() - t0, outs

    def run_target() -> tuple[list[list[int]], float]:
        sync(device)
        t0 = time.perf_counter()
        outs = [target_only_greedy(target, p, max_new_tokens, stops) for p in prompts]
        sync(device)
        return outs, time.perf_counter() - t0

    # (key, temperature, engine): argmax drafts at every temperature, then, when asked, drafts
    # sampled from the drafter at each temperature > 0 (an engine of their own).
    passes = [("greedy" if t == 0 else f"T={t:g}", t, engine) for t in temperatures]
    if sampled_drafts and any(t > 0 for t in temperatures):
        sampler = make_engine(True)
        passes += [(f"T={t:g} sampled", t, sampler) for t in temperatures if t > 0]
    for key, temp, eng in passes:
        steps, tokens, elapsed, outs = run_engine(temp, eng)
        if key == "greedy":
            greedy_out = outs
            report.distinct_4gram = statistics.fmean(distinct_ngram_ratio(o) for o in outs)
        report.tau[key] = sum(steps) / max(1, len(steps))
        report.tokens_per_s[key] = tokens / elapsed if elapsed > 0 else 0.0
        log.debug("%s pass: tau %.2f, %.1f tok/s", key, report.tau[key], report.tokens_per_s[key])
    if compare_target:
        target_only_greedy(target, prompts[0], min(16, max_new_tokens), stops)
        runtime = engine.runtime
        if runtime is not None:
            decode(runtime, [list(prompts[0])], max_new_tokens=min(16, max_new_tokens),
                   stop_token_ids=stops)
        ref: list[list[int]] = []
        runtime_ratios: list[float] = []
        for r in range(repeats):
            # A fresh engine run each round (the first greedy pass above also paid first-use
            # costs: graph captures, kernel compiles for new shapes).
            _, tokens, elapsed, _ = run_engine(0.0, engine)
            engine_rate = tokens / elapsed if elapsed > 0 else 0.0
            ref, elapsed = run_target()
            target_rate = sum(len(x) for x in ref) / elapsed if elapsed > 0 else 0.0
            report.greedy_tokens_per_s_runs.append(engine_rate)
            report.target_tokens_per_s_runs.append(target_rate)
            if runtime is not None:
                sync(device)
                t0 = time.perf_counter()
                done = 0
                for p in prompts:
                    done += decode(runtime, [list(p)], max_new_tokens=max_new_tokens,
                                   stop_token_ids=stops).stats.num_new_tokens
                sync(device)
                rate = done / (time.perf_counter() - t0)
                report.runtime_tokens_per_s_runs.append(rate)
                if rate > 0:
                    runtime_ratios.append(engine_rate / rate)
            log.debug("round %d: engine %.1f tok/s, target only %.1f tok/s", r + 1, engine_rate,
                      target_rate)
        report.target_tokens_per_s = statistics.median(report.target_tokens_per_s_runs)
        if report.runtime_tokens_per_s_runs:
            report.runtime_tokens_per_s = statistics.median(report.runtime_tokens_per_s_runs)
            report.runtime_speedup = statistics.median(runtime_ratios) if runtime_ratios else None
        if "greedy" in report.tokens_per_s:
            report.tokens_per_s["greedy"] = statistics.median(report.greedy_tokens_per_s_runs)
        if report.speedup_runs and "greedy" in report.tokens_per_s:
            report.speedup = statistics.median(report.speedup_runs)
        if greedy_out:
            report.identical = sum(a == b for a, b in zip(greedy_out, ref))
            for a, b in zip(greedy_out, ref):
                if a != b:
                    report.first_divergence.append(
                        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    )
    return report
