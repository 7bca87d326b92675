"""The built-in pair's build settings: presets (sizes, budgets, tuning, rollouts) and drafter specs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class Preset:
    """Sizes and budgets of one build."""

    corpus_chars: int
    tokenizer_chars: int
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    target_seq_len: int
    target_batch: int
    target_steps: int
    target_lr: float
    target_budget_s: float
    drafter_layers: int
    target_layer_ids: list[int]
    drafter: dict[str, Any]
    drafter_budget_s: float
    drafters: list[str]
    eval_prompts: int
    eval_prompt_tokens: int
    eval_new_tokens: int
    heldout_every: int = 40
    target_compile: bool = False
    """Train the target through ``torch.compile``."""
    test_prompts: int = 4
    per_block: dict[int, dict[str, Any]] = field(default_factory=dict)
    dflash2: dict[str, int] = field(default_factory=lambda: dict(
        conv_kernel_size=3, conv_group_size=32, selector_rank=32, selector_top_k=8))
    tune: dict[str, Any] = field(default_factory=dict)
    """:class:`~blockdraft.training.builtin.unlikelihood.TuneConfig` fields of the target's unlikelihood
    fine-tuning (empty: none)."""
    tune_budget_s: float = 0.0
    rollout: dict[str, Any] = field(default_factory=dict)
    """What the drafters train on: ``num`` rollouts of the target per kind, each ``prompt_len``
    corpus tokens then ``new_tokens`` of the target's, written ``batch`` at a time (empty: the
    drafters train on the corpus)."""
    rollout_kinds: dict[int, list[str]] = field(default_factory=dict)
    """Per block size, the rollouts its drafters train on: ``greedy`` and/or ``sampled`` (T = 1);
    default greedy."""


PRESETS: dict[str, Preset] = {
    "h200": Preset(
        corpus_chars=400_000_000, tokenizer_chars=10_000_000, vocab=8192,
        hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1152, max_positions=2048,
        target_seq_len=512, target_batch=96, target_steps=20000, target_lr=1.5e-3, target_budget_s=270,
        drafter_layers=2, target_layer_ids=[1, 4, 6],
        drafter=dict(seq_len=512, num_seqs=32, num_anchors=64, steps=20000, lr=1e-3, warmup_steps=100,
                     log_every=100, init_from_target=True),
        per_block={8: dict(num_seqs=64, num_anchors=128, distill_weight=0.5, selector_distill_weight=1.0),
                   16: dict(num_seqs=48)},
        drafter_budget_s=100, drafters=["16", "16:dflash2", "8"],
        eval_prompts=16, eval_prompt_tokens=64, eval_new_tokens=128,
        # A light touch: 150 steps of 8 windows. 491 steps of 64 (139 s on the H200) drove the
        # greedy output into token salad that repeats nothing. The own-choice term keeps the
        # target sure of its other greedy choices, which the unlikelihood term alone takes away
        # (docs/design/target-tuning.md).
        tune=dict(steps=150, lr=3e-4, warmup_steps=10, batch=8, seq_len=256, ul_batch=8, prompt_len=64,
                  new_tokens=128, regen_every=10, own_weight=1.0),
        rollout=dict(prompt_len=64, new_tokens=256, num=24000, batch=4000),
        rollout_kinds={8: ["greedy", "sampled"], 16: ["greedy"]},
    ),
    "tiny": Preset(
        corpus_chars=400_000, tokenizer_chars=200_000, vocab=512,
        hidden=64, layers=3, heads=4, kv_heads=2, intermediate=128, max_positions=512,
        target_seq_len=64, target_batch=8, target_steps=40, target_lr=3e-3, target_budget_s=0,
        drafter_layers=1, target_layer_ids=[0, 2],
        drafter=dict(seq_len=64, num_seqs=4, num_anchors=8, steps=20, lr=1e-3, warmup_steps=5, log_every=10,
                     init_from_target=True),
        per_block={8: dict(distill_weight=0.5)},
        drafter_budget_s=0, drafters=["8", "16:dflash2"],
        eval_prompts=3, eval_prompt_tokens=16, eval_new_tokens=24, test_prompts=3, heldout_every=4,
        dflash2=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4),
        tune=dict(steps=6, lr=1e-3, warmup_steps=2, batch=4, seq_len=64, ul_batch=4, prompt_len=8, new_tokens=16,
                  regen_every=3, own_weight=1.0),
        rollout=dict(prompt_len=8, new_tokens=24, num=48, batch=0),
        rollout_kinds={8: ["greedy", "sampled"]},
    ),
}


# The h200 pair's shapes with a CPU's batches: a build on a machine without a GPU that continues
# the h200 pair's drafters on a new target (``--reuse-target``, ``--init-drafters``). A step
# reads 4 windows with 64 blocks each (the h200's B = 16 step reads 48) at half the learning rate.
# The B = 8 drafter keeps the h200's loss weights (its distillation and the selector's) without
# the h200's larger B = 8 batches.
PRESETS["cpu"] = replace(
    PRESETS["h200"],
    drafter={**PRESETS["h200"].drafter, "num_seqs": 4, "num_anchors": 64, "lr": 5e-4, "log_every": 20},
    per_block={8: {k: v for k, v in PRESETS["h200"].per_block[8].items() if k.endswith("_weight")}},
    drafter_budget_s=2400,
    rollout=dict(prompt_len=64, new_tokens=256, num=4000, batch=256),
)


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter to train: ``"16"`` (DFlash, B = 16) or ``"16:dflash2"``."""

    block: int
    dflash2: bool

    @property
    def name(self) -> str:
        return f"b{self.block}" + ("-dflash2" if self.dflash2 else "")

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        """``B`` or ``B:dflash2``.

        Raises:
            ValueError: anything else.
        """
        block, _, kind = text.strip().partition(":")
        if not block.isdigit() or int(block) < 2 or kind not in ("", "dflash", "dflash2"):
            raise ValueError(f"drafter {text!r}: expected B or B:dflash2 with B >= 2")
        return cls(int(block), kind == "dflash2")


def rollout_kinds(p: Preset, spec: DrafterSpec) -> list[str]:
    """The rollouts a drafter trains on (empty when the preset has none: the corpus)."""
    return list(p.rollout_kinds.get(spec.block, ["greedy"])) if p.rollout else []
