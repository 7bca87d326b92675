"""The DFlash drafter training loop: windows, the frozen target's features, the objective
(:mod:`blockdraft.training.objective`), AdamW steps, checkpoints and the exported drafter.

Determinism: the drafter is initialised on the CPU from ``seed``; step ``s`` draws its windows
and anchors from a generator seeded by ``(seed, s)``; so a run resumed from a checkpoint makes
the same updates as one that never stopped (bit for bit on the CPU).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from blockdraft.checkpoint import save_drafter
from blockdraft.models import DFlashDrafter
from blockdraft.pair import DrafterShape
from blockdraft.training.data import sample_windows, step_generator
from blockdraft.training.drafter import init_from_drafter, init_from_target, new_drafter
from blockdraft.training.objective import (
    LabelMode,
    block_loss,
    loss_weights,
    sample_anchors,
    target_features,
    token_hardness,
)
from blockdraft.training.optim import BudgetCalibrator, adamw, apply_gradients, cosine_lr

log = logging.getLogger(__name__)

STATE_FILE = "training_state.pt"
ARGS_FILE = "training_args.json"


@dataclass
class StepStats:
    """What one training step measured: weighted loss, per-row accuracy [B-1], and the greedy
    acceptance length estimate (mean over blocks of 1 + the number of leading correct rows)."""

    loss: float
    row_accuracy: list[float]
    tau: float


@dataclass
class DrafterTrainConfig:
    """Everything that defines a drafter training run (saved beside its checkpoints).

    Attributes:
        num_layers / block_size / mask_token_id / target_layer_ids: the drafter's shape
            (``target_layer_ids`` empty: the default rule).
        seq_len: window length T; num_seqs: windows per step n; num_anchors: blocks per window A.
        steps: optimizer steps (upper bound when ``time_budget_s`` is set).
        time_budget_s: when > 0, after ``calibrate_steps`` steps the run is shortened so that it
            ends within this many seconds (the chosen step count is logged and saved).
        lr, warmup_steps, weight_decay, grad_clip: AdamW with linear warm-up, then cosine decay
            to ``min_lr_ratio * lr``.
        label_mode: ``"target"`` (the target's greedy choices) or ``"corpus"`` (the tokens).
        gamma: loss decay (``None``: :func:`~blockdraft.training.objective.default_gamma`).
        distill_weight: weight of the distillation term (the target's T = 1 distribution as a
            soft label, for sampled drafts); 0 trains on the hard labels alone.
        dflash2: train a DFlash2 drafter with these ``conv_kernel_size``, ``conv_group_size``,
            ``selector_rank``, ``selector_top_k`` (``None``: DFlash); selector_weight: the
            weight of its selector objective; selector_distill_weight: the weight of the
            selector's distillation (:func:`~blockdraft.training.selector.selector_distill_loss`).
        init_from_target: start the drafter's layers as copies of the target's last layers
            (:func:`~blockdraft.training.drafter.init_from_target`) instead of random weights.
        init_from: start from the weights of this saved drafter instead (continued training;
            :func:`~blockdraft.training.drafter.init_from_drafter`); excludes ``init_from_target``.
        anchor_focus: the fraction of each window's anchors drawn where the target was unsure
            of the anchor token (:func:`~blockdraft.training.objective.sample_anchors`); 0: all uniform.
        save_every: steps between checkpoints (0: only at the end); keep: checkpoints kept.
        save_dtype: dtype of the exported drafter.
    """

    num_layers: int = 1
    block_size: int = 16
    mask_token_id: int = -1
    target_layer_ids: list[int] = field(default_factory=list)
    intermediate_size: int | None = None
    seq_len: int = 512
    num_seqs: int = 16
    num_anchors: int = 64
    steps: int = 1000
    time_budget_s: float = 0.0
    calibrate_steps: int = 20
    lr: float = 6e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    label_mode: LabelMode = "target"
    gamma: float | None = None
    distill_weight: float = 0.0
    dflash2: dict[str, int] | None = None
    selector_weight: float = 1.0
    anchor_focus: float = 0.0
    selector_distill_weight: float = 0.0
    init_from_target: bool = False
    init_from: str | None = None
    seed: int = 0
    save_every: int = 0
    keep: int = 2
    save_dtype: str = "bfloat16"
    log_every: int = 50

def lr_at(step: int, total: int, cfg: DrafterTrainConfig) -> float:
    """Learning rate of (0-based) ``step`` out of ``total``."""
    return cosine_lr(step, total, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)


@dataclass
class TrainResult:
    """Where the drafter went and what the run did."""

    drafter_dir: Path
    steps: int
    seconds: float
    context_tokens: int
    final_loss: float
    final_tau: float
    history: list[dict[str, float]]


def _checkpoints(out: Path) -> list[tuple[int, Path]]:
    found = []
    for p in (out / "checkpoints").glob("step-*"):
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def train_drafter(
    target: Any,
    stream: Tensor,
    cfg: DrafterTrainConfig,
    out: Path,
    *,
    resume: bool = False,
    progress: bool = True,
    on_step: Callable[[int, StepStats], None] | None = None,
) -> TrainResult:
    """Train a drafter for the frozen ``target`` on windows of ``stream`` [N] int64.

    The target runs in its own dtype on its device; on CUDA the drafter keeps fp32 master
    weights and computes under bf16 autocast. Checkpoints go to ``out/checkpoints/step-N``
    (every ``save_every`` steps), the final drafter to ``out/drafter`` (z-lab format).

    Args:
        resume: continue from the newest checkpoint under ``out`` (its saved config must agree
            with ``cfg`` on everything but ``steps``/``time_budget_s``/``save_every``).
    Raises:
        ValueError: a bad shape, mask token outside the embeddings, or a config mismatch on
            resume.
    """
    from tqdm import tqdm  # type: ignore[import-untyped]

    device = next(target.parameters()).device
    target.eval()
    target.requires_grad_(False)
    embed_weight = target.get_input_embeddings().weight
    head = getattr(target, "lm_head", None)
    if head is None:
        head = target.get_output_embeddings()
    head_weight = head.weight
    if not 0 <= cfg.mask_token_id < embed_weight.shape[0]:
        raise ValueError(
            f"mask_token_id {cfg.mask_token_id} is outside the target's embeddings ({embed_weight.shape[0]} rows)"
        )
    shape = DrafterShape.for_target(
        target.config,
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=cfg.target_layer_ids or None,
        intermediate_size=cfg.intermediate_size,
        dflash2=cfg.dflash2,
    )
    raw = shape.config_dict()
    layer_ids = shape.target_layer_ids
    if cfg.init_from_target and cfg.init_from:
        raise ValueError("init_from_target and init_from exclude each other")
    if cfg.selector_distill_weight < 0 or (cfg.selector_distill_weight > 0 and cfg.dflash2 is None):
        raise ValueError(f"selector_distill_weight {cfg.selector_distill_weight} needs a DFlash2 drafter (dflash2) "
                         "and a weight >= 0")
    if not 0.0 <= cfg.anchor_focus <= 1.0:
        raise ValueError(f"anchor_focus must be in [0, 1], not {cfg.anchor_focus}")
    drafter = new_drafter(raw, cfg.seed)
    if cfg.init_from_target:
        init_from_target(drafter, target)
    elif cfg.init_from:
        init_from_drafter(drafter, Path(cfg.init_from))
    drafter = drafter.to(device)
    drafter.train()
    opt = adamw(drafter, cfg.lr, cfg.weight_decay)
    weights = loss_weights(cfg.block_size, cfg.gamma).to(device)
    out.mkdir(parents=True, exist_ok=True)
    volatile = {"steps", "time_budget_s", "save_every", "keep", "log_every"}
    fixed = {k: v for k, v in asdict(cfg).items() if k not in volatile}
    start, total = 0, cfg.steps
    history: list[dict[str, float]] = []
    if resume:
        ckpts = _checkpoints(out)
        if not ckpts:
            raise ValueError(f"--resume: no checkpoint under {out / 'checkpoints'}")
        step, path = ckpts[-1]
        saved = json.loads((path / ARGS_FILE).read_text(encoding="utf-8"))
        diff = {k for k in fixed if saved.get(k) != fixed[k]}
        if diff:
            raise ValueError(f"--resume: checkpoint {path} was made with different settings: {sorted(diff)}")
        state = torch.load(path / STATE_FILE, map_location=device, weights_only=True)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        start, total = int(state["step"]), int(state["total"])
        history = list(state.get("history", []))
        log.info("resumed from %s at step %d of %d", path, start, total)
    (out / ARGS_FILE).write_text(json.dumps(asdict(cfg), indent=2) + "\n", encoding="utf-8")

    use_amp = device.type == "cuda"
    distills = cfg.distill_weight > 0 or cfg.selector_distill_weight > 0  # the latter: DFlash2 (checked)
    stream = stream.to("cpu")
    tau_ema = loss_ema = float("nan")
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=start, disable=not progress, unit="step", dynamic_ncols=True)
    step = start
    last = StepStats(float("nan"), [], float("nan"))
    calibrated = start >= cfg.calibrate_steps or cfg.time_budget_s <= 0
    calibrator = BudgetCalibrator(cfg.time_budget_s, cfg.calibrate_steps, device, t0)
    try:
        while step < total:
            gen = step_generator(cfg.seed, step)
            tokens = sample_windows(stream, cfg.num_seqs, cfg.seq_len, gen).to(device)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, cfg)
            ctx, labels, soft = target_features(target, tokens, layer_ids, cfg.label_mode,
                                                keep_logits=distills or cfg.anchor_focus > 0)
            hardness = token_hardness(soft, tokens).cpu() if cfg.anchor_focus > 0 and soft is not None else None
            if not distills:
                soft = None
            anchors = sample_anchors(cfg.num_seqs, cfg.seq_len, cfg.num_anchors, cfg.block_size, gen,
                                     focus=cfg.anchor_focus, hardness=hardness).to(device)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=use_amp):
                loss, correct = block_loss(
                    drafter, ctx, tokens, labels, anchors, embed_weight, head_weight, weights,
                    soft_logits=soft, distill_weight=cfg.distill_weight, selector_weight=cfg.selector_weight,
                    selector_distill_weight=cfg.selector_distill_weight,
                )
            apply_gradients(opt, loss, drafter, cfg.grad_clip)
            step += 1
            if step % cfg.log_every == 0 or step == total or step == start + 1:
                lv = float(loss.detach())
                acc = correct.float().mean(dim=(0, 1)).tolist()
                tau = float(correct.long().cumprod(dim=-1).sum(-1).float().mean()) + 1.0
                last = StepStats(lv, acc, tau)
                tau_ema = tau if math.isnan(tau_ema) else 0.8 * tau_ema + 0.2 * tau
                loss_ema = lv if math.isnan(loss_ema) else 0.8 * loss_ema + 0.2 * lv
                history.append({"step": float(step), "loss": lv, "tau": tau})
                bar.set_postfix(loss=f"{loss_ema:.3f}", tau=f"{tau_ema:.2f}")
                if on_step is not None:
                    on_step(step, last)
            bar.update(1)
            if not calibrated:
                total, calibrated = calibrator.check(step - start, step, total)
                bar.total = total
            if cfg.save_every and step % cfg.save_every == 0 and step < total:
                _save_checkpoint(out, step, total, drafter, opt, cfg, history)
    finally:
        bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    drafter.eval()
    drafter_dir = save_drafter(drafter, raw, out / "drafter", cfg.save_dtype)
    _save_checkpoint(out, step, total, drafter, opt, cfg, history)
    ctx_tokens = (step - start) * cfg.num_seqs * cfg.seq_len
    log.info(
        "trained %d steps in %.1f s (%.2f s per 1M context tokens); loss %.3f, tau estimate %.2f -> %s",
        step - start, seconds, seconds / max(1, ctx_tokens) * 1e6, last.loss, last.tau, drafter_dir,
    )
    return TrainResult(drafter_dir, step, seconds, ctx_tokens, last.loss, last.tau, history)


def _save_checkpoint(
    out: Path,
    step: int,
    total: int,
    drafter: DFlashDrafter,
    opt: torch.optim.Optimizer,
    cfg: DrafterTrainConfig,
    history: list[dict[str, float]],
) -> None:
    path = out / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True, exist_ok=True)
    state = {"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step, "total": total,
             "history": history}
    torch.save(state, path / STATE_FILE)
    (path / ARGS_FILE).write_text(json.dumps(asdict(cfg), indent=2) + "\n", encoding="utf-8")
    for _, old in _checkpoints(out)[: -max(1, cfg.keep)]:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
