"""load_drafter: the z-lab checkpoint layout, sharding, dtypes, and clear errors for bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import blockdraft

from support.dflash_ref import save_reference_drafter


def save_reference(tmp: Path, dflash2: bool = False, **save_kwargs: Any) -> Any:
    return save_reference_drafter(
        tmp, dflash2=dflash2, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
        intermediate=96, vocab=300, num_target_layers=6, mask=5, target_ids=[1, 3], block_size=4,
        std=1.0, dflash2_config=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                     selector_top_k=4),
        **save_kwargs,
    )


def assert_same_weights(model: Any, drafter: blockdraft.DFlashDrafter) -> None:
    ours = drafter.state_dict()
    for name, tensor in model.state_dict().items():
        key = name.removesuffix(".weight") if "codebook" in name else name
        assert torch.equal(ours[key].float(), tensor.float()), name


@pytest.mark.parametrize("dflash2", [False, True])
def test_single_file(tmp_path: Path, dflash2: bool) -> None:
    model = save_reference(tmp_path, dflash2)
    drafter = blockdraft.load_drafter(tmp_path)
    assert type(drafter) is (blockdraft.DFlash2Drafter if dflash2 else blockdraft.DFlashDrafter)
    assert drafter.dtype == torch.float32 and not drafter.training
    assert not any(p.requires_grad for p in drafter.parameters())
    assert_same_weights(model, drafter)


def test_codebooks_stored_without_weight_suffix(tmp_path: Path) -> None:
    model = save_reference(tmp_path, dflash2=True)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    renamed = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in tensors.items()}
    assert "candidate_selector.predecessor_codebook" in renamed
    save_file(renamed, file)
    assert_same_weights(model, blockdraft.load_drafter(tmp_path))


def test_sharded_with_index(tmp_path: Path) -> None:
    model = save_reference(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert_same_weights(model, blockdraft.load_drafter(tmp_path))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
def test_dtype_conversion(tmp_path: Path, dtype: Any) -> None:
    model = save_reference(tmp_path)
    drafter = blockdraft.load_drafter(tmp_path, dtype=dtype, device="cpu")
    want = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    assert all(p.dtype == want for p in drafter.parameters())
    assert drafter.rope.inv_freq.dtype == torch.float32
    assert torch.equal(drafter.fc.weight, model.fc.weight.to(want))


def test_stored_bf16_loads_as_bf16(tmp_path: Path) -> None:
    save_reference(tmp_path)
    file = tmp_path / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, file)
    assert blockdraft.load_drafter(tmp_path).dtype == torch.bfloat16


def test_bad_dtype_argument(tmp_path: Path) -> None:
    save_reference(tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        blockdraft.load_drafter(tmp_path, dtype=torch.int32)


def _edit_tensors(tmp: Path, fn: Any) -> None:
    file = tmp / "model.safetensors"
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)


def _edit_config(tmp: Path, **changes: Any) -> None:
    path = tmp / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_missing_directory_and_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(blockdraft.CheckpointError, match="checkpoint directory not found"):
        blockdraft.load_drafter(tmp_path / "nope")
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(blockdraft.CheckpointError, match="not a directory"):
        blockdraft.load_drafter(file)


def test_missing_config_and_bad_json(tmp_path: Path) -> None:
    save_reference(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(blockdraft.CheckpointError, match="not valid JSON"):
        blockdraft.load_drafter(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(blockdraft.CheckpointError, match="config file not found"):
        blockdraft.load_drafter(tmp_path)


def test_missing_weights_and_pickle_only(tmp_path: Path) -> None:
    save_reference(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(blockdraft.CheckpointError, match=r"pytorch_model.bin.*pickle checkpoints are not loaded"):
        blockdraft.load_drafter(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(blockdraft.CheckpointError, match=r"missing tensors: \['layers.1.self_attn.k_norm.weight'\]"):
        blockdraft.load_drafter(tmp_path)


def test_extra_tensor_is_named(tmp_path: Path) -> None:
    save_reference(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(3, 3)}))
    with pytest.raises(blockdraft.CheckpointError, match=r"unexpected tensors: \['lm_head.weight'\]"):
        blockdraft.load_drafter(tmp_path)


def test_shape_mismatch_names_tensor_expected_found(tmp_path: Path) -> None:
    save_reference(tmp_path)
    _edit_config(tmp_path, intermediate_size=100)
    with pytest.raises(blockdraft.CheckpointError) as info:
        blockdraft.load_drafter(tmp_path)
    message = str(info.value)
    assert "layers.0.mlp.down_proj.weight" in message or "layers.0.mlp.gate_proj.weight" in message
    assert "expected" in message and "100" in message and "96" in message


def test_fc_shape_follows_target_layer_count(tmp_path: Path) -> None:
    save_reference(tmp_path)
    _edit_config(tmp_path, dflash_config={"mask_token_id": 5, "target_layer_ids": [1, 2, 3]})
    with pytest.raises(blockdraft.CheckpointError, match=r"'fc.weight' has shape \[64, 128\], expected \[64, 192\]"):
        blockdraft.load_drafter(tmp_path)


def test_unsupported_architecture_and_dtype(tmp_path: Path) -> None:
    save_reference(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.update({"norm.weight": t["norm.weight"].to(torch.float64)}))
    with pytest.raises(blockdraft.CheckpointError, match=r"'norm.weight' has unsupported dtype F64"):
        blockdraft.load_drafter(tmp_path)
    _edit_config(tmp_path, architectures=["EagleDraftModel"])
    with pytest.raises(blockdraft.CheckpointError, match="unsupported architecture"):
        blockdraft.load_drafter(tmp_path)


def test_corrupt_and_missing_shards(tmp_path: Path) -> None:
    good = tmp_path / "good"
    save_reference(good, max_shard_size="40KB")
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(blockdraft.CheckpointError, match=f"cannot read .*{shard.name}"):
        blockdraft.load_drafter(bad)
    shard.unlink()
    with pytest.raises(blockdraft.CheckpointError, match=f"shard {shard.name} listed in .* is missing"):
        blockdraft.load_drafter(bad)
    index = good / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["norm.extra"] = sorted(set(raw["weight_map"].values()))[0]
    index.write_text(json.dumps(raw))
    with pytest.raises(blockdraft.CheckpointError, match=r"lacks tensors .*\['norm.extra'\]"):
        blockdraft.load_drafter(good)
    index.write_text("{}")
    with pytest.raises(blockdraft.CheckpointError, match="no 'weight_map'"):
        blockdraft.load_drafter(good)
