"""Launchers reject bad arguments with a ValueError that names the argument, before any write."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch

from support.kernel_support import K, need_triton

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
                v_cache=torch.zeros(6, 4, 2, 16), page_tables=torch.zeros(2, 3, dtype=torch.int32),
                ctx_lens=torch.zeros(2, dtype=torch.int32), q_pos=torch.zeros(2, 3, dtype=torch.int64),
                slot_pos=torch.zeros(24, dtype=torch.int32))


@pytest.mark.parametrize(("arg", "bad"), [
    ("q", torch.zeros(2, 3, 4, 16, dtype=torch.int32)),
    ("k_blk", torch.zeros(2, 3, 3, 16)),
    ("v_blk", torch.zeros(2, 3, 2, 16, dtype=torch.float16)),
    ("k_cache", torch.zeros(6, 4, 16, 2).transpose(2, 3)),
    ("v_cache", torch.zeros(7, 4, 2, 16)),
    ("page_tables", torch.zeros(2, 3, dtype=torch.int64)),
    ("ctx_lens", torch.zeros(3, dtype=torch.int32)),
    ("q_pos", torch.zeros(2, 4, dtype=torch.int64)),
    ("slot_pos", torch.zeros(23, dtype=torch.int32)),
])
def test_block_attention_rejects(arg: str, bad: torch.Tensor) -> None:
    need_triton(CPU)
    args = _attn_args()
    args[arg] = bad
    with pytest.raises(ValueError, match=arg):
        K.ops("triton").block_attention(**args, scale=1.0)


def test_block_attention_rejects_bad_window() -> None:
    need_triton(CPU)
    with pytest.raises(ValueError, match="sliding_window"):
        K.ops("triton").block_attention(**_attn_args(), scale=1.0, sliding_window=0)


@pytest.mark.parametrize(("call", "arg"), [
    (lambda: K.ops("triton").masked_argmax(torch.zeros(2, 40), torch.zeros(2, 1, dtype=torch.int32)), "bitmask"),
    (lambda: K.ops("triton").masked_argmax(torch.zeros(2, 40, dtype=torch.int64), None), "logits"),
    (lambda: K.ops("triton").causal_attention(torch.zeros(3, 4, 8), torch.zeros(2, 4, 3, 8),
                                              torch.zeros(2, 4, 3, 8), torch.zeros(1, 2, dtype=torch.int32),
                                              torch.tensor([0, 3], dtype=torch.int32),
                                              torch.tensor([3], dtype=torch.int32),
                                              torch.zeros(3, dtype=torch.int64), scale=1.0), "k_cache"),
    (lambda: K.ops("triton").causal_attention(torch.zeros(3, 4, 8), torch.zeros(2, 4, 2, 8),
                                              torch.zeros(2, 4, 2, 8), torch.zeros(1, 2, dtype=torch.int32),
                                              torch.tensor([0, 3], dtype=torch.int64),
                                              torch.tensor([3], dtype=torch.int32),
                                              torch.zeros(3, dtype=torch.int64), scale=1.0), "q_starts"),
])
def test_launchers_reject(call: Callable[[], object], arg: str) -> None:
    need_triton(CPU)
    with pytest.raises(ValueError, match=arg):
        call()


def test_backends_are_named() -> None:
    from blockdraft import ConfigError

    with pytest.raises(ConfigError, match="backend"):
        K.ops("cuda")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="backend"):
        K.resolve_backend("cuda", CPU)
    assert K.resolve_backend("auto", CPU) == "torch"
    assert K.ops("torch").acc_append is None and K.ops("torch").stage_gather is None
