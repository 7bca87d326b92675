"""What the drafter and target training loops share: AdamW, the cosine schedule, one
optimizer step, and fitting a run's step count to a time budget."""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def cosine_lr(step: int, total: int, lr: float, warmup_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of (0-based) ``step`` out of ``total``: linear warm-up over ``warmup_steps``,
    then cosine decay from ``lr`` to ``min_lr_ratio * lr`` at ``total``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(module: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) over ``module``'s parameters, with ``weight_decay`` on the
    matrices only (norm weights and biases are not decayed)."""
    decay = [p for p in module.parameters() if p.dim() > 1]
    rest = [p for p in module.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def apply_gradients(opt: torch.optim.Optimizer, loss: Tensor, module: torch.nn.Module, grad_clip: float) -> None:
    """One optimizer step on ``loss``: clear, backpropagate, clip the gradient norm of
    ``module``'s parameters at ``grad_clip`` (0: no clipping), step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(module.parameters(), grad_clip)
    opt.step()


class BudgetCalibrator:
    """Fits a run's step count to a time budget.

    The first ``n`` steps are not timed (CUDA context, allocator growth, kernel autotuning make
    them slow); the next ``n`` give the time per step, and the remaining budget is divided by it.
    """

    def __init__(self, budget_s: float, n: int, device: torch.device, t0: float) -> None:
        self.budget_s, self.n, self.device, self.t0 = budget_s, max(1, n), device, t0
        self.mark: float | None = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def check(self, done: int, step: int, total: int) -> tuple[int, bool]:
        """After ``done`` steps of this run (global ``step``): (total steps, whether settled)."""
        if done == self.n:
            self.mark = self._now()
        if done < 2 * self.n or self.mark is None:
            return total, False
        now = self._now()
        per_step = (now - self.mark) / self.n
        remaining = self.budget_s - (now - self.t0)
        fit = step + max(1, int(remaining / per_step))
        if fit < total:
            total = fit
        log.info("time budget %.0f s at %.1f ms/step: %d steps in all", self.budget_s, per_step * 1000, total)
        return total, True

