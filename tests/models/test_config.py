"""DrafterConfig reads every value from config.json the way the public reference does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dflash.model import Qwen3DFlashAttention, build_target_layer_ids
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

import blockdraft
from blockdraft.config import default_target_layer_ids
from blockdraft.models import Rope


def base(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 500,
        "num_target_layers": 12,
        "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 5, 9]},
        "block_size": 8,
    }
    raw.update(overrides)
    return raw


def parse(raw: dict[str, Any]) -> blockdraft.DrafterConfig:
    return blockdraft.DrafterConfig.from_dict(raw)


def test_basic_fields_and_unknown_keys() -> None:
    c = parse(base(some_future_key={"x": 1}, auto_map={"AutoModel": "dflash.DFlashDraftModel"}))
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 2, 4, 2, 16)
    assert c.target_layer_ids == (1, 5, 9) and c.num_context_layers == 3
    assert c.mask_token_id == 7 and c.block_size == 8 and not c.is_dflash2
    assert c.rope.rope_type == "default" and c.rope.theta == 10000.0
    assert c.layer_types == ("full_attention", "full_attention") and c.sliding_window is None


def test_block_size_nested_wins_and_default() -> None:
    raw = base()
    raw["dflash_config"]["block_size"] = 4
    assert parse(raw).block_size == 4
    del raw["block_size"], raw["dflash_config"]["block_size"]
    assert parse(raw).block_size == 16  # the reference's default


def test_draft_fields_top_level_or_nested() -> None:
    raw = base(mask_token_id=3, output_multiplier=0.5, final_logit_softcapping=30.0)
    raw["dflash_config"] = {"target_layer_ids": [2], "input_embedding_scale": 2.0, "mask_token_id": 9}
    c = parse(raw)
    assert (c.mask_token_id, c.output_multiplier, c.input_embedding_scale) == (9, 0.5, 2.0)
    assert c.final_logit_softcapping == 30.0 and c.target_layer_ids == (2,)


@pytest.mark.parametrize(("targets", "drafts"), [(n, d) for n in (4, 12, 28, 36, 64) for d in (1, 2, 3, 5, 8)])
def test_default_target_layer_ids_rule(targets: int, drafts: int) -> None:
    assert default_target_layer_ids(targets, drafts) == build_target_layer_ids(targets, drafts)
    raw = base(num_target_layers=targets, num_hidden_layers=drafts, layer_types=None)
    del raw["dflash_config"]["target_layer_ids"]
    assert list(parse(raw).target_layer_ids) == build_target_layer_ids(targets, drafts)


@pytest.mark.parametrize(
    "rope_fields",
    [
        {},
        {"rope_theta": 1e6},
        {"rope_theta": 1e6, "rope_scaling": None},
        {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 2e4}},
        {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 128}},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                             "original_max_position_embeddings": 512}},
        {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "beta_fast": 16,
                             "mscale": 1.0, "mscale_all_dim": 0.5}, "max_position_embeddings": 4096},
    ],
)
def test_rope_forms_match_transformers(rope_fields: dict[str, Any]) -> None:
    raw = base(**rope_fields)
    c = parse(raw)
    reference = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"}))
    rope = Rope.from_config(c)
    assert torch.equal(rope.inv_freq, reference.inv_freq.float())
    assert rope.attention_scaling == pytest.approx(reference.attention_scaling, rel=1e-12)
    pos = torch.arange(0, 3000, 7)
    cos, sin = rope.cos_sin(pos, torch.float32)
    ref_cos, ref_sin = reference(torch.zeros(1, dtype=torch.float32), pos[None])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
        {"use_sliding_window": False, "sliding_window": 32, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
        {"use_sliding_window": True, "sliding_window": 16, "is_causal": False,
         "layer_types": ["sliding_attention", "full_attention"]},
        {"is_causal": True},
        {"layer_types": ["sliding_attention", "sliding_attention"]},
    ],
)
def test_layer_types_window_and_causality_match_reference(fields: dict[str, Any]) -> None:
    raw = base(**fields)
    c = parse(raw)
    qwen = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    for layer in range(c.num_layers):
        attn = Qwen3DFlashAttention(qwen, layer)
        assert c.layer_is_causal(layer) == attn.is_causal, (fields, layer)
        assert c.layer_sliding_window(layer) == attn.sliding_window, (fields, layer)


def test_dflash2_fields() -> None:
    raw = base(architectures=["DFlash2DraftModel"])
    raw["dflash_config"].update(conv_kernel_size=4, conv_group_size=16, selector_rank=32, selector_top_k=8)
    c = parse(raw)
    assert c.is_dflash2
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (4, 16, 32, 8)


def test_from_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base()))
    assert blockdraft.DrafterConfig.from_file(path).target_layer_ids == (1, 5, 9)


def _drop(key: str) -> dict[str, Any]:
    raw = base()
    del raw[key]
    return raw


def _nested(**values: Any) -> dict[str, Any]:
    raw = base()
    raw["dflash_config"].update(values)
    return raw


def _no_layer_ids() -> dict[str, Any]:
    raw = base()
    del raw["dflash_config"]["target_layer_ids"], raw["num_target_layers"]
    return raw


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (base(architectures=["LlamaForCausalLM"]), "unsupported architecture"),
        (_drop("architectures"), "'architectures' is missing"),
        (_drop("hidden_size"), "'hidden_size' is missing"),
        (base(hidden_size="64"), "'hidden_size' must be an integer"),
        (base(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (base(rope_parameters={"rope_type": "longrope", "rope_theta": 1.0}), "unsupported RoPE type"),
        (base(rope_scaling={"type": "linear"}), "needs config field 'rope_scaling.factor'"),
        (base(layer_types=["full_attention"]), "'layer_types' must list 2"),
        (base(layer_types=["full_attention", "local"]), "layer_types[1]"),
        (base(hidden_act="gelu"), "unsupported hidden_act"),
        (base(dflash_config=[1, 2]), "'dflash_config' must be an object"),
        (_nested(target_layer_ids=[]), "must be a non-empty list"),
        (_nested(target_layer_ids=[1, 12]), "names layer 12 but num_target_layers is 12"),
        (_nested(block_size=1), "'dflash_config.block_size' must be >= 2"),
        (_nested(mask_token_id=-1), "'dflash_config.mask_token_id' must be >= 0"),
        (_no_layer_ids(), "neither 'dflash_config.target_layer_ids' nor 'num_target_layers'"),
        (base(architectures=["DFlash2DraftModel"]), "DFlash2 config field 'conv_kernel_size' is missing"),
        (base(is_causal="yes"), "'is_causal' must be a boolean"),
    ],
)
def test_bad_configs_name_the_problem(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(blockdraft.CheckpointError) as info:
        parse(raw)
    assert message in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(blockdraft.CheckpointError, match="config file not found"):
        blockdraft.DrafterConfig.from_file(tmp_path / "config.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(blockdraft.CheckpointError, match="not valid JSON"):
        blockdraft.DrafterConfig.from_file(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(blockdraft.CheckpointError, match="must hold a JSON object"):
        blockdraft.DrafterConfig.from_file(bad)
