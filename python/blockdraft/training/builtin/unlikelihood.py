"""Fine-tuning a target so that its greedy continuations stop looping: sequence-level unlikelihood.

A small code model decoded greedily falls into loops: once a line repeats, repeating it again
becomes the likeliest continuation (``docs/training.md`` shows the built-in target doing it).
Maximum likelihood alone does not see this, because it never scores the model's own output.
The sequence-level unlikelihood objective (Welleck et al., 2019, "Neural text generation with
unlikelihood training") does: the model continues prompts greedily, every token that completes an
n-gram already seen earlier in the same continuation is a *negative*, and the loss
``-log(1 - p(token | prefix))`` pushes its probability down. Mixed with the usual next-token
loss on the corpus, so that the repeats real code has (``self.``, a run of imports) stay
likely, it removes the degenerate loops and costs little held-out perplexity.

Per step: ``batch`` corpus windows for the next-token loss, and ``ul_batch`` of the model's own
greedy continuations (regenerated every ``regen_every`` steps, from prompts drawn as
:func:`~blockdraft.training.rollouts.prompt_starts` draws them) for the unlikelihood term.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from blockdraft.devices import sync
from blockdraft.training.data import sample_windows, step_generator
from blockdraft.training.optim import BudgetCalibrator, adamw, apply_gradients, cosine_lr
from blockdraft.training.rollouts import prompt_starts, rollout

log = logging.getLogger(__name__)


def repeated_ngram_mask(tokens: Tensor, n: int = 4) -> Tensor:
    """Which tokens repeat an ``n``-gram: [b, L] bool for ``tokens`` [b, L].

    A token is marked when it completes an ``n``-gram that already occurred, whole, earlier in
    its row (the n-gram ending at ``t`` equals one ending at some ``s < t``). Only the
    completing token is marked, not the ``n - 1`` before it: those are common tokens (a
    newline, an indent, ``self``) that a repeat shares with good code, and making them
    unlikely teaches the model to avoid ordinary tokens rather than loops.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, not {n}")
    rows = tokens.tolist()
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    for r, row in enumerate(rows):
        seen: set[tuple[int, ...]] = set()
        for t in range(n - 1, len(row)):
            gram = tuple(row[t - n + 1 : t + 1])
            if gram in seen:
                mask[r, t] = True
            else:
                seen.add(gram)
    return mask.to(tokens.device)


def unlikelihood_loss(logits: Tensor, tokens: Tensor, negatives: Tensor) -> Tensor:
    """Mean over all positions of ``-log(1 - p(token))`` at the ``negatives``, 0 elsewhere.

    Args:
        logits: [b, L, V] the model's logits for each position of ``tokens`` (the row that
            predicts it, i.e. already shifted).
        tokens: [b, L] the tokens written at those positions.
        negatives: [b, L] bool, the tokens to make unlikely (:func:`repeated_ngram_mask`).
    """
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]
    # log(1 - p) from log p, stable near p = 1 (where a loop's tokens sit).
    one_minus = torch.log1p(-logp.exp().clamp(max=1.0 - 1e-6))
    return -(one_minus * negatives.float()).sum() / tokens.numel()


@dataclass
class TuneConfig:
    """One unlikelihood fine-tuning run of a target.

    Attributes:
        steps: optimizer steps (an upper bound when ``time_budget_s`` is set).
        lr / warmup_steps / min_lr_ratio: AdamW, linear warm-up then cosine decay to
            ``min_lr_ratio * lr``.
        batch / seq_len: corpus windows of the next-token loss per step, and their length.
        ul_batch / prompt_len / new_tokens: greedy continuations of the unlikelihood term per
            step, the prompt length and continuation length.
        ngram: n of the repeated n-grams that make negatives.
        ul_weight: weight of the unlikelihood term.
        regen_every: steps between regenerations of the continuations (``regen_every *
            ul_batch`` are written at once, by the model as it is then).
        doc_fraction: share of prompts that start a document.
        kl_weight: weight of ``KL(p_start || p)`` on the corpus windows, where ``p_start`` is
            the model as the tuning found it (a frozen copy). The unlikelihood term alone
            lowers the model's confidence on code in general, not only on repeats; this term
            holds its distribution on real code where it was (0: off).
        own_weight: weight of the cross-entropy of the continuations' tokens that are not
            negatives (:func:`own_choice_loss`): the model's own greedy choices where they
            repeat nothing, made likelier. The unlikelihood term takes probability from the
            repeats; this term keeps the model sure of its other choices, along the very
            text it writes (0: off).
    """

    steps: int = 500
    lr: float = 3e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    batch: int = 32
    seq_len: int = 512
    ul_batch: int = 32
    prompt_len: int = 64
    new_tokens: int = 128
    ngram: int = 4
    ul_weight: float = 1.0
    regen_every: int = 10
    doc_fraction: float = 0.5
    kl_weight: float = 0.0
    own_weight: float = 0.0
    time_budget_s: float = 0.0
    seed: int = 0


