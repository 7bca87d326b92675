"""Tensor parallelism on the CPU (gloo, 2 ranks): the runtime's logits, captured rows and
greedy tokens at TP = 2 against TP = 1, the speculative engine at TP = 2 against TP = 1, the
same page tables and decisions on both ranks, and the targets a TP size cannot split.

The two-rank results come from one launch (``tp_support.everything``) shared by the tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from blockdraft import ConfigError, TargetRuntime
from blockdraft.parallel import TPGroup, check_split, launch, part
from blockdraft.target.runtime.shard import model_shard

from support.runtime_models import CASES, make_target
from support.scorecard import expect_clear_error, score
from support.tp_support import RUNTIME_CASES, everything


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(TP = 1 results, [rank 0's, rank 1's] TP = 2 results)``."""
    two = launch(everything, 2, device="cpu", timeout_s=60.0)
    one = everything(TPGroup.single())
    return one, two


@pytest.mark.parametrize("name", RUNTIME_CASES)
def test_runtime_tp2_equals_tp1(runs: Any, name: str) -> None:
    """Prefill logits, verify logits and captured rows within 1e-5 of TP = 1 (fp32); greedy
    decoding token for token; every rank holds its half of the K/V heads and q/k/v rows."""
    one, two = runs
    want = one["runtime"][name]
    for rank, res in enumerate(two):
        got = res["runtime"][name]
        assert res["rank"] == rank
        for key in ("last", "verify", "rows"):
            assert got[key].shape == want[key].shape
            assert rel_err(got[key], want[key]) < 1e-5, (name, key, rank)
        assert got["decoded"] == want["decoded"], name
        assert got["free"][0] == got["free"][1] == want["free"][0]  # every page back
        assert got["num_kv_heads"] * 2 == want["num_kv_heads"]
        assert got["qkv_rows"] * 2 == want["qkv_rows"]
        assert got["pages"] == want["pages"]
        score.invariant_checks += 4


@pytest.mark.parametrize("name", RUNTIME_CASES)
def test_ranks_hold_the_same_bits_and_pages(runs: Any, name: str) -> None:
    """After the all-reduces the rows are whole and identical on every rank, so logits match
    bit for bit and the page tables (each rank's own core bookkeeping) are equal."""
    r0, r1 = (res["runtime"][name] for res in runs[1])
    for key in ("last", "verify", "rows"):
        assert torch.equal(r0[key], r1[key]), (name, key)
    assert r0["pages"] == r1["pages"] and r0["decoded"] == r1["decoded"]
    # sampling without a generator, on ranks whose own random states differ: rank 0's seed
    assert r0["sampled"] == r1["sampled"]
    score.invariant_checks += 1


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_engine_tp2_equals_tp1(runs: Any, kind: str) -> None:
    """Greedy speculative output (continuous batching: 4 requests, 2 at a time) equals TP =
    1; the pages in use after every step are the same on both ranks and at TP = 1 (the
    runtime compared every running sequence's page table across ranks after every step);
    sampled output (seeded, and with the engine's own per-request seeds) is the same on both
    ranks, and seeded equals TP = 1; every page is back at the end."""
    one, two = runs
    want = one["engine"][kind]
    r0, r1 = (res["engine"][kind] for res in two)
    assert r0["greedy"] == r1["greedy"] == want["greedy"]
    assert all(len(t) == 12 for t in want["greedy"])
    assert r0["used"] == r1["used"] == want["used"]
    assert r0["seeded"] == r1["seeded"] == want["seeded"]
    assert r0["unseeded"] == r1["unseeded"]
    for res in (r0, r1):
        assert res["end"] == {"target": 0, "drafter": 0}
        assert res["total"] == want["total"]
    score.invariant_checks += len(want["used"])


def test_unsplittable_heads_refused_on_the_ranks(runs: Any) -> None:
    """Inside a real two-rank group: one K/V head is refused naming it; a model sharded for a
    group is refused when reused without it."""
    for res in runs[1]:
        msg = res["refusals"]["llama-mqa-bias"]
        assert "num_key_value_heads=1" in msg and "not divisible by 2" in msg
        assert "LlamaForCausalLM" in msg
        assert "rank" in res["refusals"]["sharded"]
        score.clear_errors += 2
        score.bad_inputs += 2


