"""TargetAdapter: hooked layer capture equals Hugging Face hidden_states[i + 1], in [rows, k*H]."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import blockdraft

LAYERS = 4
HIDDEN = 64


def make_target(family: str) -> Any:
    common: dict[str, Any] = dict(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, vocab_size=320,
    )
    model = (Qwen3ForCausalLM(Qwen3Config(**common)) if family == "qwen3" else LlamaForCausalLM(LlamaConfig(**common)))
    torch.manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def drafter_config(**overrides: Any) -> blockdraft.DrafterConfig:
    raw: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "hidden_size": HIDDEN, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "vocab_size": 320, "num_target_layers": LAYERS,
        "dflash_config": {"mask_token_id": 300, "target_layer_ids": [2, 0, 3], "block_size": 4},
    }
    raw.update(overrides)
    return blockdraft.DrafterConfig.from_dict(raw)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_capture_equals_hf_hidden_states(family: str) -> None:
    model = make_target(family)
    config = drafter_config()
    adapter = blockdraft.TargetAdapter(model, config)
    ids = torch.randint(0, 320, (2, 7))
    out = adapter.forward(ids)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    want = torch.cat([ref.hidden_states[i + 1] for i in config.target_layer_ids], dim=-1).reshape(14, -1)
    assert out.ctx_rows.shape == (14, 3 * HIDDEN)
    assert torch.equal(out.ctx_rows, want)
    assert torch.equal(out.logits, ref.logits)


def test_does_not_ask_for_every_hidden_state() -> None:
    model = make_target("qwen3")
    adapter = blockdraft.TargetAdapter(model, [1])
    seen: list[dict[str, Any]] = []
    original = model.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return original(*args, **kwargs)

    model.forward = spy
    out = adapter.forward(torch.randint(0, 320, (1, 5)))
    assert seen and not seen[0].get("output_hidden_states")
    assert getattr(model(torch.zeros(1, 2, dtype=torch.int64)), "hidden_states", None) is None
    assert out.ctx_rows.shape == (5, HIDDEN)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_incremental_forward_with_cache_and_crop(family: str) -> None:
    model = make_target(family)
    adapter = blockdraft.TargetAdapter(model, [0, 2])
    ids = torch.randint(0, 320, (1, 12))
    full = adapter.forward(ids)
    cache = adapter.new_cache()
    first = adapter.forward(ids[:, :5], torch.arange(5)[None], cache)
    # A rejected block: run 4 rows, crop them away, then continue from position 5.
    adapter.forward(torch.randint(0, 320, (1, 4)), torch.arange(5, 9)[None], cache)
    adapter.crop_cache(cache, 5)
    second = adapter.forward(ids[:, 5:], torch.arange(5, 12)[None], cache)
    rows = torch.cat((first.ctx_rows, second.ctx_rows))
    torch.testing.assert_close(rows, full.ctx_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second.logits, full.logits[:, 5:], rtol=1e-5, atol=1e-5)


def test_out_buffer_and_embeddings() -> None:
    model = make_target("qwen3")
    adapter = blockdraft.TargetAdapter(model, drafter_config())
    ids = torch.randint(0, 320, (1, 6))
    buffer = torch.full((6, 3 * HIDDEN), float("nan"), dtype=torch.bfloat16)
    out = adapter.forward(ids, out=buffer)
    assert out.ctx_rows is buffer and not torch.isnan(buffer).any()
    assert torch.equal(buffer, adapter.forward(ids).ctx_rows.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"contiguous \[6, 192\]"):
        adapter.forward(ids, out=torch.empty(5, 3 * HIDDEN))
    assert torch.equal(adapter.embed(ids), model.model.embed_tokens.weight[ids])
    assert adapter.lm_head is model.lm_head.weight
    assert adapter.embed_weight is model.model.embed_tokens.weight and adapter.config is model.config
    assert adapter.ctx_row_size == 3 * HIDDEN
    adapter.close()
    with pytest.raises(RuntimeError, match="did not run"):
        adapter.forward(ids)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 128, "head_dim": 32}, "drafter hidden_size 128 != target hidden_size 64"),
        ({"dflash_config": {"mask_token_id": 320, "target_layer_ids": [1]}}, "mask_token_id 320 is outside"),
        ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [4]}, "num_target_layers": None},
         "target layer id 4 is out of range: the target has 4 layers"),
    ],
)
def test_misfit_is_explained(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(blockdraft.ConfigError, match=message):
        blockdraft.TargetAdapter(make_target("qwen3"), drafter_config(**overrides))


def test_dflash2_codebooks_must_cover_target_vocab() -> None:
    config = blockdraft.DrafterConfig.from_dict(
        {
            "architectures": ["DFlash2DraftModel"], "hidden_size": HIDDEN, "num_hidden_layers": 1,
            "num_attention_heads": 4, "head_dim": 16, "intermediate_size": 96, "vocab_size": 310,
            "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1], "conv_kernel_size": 2,
                              "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 4},
        }
    )
    with pytest.raises(blockdraft.ConfigError, match="codebooks have 310 rows but the target head has 320"):
        blockdraft.TargetAdapter(make_target("qwen3"), config)
