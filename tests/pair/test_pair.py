"""The pair module: the drafter's config fields, random pairs at named shapes, the checks that
a drafter fits a target and that a prompt fits the context, and which pair a command runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import blockdraft
from blockdraft.checkpoint import load_drafter, save_drafter
from blockdraft.config import DrafterConfig
from blockdraft.pair import (
    DEMO_SHAPE,
    SHAPES,
    DrafterShape,
    check_context,
    check_fits,
    context_problem,
    random_drafter,
    random_pair,
)
from blockdraft.pair.load import ByteTokenizer, find_pair, load_pair, max_positions

from support.tinypair import tiny_target

FITS: dict[str, Any] = dict(drafter_hidden=32, target_layer_ids=[0, 2], mask_token_id=63, target_hidden=32,
                            target_layers=3, embed_rows=64)


def test_a_fitting_drafter_passes() -> None:
    check_fits(**FITS)
    check_fits(**{**FITS, "target_layers": None, "mask_token_id": None, "config_hidden": 32})


@pytest.mark.parametrize(("change", "message"), [
    ({"target_hidden": 48}, "drafter hidden_size 32 != target hidden_size 48"),
    ({"config_hidden": 40}, "drafter hidden_size 32 != target hidden_size 40"),
    ({"target_layer_ids": [0, 3]}, "target layer id 3 is out of range: the target has 3 layers"),
    ({"target_layer_ids": [-1]}, "target layer id -1 is out of range"),
    ({"mask_token_id": 64}, "drafter mask_token_id 64 is outside the target's embedding table (64 rows)"),
    ({"selector_rows": 60, "head_rows": 64}, "DFlash2 selector codebooks have 60 rows but the target head has 64"),
])
def test_a_misfit_is_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(blockdraft.ConfigError) as info:
        check_fits(**{**FITS, **change})
    assert message in str(info.value)


def test_the_context_check_boundaries() -> None:
    assert context_problem(5, 11, 16) is None  # exactly full
    assert context_problem(10**6, 10**9, None) is None  # no known limit
    assert context_problem(15, None, 16) is None  # room for one new token
    assert context_problem(5, 12, 16) == ("max_new_tokens 12 does not fit: max_seq_len is 16 and the prompt "
                                          "takes 5 tokens (at most 11)")
    assert context_problem(16, None, 16) == ("the prompt is 16 tokens; max_seq_len is 16, which must hold "
                                             "the prompt and at least one new token")
    line = context_problem(3, 9, 8, limit_name="this model's context", new_name="max_tokens", prompt="prompt 2")
    assert line == "max_tokens 9 does not fit: this model's context is 8 and prompt 2 takes 3 tokens (at most 5)"
    with pytest.raises(ValueError, match="at most 11"):
        check_context(5, 12, 16)
    check_context(5, 11, 16)


def test_the_config_builder_round_trips_through_load_drafter(tmp_path: Path) -> None:
    shape = SHAPES["tiny"]
    drafter = random_drafter(shape, "cpu", torch.float32, seed=3)
    save_drafter(drafter, shape.drafter.config_dict(), tmp_path / "d", "float32")
    loaded = load_drafter(tmp_path / "d", device="cpu", dtype=torch.float32)
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.block_size, cfg.mask_token_id, cfg.vocab_size) == (
        shape.hidden, shape.drafter_layers, shape.block_size, shape.mask_token_id, shape.vocab)
    assert tuple(cfg.target_layer_ids) == shape.target_layer_ids
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_drafter_for_a_target_follows_the_target() -> None:
    target = tiny_target(layers=4)
    raw = DrafterShape.for_target(target.config, num_layers=2, block_size=4, mask_token_id=63).config_dict()
    cfg = DrafterConfig.from_dict(raw)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.block_size) == (32, 4, 2, 4)
    assert raw["num_target_layers"] == 4 and raw["dflash_config"]["block_size"] == 4
    two = DrafterShape.for_target(target.config, num_layers=2, block_size=4, mask_token_id=63,
                                  dflash2={"conv_kernel_size": 2, "conv_group_size": 4, "selector_rank": 8,
                                           "selector_top_k": 4})
    assert DrafterConfig.from_dict(two.config_dict()).is_dflash2


def test_random_pairs_have_their_shape_and_seed() -> None:
    shape = SHAPES["tiny"]
    target, drafter = random_pair(shape)
    assert target.config.hidden_size == shape.hidden and target.config.num_hidden_layers == shape.target_layers
    assert target.lm_head.weight.shape == (shape.vocab, shape.hidden)
    assert drafter.config.block_size == shape.block_size and drafter.config.num_layers == shape.drafter_layers
    again, _ = random_pair(shape)
    other, _ = random_pair(shape, seed=5)
    assert torch.equal(target.lm_head.weight, again.lm_head.weight)
    assert not torch.equal(target.lm_head.weight, other.lm_head.weight)
    assert DEMO_SHAPE.name not in SHAPES  # the demo pair is not a bench shape


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    tdir, ddir = tmp_path / "t", tmp_path / "d"
    tdir.mkdir()
    ddir.mkdir()
    (tdir / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"],
                                                  "max_position_embeddings": 512}))
    (ddir / "config.json").write_text(json.dumps(SHAPES["tiny"].drafter.config_dict()))
    return tdir, ddir


def test_which_pair_is_known_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tdir, ddir = _dirs(tmp_path)
    source = find_pair(str(tdir), str(ddir))
    assert (source.name, source.max_positions, source.builtin) == ("t", 512, False)
    monkeypatch.setattr("blockdraft.pretrained.available", lambda block_size=16: False)
    demo = find_pair(None, None, demo=True)
    assert demo.max_positions == DEMO_SHAPE.max_positions and "RANDOM" in demo.description
    assert isinstance(demo.tokenizer(), ByteTokenizer)
    pair = demo.load("cpu", torch.float32)
    assert pair.target.config.hidden_size == DEMO_SHAPE.hidden and pair.max_positions == 4096


@pytest.mark.parametrize(("which", "message"), [
    ("target only", "give both --target DIR and --drafter DIR"),
    ("missing", "not a directory"),
    ("swapped", "are swapped"),
    ("no built-in", "the built-in pair is not installed"),
])
def test_load_pair_errors_name_the_flag(which: str, message: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tdir, ddir = _dirs(tmp_path)
    monkeypatch.setattr("blockdraft.pretrained.available", lambda block_size=16: False)
    args = {"target only": (str(tdir), None), "missing": (str(tmp_path / "nope"), str(ddir)),
            "swapped": (str(ddir), str(tdir)), "no built-in": (None, None)}[which]
    with pytest.raises(blockdraft.ConfigError, match=message):
        load_pair(*args, device="cpu")


def test_block_size_picks_the_builtin_drafter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tdir, _ = _dirs(tmp_path)
    loaded: list[int] = []

    def builtin_pair(*, device: Any, dtype: Any, block_size: int) -> tuple[Any, Any, Any]:
        loaded.append(block_size)
        return "target", "drafter", "tokenizer"

    monkeypatch.setattr("blockdraft.pretrained.available", lambda block_size=16: block_size == 8)
    monkeypatch.setattr("blockdraft.pretrained.TARGET_DIR", tdir)
    monkeypatch.setattr("blockdraft.pretrained.builtin_pair", builtin_pair)
    source = find_pair(None, None, block_size=8)
    assert source.builtin and source.max_positions == 512 and "B=8 drafter" in source.description
    assert source.load("cpu").drafter == "drafter" and loaded == [8]
    with pytest.raises(blockdraft.ConfigError, match="the built-in pair has no B=16 drafter installed"):
        find_pair(None, None, block_size=16)
    # Without a block size the default drafter is missing: the demo pair, or the plain error.
    assert not find_pair(None, None, demo=True).builtin
    with pytest.raises(blockdraft.ConfigError, match="the built-in pair is not installed"):
        find_pair(None, None)


def test_load_pair_loads_both_models_and_the_tokenizer(tmp_path: Path) -> None:
    from support.tp_support import save_pair

    tdir, ddir = save_pair(tmp_path)
    pair = load_pair(str(tdir), str(ddir), device="cpu")
    assert pair.max_positions == 512 and pair.target.dtype == torch.float32
    assert pair.drafter.config.hidden_size == pair.target.config.hidden_size
    assert pair.tokenizer.encode("w1 w2") == [1, 2]


def test_max_positions_reads_the_family_name_for_it() -> None:
    assert max_positions({"model_type": "gpt2", "n_positions": 1024, "n_ctx": 1024}) == 1024
    assert max_positions({"model_type": "gpt_neox", "max_position_embeddings": 2048}) == 2048
    assert max_positions({"text_config": {"model_type": "gpt2", "n_positions": 512}}) == 512
    assert max_positions({"model_type": "not-a-known-type", "n_positions": 1024}) is None
    assert max_positions({"model_type": "gpt2"}) is None