def tune_target(model: Any, stream: Tensor, eos_id: int, cfg: TuneConfig) -> dict[str, Any]:
    """Fine-tune ``model`` in place on ``stream`` [N] with next-token + unlikelihood losses.

    On CUDA the forward runs under bf16 autocast (fp32 master weights). Returns what the run
    did: steps, seconds, the last losses, and the share of continuation tokens that were
    negatives at the first and last regeneration (how much the greedy output repeats).
    """
    from tqdm import tqdm  # type: ignore[import-untyped]

    device = next(model.parameters()).device
    use_amp = device.type == "cuda"
    # The model as the tuning found it, for the KL term: a frozen copy.
    start = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_weight > 0 else None
    opt = adamw(model, cfg.lr, 0.1)
    total = cfg.steps
    t0 = time.perf_counter()
    calibrator = BudgetCalibrator(cfg.time_budget_s, max(cfg.regen_every, 10), device, t0)
    settled = cfg.time_budget_s <= 0
    pool: tuple[Tensor, Tensor, Tensor] | None = None
    repeat_share: list[float] = []
    mle_v = ul_v = kl_v = own_v = float("nan")
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc="unlikelihood")
    step = 0
    while step < total:
        k = step % cfg.regen_every
        if k == 0:
            pool = _continuations(model, stream, eos_id, cfg, step)
            repeat_share.append(float(pool[2].float().mean()))
        assert pool is not None
        lr = cosine_lr(step, total, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        windows = sample_windows(stream, cfg.batch, cfg.seq_len, step_generator(cfg.seed, step)).to(device)
        rows = slice(k * cfg.ul_batch, (k + 1) * cfg.ul_batch)
        prompts, cont, neg = (x[rows].to(device) for x in pool)
        model.train()
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=use_amp):
            corpus = model(input_ids=windows, labels=windows, use_cache=False)
            mle = corpus.loss
            full = torch.cat((prompts, cont), dim=1)
            logits = model(input_ids=full, use_cache=False).logits[:, prompts.shape[1] - 1 : -1]
            ul = unlikelihood_loss(logits, cont, neg)
            own = own_choice_loss(logits, cont, neg) if cfg.own_weight > 0 else torch.zeros((), device=device)
            kl = torch.zeros((), device=device)
            if start is not None:
                with torch.no_grad():
                    ref = start(input_ids=windows, use_cache=False).logits
                kl = kl_to_start(corpus.logits, ref)
        loss = mle + cfg.ul_weight * ul + cfg.kl_weight * kl + cfg.own_weight * own
        apply_gradients(opt, loss, model, 1.0)
        step += 1
        bar.update(1)
        if step % 10 == 0 or step == total:
            mle_v, ul_v, kl_v, own_v = (float(x.detach()) for x in (mle, ul, kl, own))
            bar.set_postfix(mle=f"{mle_v:.3f}", ul=f"{ul_v:.4f}", kl=f"{kl_v:.4f}", own=f"{own_v:.3f}",
                            repeats=f"{repeat_share[-1]:.2f}")
        if not settled:
            total, settled = calibrator.check(step, step, total)
            bar.total = total
    bar.close()
    sync(device)
    model.eval()
    seconds = time.perf_counter() - t0
    out = {"steps": step, "seconds": seconds, "final_mle_loss": mle_v, "final_ul_loss": ul_v, "final_kl": kl_v,
           "final_own_loss": own_v,
           "repeat_share_first": repeat_share[0] if repeat_share else float("nan"),
           "repeat_share_last": repeat_share[-1] if repeat_share else float("nan"),
           "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}}
    log.info("unlikelihood tuning: %d steps in %.0f s; repeated-4-gram share of the greedy "
             "continuations %.3f -> %.3f", step, seconds, out["repeat_share_first"], out["repeat_share_last"])
    return out


def own_choice_loss(logits: Tensor, tokens: Tensor, negatives: Tensor) -> Tensor:
    """Mean cross-entropy of ``tokens`` [b, L] at the positions that are not ``negatives``
    [b, L] (0 when every position is one); ``logits`` [b, L, V] as for :func:`unlikelihood_loss`."""
    keep = (~negatives).float()
    ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten(), reduction="none")
    return (ce * keep.flatten()).sum() / keep.sum().clamp(min=1.0)


def kl_to_start(logits: Tensor, start_logits: Tensor) -> Tensor:
    """Mean over positions of ``KL(softmax(start_logits) || softmax(logits))``: [..., V] each."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    logp = torch.log_softmax(start_logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def _continuations(
    model: Any, stream: Tensor, eos_id: int, cfg: TuneConfig, step: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(prompts, greedy continuations, negatives) for the next ``regen_every`` steps, on the CPU."""
    n = cfg.regen_every * cfg.ul_batch
    gen = step_generator(cfg.seed + 1, step)
    starts = prompt_starts(stream, eos_id, n, cfg.prompt_len, gen, doc_fraction=cfg.doc_fraction)
    # Shuffle, so that each step's rows mix document starts and random offsets.
    starts = starts[torch.randperm(n, generator=gen)]
    prompts = torch.stack([stream[s : s + cfg.prompt_len] for s in starts.tolist()])
    device = next(model.parameters()).device
    model.eval()
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        cont = rollout(model, prompts.to(device), cfg.new_tokens).cpu()
    return prompts, cont, repeated_ngram_mask(cont, cfg.ngram)
