"""Greedy speculative decoding built only from blockdraft's pieces equals the public reference.

For random Qwen3 and Llama targets and random DFlash / DFlash2 drafters, over many random
prompts (some containing the mask token id), ``blockdraft.models.reference.speculative_greedy``
must produce exactly the tokens of ``dflash.model.dflash_generate`` and of
``target.generate(do_sample=False)``, and the same tokens per step as the reference.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import dflash.model
import pytest
import torch
from dflash.model import dflash_generate
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import blockdraft
from blockdraft.models.reference import speculative_greedy

from support.dflash_ref import logged_seed, save_reference_drafter

log = logging.getLogger(__name__)
VOCAB = 512
MASK = 300  # inside the vocabulary, so prompts can contain it
HIDDEN = 64
TARGET_LAYERS = 4
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def seed(monkeypatch: pytest.MonkeyPatch) -> int:
    # return_stats times with torch.cuda.synchronize; on CPU a plain clock is enough.
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)
    return logged_seed()


def make_target(family: str, narrow_head: int | None) -> Any:
    common: dict[str, Any] = dict(
        hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=VOCAB,
    )
    model = (
        Qwen3ForCausalLM(Qwen3Config(**common))
        if family == "qwen3"
        else LlamaForCausalLM(LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        if narrow_head is not None:
            # Only a few tokens can win, so random drafts get accepted now and then.
            model.lm_head.weight[narrow_head:] = 0.0
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_drafter(tmp: Path, dflash2: bool, block_size: int, target_ids: list[int], extra: dict[str, Any]) -> Any:
    # Kernel 2: the reference's convolution breaks on blocks shorter than its kernel.
    return save_reference_drafter(
        tmp, dflash2=dflash2, hidden=HIDDEN, layers=2, heads=4, kv_heads=2, head_dim=16,
        intermediate=128, vocab=VOCAB, num_target_layers=TARGET_LAYERS, mask=MASK,
        target_ids=target_ids, block_size=block_size, std=0.3, extra=extra,
        dflash2_config=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4),
    )


def greedy_plain(target: Any, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    # An explicit mask: generate would otherwise treat pad-id tokens in the prompt as padding.
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return [int(t) for t in out[0]]


def random_prompt(rng: random.Random, with_mask: bool) -> list[int]:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
    if with_mask:
        for _ in range(rng.randint(1, 3)):
            prompt[rng.randrange(len(prompt))] = MASK
    return prompt


CASES = [
    # family, dflash2, block, target ids, narrow head, drafter config extras
    ("qwen3", False, 4, [1, 2], None, {}),
    ("qwen3", False, 8, [0, 3], 2, {}),
    ("qwen3", True, 4, [3, 1, 0], 2, {}),
    ("llama", False, 16, [2], 2, {}),
    ("llama", True, 8, [0, 1, 2, 3], None, {}),
    ("llama", False, 4, [1, 3], 2, dict(use_sliding_window=True, sliding_window=6,
                                         layer_types=["sliding_attention", "full_attention"])),
]


@pytest.mark.parametrize(("family", "dflash2", "block", "target_ids", "narrow", "extra"), CASES)
def test_greedy_equals_reference_and_target(
    tmp_path: Path,
    seed: int,
    family: str,
    dflash2: bool,
    block: int,
    target_ids: list[int],
    narrow: int | None,
    extra: dict[str, Any],
) -> None:
    rng = random.Random(seed)
    target = make_target(family, narrow)
    ref = make_drafter(tmp_path, dflash2, block, target_ids, extra)
    drafter = blockdraft.load_drafter(tmp_path)
    adapter = blockdraft.TargetAdapter(target, drafter.config)
    accepted_beyond_first = 0
    for trial in range(8):
        prompt = random_prompt(rng, with_mask=trial % 2 == 1)
        new_tokens = rng.randint(2, 24)
        ids = torch.tensor([prompt])
        expected = dflash_generate(ref, target, ids, new_tokens, None, return_stats=True)
        plain = greedy_plain(target, prompt, new_tokens)
        got = speculative_greedy(drafter, adapter, prompt, new_tokens)
        context = f"seed={seed} trial={trial} prompt={prompt} new={new_tokens}"
        assert got.tokens == expected.output_ids[0].tolist(), context
        assert got.tokens == plain, context
        assert len(got.tokens) == len(prompt) + new_tokens, context
        assert got.acceptance_lengths == expected.acceptance_lengths, context
        accepted_beyond_first += sum(n > 1 for n in got.acceptance_lengths)
    log.warning("%s: %d steps accepted at least one draft", family, accepted_beyond_first)


@pytest.mark.parametrize(("family", "dflash2", "block"), [("qwen3", False, 8), ("llama", False, 4)])
def test_full_acceptance(tmp_path: Path, seed: int, family: str, dflash2: bool, block: int) -> None:
    """A zero head makes every logit tie: target and DFlash drafter both pick token 0, so every draft
    is accepted and each step produces a whole block (the last one cut at max_new_tokens)."""
    rng = random.Random(seed)
    target = make_target(family, narrow_head=0)
    ref = make_drafter(tmp_path, dflash2, block, [0, 2], {})
    drafter = blockdraft.load_drafter(tmp_path)
    adapter = blockdraft.TargetAdapter(target, drafter.config)
    for trial in range(3):
        prompt = random_prompt(rng, with_mask=trial == 1)
        new_tokens = rng.randint(block + 1, 3 * block)
        expected = dflash_generate(ref, target, torch.tensor([prompt]), new_tokens, None, return_stats=True)
        got = speculative_greedy(drafter, adapter, prompt, new_tokens)
        context = f"seed={seed} trial={trial} prompt={prompt} new={new_tokens}"
        assert got.tokens == expected.output_ids[0].tolist() == prompt + [0] * new_tokens, context
        assert got.acceptance_lengths == expected.acceptance_lengths, context
        steps, rest = divmod(new_tokens - 1, block)
        assert got.acceptance_lengths == [block] * steps + ([rest] if rest else []), context


def test_stop_tokens(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    target = make_target("qwen3", 6)
    ref = make_drafter(tmp_path, False, 4, [1, 2], {})
    drafter = blockdraft.load_drafter(tmp_path)
    adapter = blockdraft.TargetAdapter(target, drafter.config)
    for trial in range(4):
        prompt = random_prompt(rng, with_mask=False)
        plain = greedy_plain(target, prompt, 20)
        stop = plain[len(prompt) + rng.randrange(20)]
        expected = dflash_generate(ref, target, torch.tensor([prompt]), 20, [stop])[0].tolist()
        got = speculative_greedy(drafter, adapter, prompt, 20, stop_token_ids=[stop])
        assert got.tokens == expected, f"seed={seed} trial={trial}"
        assert stop in got.tokens[len(prompt) :] and got.tokens[-1] == stop, f"seed={seed} trial={trial}"
        assert got.tokens == plain[: len(got.tokens)]
