"""Launchers reject bad arguments with a ValueError that names the argument, before any write."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch

from kernel_support import K, need_triton

CPU = torch.device("cpu")


def _kv_args() -> dict[str, object]:
    return dict(kv=torch.zeros(3, 2, 2, 4, 8), positions=torch.zeros(3, dtype=torch.int64),
                slots=torch.zeros(3, dtype=torch.int64), k_norm_w=torch.ones(2, 8),
                inv_freq=torch.ones(4), rope_scale=1.0, eps=1e-6,
                k_caches=torch.zeros(2, 5, 4, 4, 8), v_caches=torch.zeros(2, 5, 4, 4, 8),
                slot_pos=torch.zeros(20, dtype=torch.int32))


@pytest.mark.parametrize(("arg", "bad"), [
    ("kv", torch.zeros(3, 2, 3, 4, 8)),
    ("kv", torch.zeros(3, 2, 2, 8, 4).transpose(3, 4)),
    ("positions", torch.zeros(3, dtype=torch.int32)),
    ("slots", torch.zeros(4, dtype=torch.int64)),
    ("k_norm_w", torch.ones(2, 7)),
    ("inv_freq", torch.ones(4, dtype=torch.float64)),
    ("k_caches", torch.zeros(2, 5, 4, 2, 8)),
    ("v_caches", torch.zeros(2, 5, 4, 4, 8, dtype=torch.float16)),
    ("slot_pos", torch.zeros(20, dtype=torch.int64)),
])
def test_kv_store_rejects(arg: str, bad: torch.Tensor) -> None:
    need_triton(CPU)
    mod = importlib.import_module("blockdraft.kernels.kv_store")
    args = _kv_args()
    args[arg] = bad
    before = args["k_caches"].clone()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=arg):
        mod.ctx_kv_store(**args)
    assert torch.equal(args["k_caches"], before)  # type: ignore[arg-type]


def _attn_args() -> dict[str, object]:
    return dict(q=torch.zeros(2, 3, 4, 16), k_blk=torch.zeros(2, 3, 2, 16),
                v_blk=torch.zeros(2, 3, 2, 16), k_cache=torch.zeros(6, 4, 2, 16),
                v_cache=torch.zeros(6, 4, 2, 16), block_tables=torch.zeros(2, 3, dtype=torch.int32),
                ctx_lens=torch.zeros(2, dtype=torch.int32), q_pos=torch.zeros(2, 3, dtype=torch.int64),
                slot_pos=torch.zeros(24, dtype=torch.int32))


@pytest.mark.parametrize(("arg", "bad"), [
    ("q", torch.zeros(2, 3, 4, 16, dtype=torch.int32)),
    ("k_blk", torch.zeros(2, 3, 3, 16)),
    ("v_blk", torch.zeros(2, 3, 2, 16, dtype=torch.float16)),
    ("k_cache", torch.zeros(6, 4, 16, 2).transpose(2, 3)),
    ("v_cache", torch.zeros(7, 4, 2, 16)),
    ("block_tables", torch.zeros(2, 3, dtype=torch.int64)),
    ("ctx_lens", torch.zeros(3, dtype=torch.int32)),
    ("q_pos", torch.zeros(2, 4, dtype=torch.int64)),
    ("slot_pos", torch.zeros(23, dtype=torch.int32)),
])
def test_block_attention_rejects(arg: str, bad: torch.Tensor) -> None:
    need_triton(CPU)
    args = _attn_args()
    args[arg] = bad
    with pytest.raises(ValueError, match=arg):
        K.block_attention(**args, scale=1.0, backend="triton")  # type: ignore[arg-type]


def test_block_attention_rejects_bad_window() -> None:
    need_triton(CPU)
    with pytest.raises(ValueError, match="sliding_window"):
        K.block_attention(**_attn_args(), scale=1.0, sliding_window=0,  # type: ignore[arg-type]
                          backend="triton")


@pytest.mark.parametrize(("call", "arg"), [
    (lambda: K.acc_append([torch.zeros(4, 8)], torch.zeros(2, 9), [2], [0], backend="triton"), "accs"),
    (lambda: K.acc_append([torch.zeros(4, 8)], torch.zeros(2, 8), [3], [0], backend="triton"), "row_counts"),
    (lambda: K.acc_append([torch.zeros(4, 8)], torch.zeros(2, 8), [2], [3], backend="triton"), "dst_starts"),
    (lambda: K.acc_slide([torch.zeros(4, 8)], [2], [3], backend="triton"), "src_starts"),
    (lambda: K.acc_slide([torch.zeros(4, 8)], [0, 1], [3], backend="triton"), "src_starts"),
    (lambda: K.masked_argmax(torch.zeros(2, 40), torch.zeros(2, 1, dtype=torch.int32), backend="triton"), "bitmask"),
    (lambda: K.masked_argmax(torch.zeros(2, 40, dtype=torch.int64), None, backend="triton"), "logits"),
    (lambda: K.masked_sample(torch.zeros(2, 40), None, 1.0, -1, 1.0, backend="triton"), "top_k"),
    (lambda: K.masked_sample(torch.zeros(2, 40), None, 1.0, 0, 0.0, backend="triton"), "top_p"),
    (lambda: K.dynamic_conv(torch.zeros(1, 4, 64), torch.zeros(1, 4, 3, 3), torch.zeros(3, 64), 16, backend="triton"), "dynamic"),
    (lambda: K.dynamic_conv(torch.zeros(1, 4, 64), torch.zeros(1, 4, 3, 4), torch.zeros(3, 64), 24, backend="triton"), "group_size"),
    (lambda: K.ctx_kv_store(*_kv_args().values(), backend="cuda"), "backend"),  # type: ignore[arg-type]
])
def test_launchers_reject(call: Callable[[], object], arg: str) -> None:
    need_triton(CPU)
    with pytest.raises(ValueError, match=arg):
        call()


def test_selector_needs_uniforms_when_sampling() -> None:
    need_triton(CPU)
    mod = importlib.import_module("blockdraft.kernels.dflash2")
    z = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="uniforms"):
        mod.selector_walk(z, torch.zeros(1, 2, 3, dtype=torch.int64), z, torch.zeros(5, 3),
                          torch.zeros(5, 3), torch.zeros(1, dtype=torch.int64), 0.5, None)
