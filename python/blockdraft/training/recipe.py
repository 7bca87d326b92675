"""The DFlash drafter training recipe.

The target is frozen. Per step, ``n`` token windows of length ``T`` go through the target once;
the hidden states of the ``target_layer_ids`` layers are the drafter's context, and the target's
greedy choices (teacher-forced on the window) are the labels. In every window ``A`` anchor
positions are drawn; each anchor ``a`` makes one block: the clean token at ``a`` followed by
``B - 1`` MASK tokens at positions ``a .. a + B - 1``. All ``A`` blocks of a window go through
the drafter in one pass, with a boolean attention mask in which a block row sees

* the context rows at positions strictly before its anchor (exactly what inference has: the
  anchor is the last verified token, whose hidden state is not yet known), and
* every row of its own block (bidirectional), and no row of any other block.

Block row ``k`` (1..B-1) predicts the token at ``a + k`` through the target's ``lm_head``; the
cross-entropy of row ``k`` is weighted by ``exp(-(k - 1) / gamma)``, since a draft token only
counts when every earlier one was accepted. The target's embeddings and ``lm_head`` are shared
and frozen; only the drafter's layers, ``fc`` and norms learn.

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
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from blockdraft.config import DrafterConfig
from blockdraft.checkpoint import save_drafter
from blockdraft.models import DFlash2Drafter, DFlashDrafter
from blockdraft.pair import DrafterShape
from blockdraft.training.data import sample_windows, step_generator
from blockdraft.training.selector import (
    init_dflash2_extras,
    selector_distill_loss,
    selector_loss,
    teacher_predecessors,
)

log = logging.getLogger(__name__)

LabelMode = Literal["target", "corpus"]
# Published decay constants; other block sizes use B / 2.
_GAMMAS = {16: 7.0, 10: 5.0, 8: 4.0}
STATE_FILE = "training_state.pt"
ARGS_FILE = "training_args.json"


def default_gamma(block_size: int) -> float:
    """The loss decay gamma for block size B (7 for 16, 5 for 10, 4 for 8, else B / 2)."""
    return _GAMMAS.get(block_size, block_size / 2)


def loss_weights(block_size: int, gamma: float | None = None) -> Tensor:
    """``exp(-(k - 1) / gamma)`` for block rows k = 1..B-1: [B-1] fp32."""
    g = default_gamma(block_size) if gamma is None else gamma
    if g <= 0:
        raise ValueError(f"gamma must be > 0, not {g}")
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / g)


def sample_anchors(n: int, length: int, num_anchors: int, block_size: int, gen: torch.Generator, *,
                   focus: float = 0.0, hardness: Tensor | None = None) -> Tensor:
    """Distinct sorted anchor positions in ``[1, length - block_size]`` per window: [n, A] int64.

    Position 0 is never an anchor (a block needs at least one context row before it), and the
    last anchor leaves room for a whole block inside the window.

    With ``focus`` > 0, ``round(focus * A)`` anchors of each window are drawn with probability
    proportional to ``hardness`` [n, length] (CPU, >= 0: how unsure the target was of the token
    at each position, :func:`token_hardness`) and the rest uniformly from the positions left.
    At inference a block starts at the token where the previous block's draft failed, where the
    target is on average less sure of its token than at a uniform position; focused anchors put
    more of the training there (docs/training.md, "Where the steps go").
    """
    span = length - block_size
    if span < 1:
        raise ValueError(f"window length {length} is too short for blocks of {block_size}")
    if not 0.0 <= focus <= 1.0:
        raise ValueError(f"focus must be in [0, 1], not {focus}")
    a = min(num_anchors, span)
    if focus == 0.0:
        rows = [torch.randperm(span, generator=gen)[:a].sort().values + 1 for _ in range(n)]
        return torch.stack(rows)
    if hardness is None or hardness.shape != (n, length):
        raise ValueError(f"focus > 0 needs hardness of shape {(n, length)}")
    hard = round(focus * a)
    rows = []
    for i in range(n):
        # A small floor keeps every position drawable (multinomial needs enough nonzero weights).
        w = hardness[i, 1 : span + 1].float().clamp_min(0) + 1e-4
        picked = torch.multinomial(w, hard, replacement=False, generator=gen) if hard else w.new_zeros(0).long()
        free = torch.ones(span, dtype=torch.bool)
        free[picked] = False
        others = free.nonzero().flatten()
        rest = others[torch.randperm(others.numel(), generator=gen)[: a - hard]]
        rows.append(torch.cat((picked, rest)).sort().values + 1)
    return torch.stack(rows)


def token_hardness(logits: Tensor, tokens: Tensor) -> Tensor:
    """``1 - p(token)`` at every position of ``tokens`` [n, T] under the target's distribution
    after the prefix before it (``logits`` [n, T, V], the target's over the same windows);
    position 0 has no prefix and gets 0. Returns [n, T] fp32 on ``tokens``' device."""
    probs = torch.softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    out[:, 1:] = 1.0 - probs
    return out


def block_attention_mask(anchors: Tensor, length: int, block_size: int) -> Tensor:
    """Which keys each block row may see: [n, A*B, T + A*B] bool.

    Keys are the ``T`` context rows (positions 0..T-1) followed by the ``A*B`` block rows; row
    ``i`` of block ``j`` sees context positions ``< anchors[:, j]`` and the rows of block ``j``.
    """
    n, a = anchors.shape
    device = anchors.device
    row_anchor = anchors.repeat_interleave(block_size, dim=1)
    ctx_visible = torch.arange(length, device=device)[None, None, :] < row_anchor[:, :, None]
    block_of = torch.arange(a, device=device).repeat_interleave(block_size)
    own_block = (block_of[:, None] == block_of[None, :]).expand(n, -1, -1)
    return torch.cat((ctx_visible, own_block), dim=2)


@dataclass
class StepStats:
    """What one training step measured: weighted loss, per-row accuracy [B-1], and the greedy
    acceptance length estimate (mean over blocks of 1 + the number of leading correct rows)."""

    loss: float
    row_accuracy: list[float]
    tau: float


def block_loss(
    drafter: DFlashDrafter,
    ctx_rows: Tensor,
    tokens: Tensor,
    labels: Tensor,
    anchors: Tensor,
    embed_weight: Tensor,
    head_weight: Tensor,
    weights: Tensor,
    *,
    soft_logits: Tensor | None = None,
    distill_weight: float = 0.0,
    selector_weight: float = 1.0,
    selector_distill_weight: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The recipe's loss for ``n`` windows.

    Args:
        ctx_rows: [n, T, k*H] target hidden states of the chosen layers.
        tokens: [n, T] the window's tokens (anchors take theirs from here).
        labels: [n, T] the token each position should hold (``-100`` where unknown).
        anchors: [n, A] from :func:`sample_anchors`.
        embed_weight: [V_in, H] the target's input embeddings (frozen).
        head_weight: [V, H] the target's ``lm_head`` (frozen).
        weights: [B-1] per-row loss weights.
        soft_logits: [n, T, V] the target's logits for each position (its distribution after
            the prefix before it); needed when ``distill_weight`` > 0.
        distill_weight: weight of the distillation term, the cross-entropy of the drafter's
            distribution against the target's softmax at T = 1 (what sampled drafts need).
        selector_weight: DFlash2 only: weight of :func:`~blockdraft.training.selector.selector_loss`.
        selector_distill_weight: DFlash2 only: weight of
            :func:`~blockdraft.training.selector.selector_distill_loss` (what sampled DFlash2
            drafts need); needs ``soft_logits``.
    Returns:
        (scalar loss, [n, A, B-1] bool: the drafted token of row k equals its label; for
        DFlash2, the selector's pick given correct earlier rows).
    """
    c = drafter.config
    if c.mask_token_id is None:
        raise ValueError("the drafter config has no mask_token_id")
    n, length = tokens.shape
    a = anchors.shape[1]
    b = c.block_size
    dev = tokens.device
    offsets = torch.arange(b, device=dev)
    positions = anchors[:, :, None] + offsets  # [n, A, B]
    block_ids = torch.full((n, a, b), c.mask_token_id, dtype=torch.int64, device=dev)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    embeds = F.embedding(block_ids.reshape(n, a * b), embed_weight)

    fused = drafter.fuse_context(ctx_rows)  # [n, T, H]
    ctx_pos = torch.arange(length, device=dev).repeat(n)
    ctx_kv = drafter.context_kv(fused.reshape(n * length, -1), ctx_pos)
    visible = block_attention_mask(anchors, length, b)[:, None]  # [n, 1, R, T+R]
    group = c.num_heads // c.num_kv_heads
    scale = c.head_dim**-0.5

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ck, cv = ctx_kv[layer]
        keys = torch.cat((ck.reshape(n, length, c.num_kv_heads, c.head_dim).to(k.dtype), k), dim=1)
        values = torch.cat((cv.reshape(n, length, c.num_kv_heads, c.head_dim).to(v.dtype), v), dim=1)
        # Norm weights promote q/k to fp32 under autocast; attend in one (the autocast) dtype.
        dt = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
        qh = q.transpose(1, 2).to(dt)
        kh = keys.transpose(1, 2).repeat_interleave(group, dim=1).to(dt)
        vh = values.transpose(1, 2).repeat_interleave(group, dim=1).to(dt)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale)
        return out.transpose(1, 2)

    hidden = drafter.forward_block(embeds, positions.reshape(n, a * b), attend, segment=b)
    hidden = hidden.reshape(n, a, b, -1)[:, :, 1:]
    logits = drafter.logits(hidden, head_weight).float()  # [n, A, B-1, V]
    row_pos = positions[:, :, 1:].reshape(n, -1)
    target = labels.gather(1, row_pos).reshape(n, a, b - 1)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(flat_logits, target.reshape(-1), reduction="none", ignore_index=-100)
    valid = (target != -100).float()
    w = weights.to(dev)
    loss = (ce.reshape(n, a, b - 1) * w * valid).sum() / (w * valid).sum().clamp_min(1e-6)
    sel_distill = selector_distill_weight if isinstance(drafter, DFlash2Drafter) else 0.0
    probs: Tensor | None = None
    if distill_weight > 0 or sel_distill > 0:
        if soft_logits is None:
            raise ValueError("distillation needs the target's logits (soft_logits)")
        # The target's distribution for position p is its softmax after the prefix before p.
        rows = soft_logits.gather(1, (row_pos - 1)[:, :, None].expand(-1, -1, soft_logits.shape[-1]))
        probs = torch.softmax(rows.float(), dim=-1).reshape(-1, soft_logits.shape[-1])
        if distill_weight > 0:
            soft = F.cross_entropy(flat_logits, probs, reduction="none").reshape(n, a, b - 1)
            loss = loss + distill_weight * (soft * w).sum() / (w.sum() * n * a)
    if isinstance(drafter, DFlash2Drafter):
        rows_hidden = hidden.reshape(n * a, b - 1, -1)
        rows_logits = logits.reshape(n * a, b - 1, -1)
        prev = teacher_predecessors(block_ids[:, :, :1], target)
        sel, picks = selector_loss(drafter.candidate_selector, rows_hidden, rows_logits,
                                   prev.reshape(n * a, b - 1), target.reshape(n * a, b - 1), w)
        loss = loss + selector_weight * sel
        if probs is not None and sel_distill > 0:
            text_prev = tokens.gather(1, positions[:, :, :-1].reshape(n, -1)).reshape(n * a, b - 1)
            loss = loss + sel_distill * selector_distill_loss(
                drafter.candidate_selector, rows_hidden, rows_logits, text_prev,
                probs.reshape(n * a, b - 1, -1), w)
        drafted = picks.reshape(n, a, b - 1)
    else:
        drafted = logits.argmax(-1)
    correct = (drafted == target) & (target != -100)
    return loss, correct


def target_features(
    target: Any, tokens: Tensor, layer_ids: tuple[int, ...], label_mode: LabelMode, *, keep_logits: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One frozen target pass: (ctx rows [n, T, k*H], labels [n, T], logits [n, T, V] or None).

    Layer id ``i`` is ``hidden_states[i + 1]``. With ``label_mode="target"`` the label of
    position ``p`` is the target's greedy choice after ``tokens[:, :p]``; with ``"corpus"`` it is
    ``tokens[:, p]``. Position 0 has no label from the target (``-100``). The logits come back
    only with ``keep_logits`` (the distillation term needs them).
    """
    with torch.no_grad():
        out = target(
            input_ids=tokens,
            output_hidden_states=True,
            use_cache=False,
            logits_to_keep=0 if label_mode == "target" or keep_logits else 1,
        )
        hs = out.hidden_states
        ctx = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        logits = out.logits if keep_logits else None
        if label_mode == "corpus":
            return ctx, tokens.clone(), logits
        labels = torch.full_like(tokens, -100)
        labels[:, 1:] = out.logits[:, :-1].argmax(-1)
        return ctx, labels, logits


# ---------------------------------------------------------------- drafter shape and checkpoints


def new_drafter(raw_config: dict[str, Any], seed: int) -> DFlashDrafter:
    """A freshly initialised fp32 drafter on the CPU (linear weights ~ N(0, 0.02), norms at 1).

    A DFlash2 drafter starts as its DFlash part: identity convolutions and a selector that adds
    nothing yet (:func:`~blockdraft.training.selector.init_dflash2_extras`).
    """
    config = DrafterConfig.from_dict(raw_config)
    torch.manual_seed(seed)
    cls = DFlash2Drafter if config.is_dflash2 else DFlashDrafter
    drafter = cls(config, device="cpu", dtype=torch.float32)
    for module in drafter.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    if isinstance(drafter, DFlash2Drafter):
        init_dflash2_extras(drafter, seed)
    return drafter


def init_from_target(drafter: DFlashDrafter, target: Any) -> list[int]:
    """Start the drafter's layers as copies of the target's last ``num_layers`` layers.

    Each drafter layer has exactly the shape of a target layer (the recipe's config follows
    the target), so the copy is a start that already maps hidden states towards the target's
    next-token space, rather than noise. Also copied: the target's final norm into the
    drafter's ``norm`` (its output rows go through the same ``lm_head``) and the first copied
    layer's input norm into ``hidden_norm`` (the fused context rows are normalised once and then
    used as keys/values, as that layer's normalised input is in the target). ``fc`` starts as
    the projection that passes the deepest context layer through (identity on its slice, zero
    on the others). DFlash2 extras keep their own start.

    Returns:
        the target layer index each drafter layer was copied from.
    Raises:
        ValueError: the target's layers are not named like Llama/Qwen decoder layers or their
            shapes differ from the drafter's.
    """
    body = getattr(target, "model", None)
    layers = getattr(body, "layers", None)
    final_norm = getattr(body, "norm", None)
    if layers is None or final_norm is None:
        raise ValueError("init_from_target needs a Llama/Qwen-style target (model.layers, model.norm)")
    c = drafter.config
    chosen = list(range(len(layers) - c.num_layers, len(layers)))
    with torch.no_grad():
        for i, src in enumerate(chosen):
            mine = drafter.layer(i).state_dict()
            theirs = layers[src].state_dict()
            for name, tensor in mine.items():
                if name not in theirs:
                    continue  # DFlash2 convolutions
                if theirs[name].shape != tensor.shape:
                    raise ValueError(f"target layer {src} {name} is {tuple(theirs[name].shape)}, the drafter's "
                                     f"is {tuple(tensor.shape)}")
                tensor.copy_(theirs[name].to(tensor.dtype))
        drafter.norm.weight.copy_(final_norm.weight.to(drafter.norm.weight.dtype))
        first = layers[chosen[0]]
        drafter.hidden_norm.weight.copy_(first.input_layernorm.weight.to(drafter.hidden_norm.weight.dtype))
        h = c.hidden_size
        fc = drafter.fc.weight
        fc.zero_()
        fc[:, (c.num_context_layers - 1) * h :] = torch.eye(h, dtype=fc.dtype, device=fc.device)
    return chosen


def init_from_drafter(drafter: DFlashDrafter, path: Path) -> None:
    """Start ``drafter`` from the weights of the saved drafter at ``path`` (continued training).

    The block size may differ: no weight depends on it (a block is anchor + MASK embeddings,
    its positions come from RoPE), so a B = 16 drafter can start a B = 8 one.

    ``drafter`` may also have more layers than the saved one (growing it). Each extra layer
    starts as a copy of the saved drafter's last layer with its two output projections
    (``o_proj``, ``down_proj``) zeroed: it adds nothing to the residual stream, so the grown
    drafter drafts exactly what the saved one did, and training opens the new layers from there
    instead of from a worse start.

    Raises:
        ValueError: the saved drafter's config differs from ``drafter``'s in anything but the
            block size and a smaller layer count (the fields that differ are named).
        blockdraft.CheckpointError: ``path`` is not a readable drafter checkpoint.
    """
    from blockdraft.checkpoint import load_drafter

    saved = load_drafter(path, device="cpu", dtype=torch.float32)
    mine, theirs = asdict(drafter.config), asdict(saved.config)
    free = ("dtype", "block_size", "num_layers", "layer_types")
    differ = sorted(k for k in mine if k not in free and mine[k] != theirs.get(k))
    have, want = saved.config.num_layers, drafter.config.num_layers
    if have > want:
        differ.append("num_layers")
    # Extra layers copy the last one, so their attention kind (full or sliding) must be its kind.
    types, saved_types = tuple(drafter.config.layer_types), tuple(saved.config.layer_types)
    if have <= want and types != saved_types + saved_types[-1:] * (want - have):
        differ.append("layer_types")
    if differ:
        raise ValueError(f"cannot start from {path}: its config differs in {', '.join(differ)}")
    state = saved.state_dict()
    silent = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight")
    for i in range(have, want):
        for name, tensor in saved.layer(have - 1).state_dict().items():
            state[f"layers.{i}.{name}"] = torch.zeros_like(tensor) if name in silent else tensor
    with torch.no_grad():
        drafter.load_state_dict(state)


# ---------------------------------------------------------------- the training loop


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
        gamma: loss decay (``None``: :func:`default_gamma`).
        distill_weight: weight of the distillation term (the target's T = 1 distribution as a
            soft label, for sampled drafts); 0 trains on the hard labels alone.
        dflash2: train a DFlash2 drafter with these ``conv_kernel_size``, ``conv_group_size``,
            ``selector_rank``, ``selector_top_k`` (``None``: DFlash); selector_weight: the
            weight of its selector objective; selector_distill_weight: the weight of the
            selector's distillation (:func:`~blockdraft.training.selector.selector_distill_loss`).
        init_from_target: start the drafter's layers as copies of the target's last layers
            (:func:`init_from_target`) instead of random weights.
        init_from: start from the weights of this saved drafter instead (continued training;
            :func:`init_from_drafter`); excludes ``init_from_target``.
        anchor_focus: the fraction of each window's anchors drawn where the target was unsure
            of the anchor token (:func:`sample_anchors`); 0: all uniform.
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
    raw = DrafterShape.for_target(
        target.config,
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=cfg.target_layer_ids or None,
        intermediate_size=cfg.intermediate_size,
        dflash2=cfg.dflash2,
    ).config_dict()
    layer_ids = tuple(raw["dflash_config"]["target_layer_ids"])
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