@pytest.mark.parametrize(
    ("name", "fields", "tp", "named"),
    [
        ("qwen3", {}, 3, ["num_attention_heads=4", "num_key_value_heads=2"]),
        ("qwen3", {}, 4, ["num_key_value_heads=2"]),
        ("qwen3-mha-tied", {"intermediate_size": 70}, 4, ["intermediate_size=70"]),
        ("llama-gqa3", {}, 4, ["num_attention_heads=6", "num_key_value_heads=2"]),
    ],
)
def test_sizes_that_do_not_split_are_refused(name: str, fields: dict[str, Any], tp: int,
                                             named: list[str]) -> None:
    """Refused before any collective and before any weight is touched: the message names
    every count that does not divide and the size; the model keeps working whole."""
    model_cls, config_cls, base = CASES[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**base, **fields})).eval() if fields else make_target(name)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        before = model(ids).logits
    group = TPGroup(rank=0, size=tp, device=torch.device("cpu"))  # never reaches a collective
    with expect_clear_error(ConfigError, f"not divisible by {tp}", type(model).__name__, *named):
        TargetRuntime(model, num_pages=4, page_size=4, tp=group)
    assert model_shard(model) == (0, 1)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_split_helpers() -> None:
    assert part(12, 1, 3) == slice(4, 8)
    check_split("m", {"a": 8, "b": 4}, 4)
    with expect_clear_error(ConfigError, "b=6 is not divisible by 4"):
        check_split("m", {"a": 8, "b": 6}, 4)
    with expect_clear_error(ValueError, "tensor-parallel size"):
        check_split("m", {"a": 8}, 0)
    with expect_clear_error(ValueError, "do not split"):
        part(10, 0, 4)


def test_shard_layout_on_one_process() -> None:
    """Rank 1 of 2 keeps the second half of every q/k/v and gate/up row block (fused, the
    modules' views) and the second half of o's and down's input columns; o/down biases
    stay whole."""
    whole = make_target("llama-bias-gqa")
    model = make_target("llama-bias-gqa")
    layer_w, layer = whole.model.layers[1], model.model.layers[1]
    from blockdraft.target.runtime.shard import shard_target
    from blockdraft.target.runtime.spec import TargetSpec

    spec = shard_target(TargetSpec.from_model(model), TPGroup(rank=1, size=2, device=torch.device("cpu")))
    assert (spec.num_heads, spec.num_kv_heads, spec.intermediate_size) == (2, 1, 36)
    assert (spec.tp_rank, spec.tp_size) == (1, 2)
    attn, attn_w = layer.self_attn, layer_w.self_attn
    d = spec.head_dim
    assert torch.equal(attn.q_proj.weight, attn_w.q_proj.weight[2 * d:])
    assert torch.equal(attn.k_proj.weight, attn_w.k_proj.weight[d:])
    assert torch.equal(attn.v_proj.bias, attn_w.v_proj.bias[d:])
    # one fused tensor: q's rows, then k's, then v's
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.storage_offset() == attn.q_proj.weight.numel()
    assert torch.equal(attn.o_proj.weight, attn_w.o_proj.weight[:, 2 * d:])
    assert torch.equal(attn.o_proj.bias, attn_w.o_proj.bias)
    mlp, mlp_w = layer.mlp, layer_w.mlp
    assert torch.equal(mlp.up_proj.weight, mlp_w.up_proj.weight[36:])
    assert torch.equal(mlp.down_proj.weight, mlp_w.down_proj.weight[:, 36:])
    assert torch.equal(mlp.down_proj.bias, mlp_w.down_proj.bias)
    assert model_shard(model) == (1, 2)
    with expect_clear_error(ConfigError, "rank 1 of 2"):
        shard_target(TargetSpec.from_model(model), TPGroup(rank=0, size=2, device=torch.device("cpu")))
