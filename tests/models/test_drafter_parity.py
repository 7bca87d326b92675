"""The torch drafter equals the public reference (dflash 0.1.0) on random weights, in fp32.

Reference drafters are built with dflash's classes from small Qwen3Configs, written with
``save_pretrained`` and loaded back with ``blockdraft.load_drafter``. Error measure: max |mine -
ref| / max |ref| over the whole output (an elementwise ratio is meaningless near zero).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import blockdraft
from blockdraft.models import ReferenceAttend, apply_rope, rms_norm
from blockdraft.sampling import inverse_cdf

from support.dflash_ref import logged_seed, rel_err, save_reference_drafter

TOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def seed() -> int:
    return logged_seed()


def make_reference(
    tmp: Path,
    *,
    dflash2: bool = False,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    target_ids: list[int] | None = None,
    block_size: int = 8,
    vocab: int = 512,
    extra: dict[str, Any] | None = None,
    dflash_extra: dict[str, Any] | None = None,
) -> tuple[Any, blockdraft.DFlashDrafter]:
    ref = save_reference_drafter(
        tmp, dflash2=dflash2, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
        intermediate=2 * hidden, vocab=vocab, num_target_layers=8, mask=vocab - 1,
        target_ids=target_ids if target_ids is not None else [1, 4], block_size=block_size,
        std=0.3, extra=extra, dflash_extra=dflash_extra,
        dflash2_config=dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6),
    )
    return ref, blockdraft.load_drafter(tmp)


def compare_forward(ref: Any, mine: blockdraft.DFlashDrafter, ctx_len: int, start: int, seed: int) -> None:
    c = mine.config
    b = c.block_size
    ctx = torch.randn(1, ctx_len, c.num_context_layers * c.hidden_size)
    emb = torch.randn(1, b, c.hidden_size)
    pos = torch.arange(start - ctx_len, start + b)[None]
    with torch.no_grad():
        expected = ref(position_ids=pos, noise_embedding=emb * c.input_embedding_scale, target_hidden=ctx)[0]
        got = mine.reference_forward(ctx[0], pos[0, :ctx_len], emb[0], pos[0, ctx_len:])
    err = rel_err(got, expected)
    assert err <= TOL, f"seed={seed}: hidden rel err {err:.3g} for {c}"


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("num_target", [1, 3, 5])
def test_block_sizes_and_target_layers(tmp_path: Path, seed: int, block_size: int, num_target: int) -> None:
    ids = random.Random(seed).sample(range(8), num_target)
    ref, mine = make_reference(tmp_path, block_size=block_size, target_ids=ids)
    assert mine.config.target_layer_ids == tuple(ids)
    compare_forward(ref, mine, ctx_len=11, start=30, seed=seed)


@pytest.mark.parametrize("num_target", [2, 4])
def test_other_target_layer_counts(tmp_path: Path, seed: int, num_target: int) -> None:
    ref, mine = make_reference(tmp_path, target_ids=list(range(num_target)), block_size=4)
    compare_forward(ref, mine, ctx_len=5, start=5, seed=seed)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_gqa_ratios(tmp_path: Path, seed: int, heads: int, kv_heads: int) -> None:
    ref, mine = make_reference(tmp_path, hidden=128, heads=heads, kv_heads=kv_heads, layers=3)
    compare_forward(ref, mine, ctx_len=9, start=100, seed=seed)


@pytest.mark.parametrize("is_causal", [None, False, True])
def test_sliding_window_layer(tmp_path: Path, seed: int, is_causal: bool | None) -> None:
    extra: dict[str, Any] = dict(
        use_sliding_window=True, sliding_window=5, layer_types=["full_attention", "sliding_attention"]
    )
    if is_causal is not None:
        extra["is_causal"] = is_causal
    ref, mine = make_reference(tmp_path, extra=extra)
    assert mine.config.layer_sliding_window(1) == 5
    assert mine.config.layer_sliding_window(0) is None
    # The window (5) is shorter than ctx + block, so it changes the result.
    compare_forward(ref, mine, ctx_len=12, start=12, seed=seed)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 1e6},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e4},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 5e5},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4},
    ],
)
def test_rope_variants(tmp_path: Path, seed: int, rope: dict[str, Any]) -> None:
    ref, mine = make_reference(tmp_path, extra={"rope_parameters": dict(rope), "max_position_embeddings": 256})
    assert mine.config.rope.rope_type == rope["rope_type"]
    assert torch.equal(mine.rope.inv_freq, ref.rotary_emb.inv_freq.float())
    assert mine.rope.attention_scaling == pytest.approx(ref.rotary_emb.attention_scaling, rel=1e-12)
    compare_forward(ref, mine, ctx_len=9, start=200, seed=seed)


def test_output_transforms_and_input_scale(tmp_path: Path, seed: int) -> None:
    ref, mine = make_reference(
        tmp_path,
        dflash_extra={"input_embedding_scale": 2.5, "output_multiplier": 0.75, "final_logit_softcapping": 3.0},
    )
    assert (mine.config.input_embedding_scale, mine.config.output_multiplier) == (2.5, 0.75)
    compare_forward(ref, mine, ctx_len=6, start=6, seed=seed)
    head = torch.nn.Linear(mine.config.hidden_size, 512, bias=False)
    hidden = torch.randn(2, 7, mine.config.hidden_size) * 4
    with torch.no_grad():
        expected = ref.compute_logits(hidden, head)
        assert rel_err(mine.logits(hidden, head.weight), expected) <= TOL
        assert rel_err(mine.logits(hidden, head), expected) <= TOL
    assert float(expected.abs().max()) <= 3.0  # softcapping engaged


def test_batched_ragged_reference_attend_equals_single(tmp_path: Path, seed: int) -> None:
    _, mine = make_reference(tmp_path, layers=2, block_size=4, extra=dict(
        use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]))
    c = mine.config
    lens, starts = [3, 9, 1], [3, 40, 17]
    rows = [torch.randn(n, c.num_context_layers * c.hidden_size) for n in lens]
    ctx_pos = [torch.arange(s - n, s) for n, s in zip(lens, starts)]
    block_pos = torch.stack([torch.arange(s, s + c.block_size) for s in starts])
    emb = torch.randn(len(lens), c.block_size, c.hidden_size)
    with torch.no_grad():
        kv = [mine.context_kv(mine.fuse_context(r), p) for r, p in zip(rows, ctx_pos)]
        batched = mine.forward_block(emb, block_pos, ReferenceAttend(c, kv, ctx_pos, block_pos))
        for i in range(len(lens)):
            single = mine.reference_forward(rows[i], ctx_pos[i], emb[i], block_pos[i])
            assert rel_err(batched[i], single) <= TOL, f"seed={seed} sequence {i}"


def test_interface_tensors(tmp_path: Path, seed: int) -> None:
    _, mine = make_reference(tmp_path, layers=3, heads=4, kv_heads=2)
    c = mine.config
    w = mine.ctx_kv_weight()
    assert w.shape == (c.num_layers * 2 * c.num_kv_heads * c.head_dim, c.hidden_size)
    fused = torch.randn(5, c.hidden_size)
    pos = torch.arange(5) + 3
    kv = mine.context_kv(fused, pos)
    # One GEMM with the stacked weight, then k_norm + RoPE, gives the same K/V.
    stacked = (fused @ w.T).reshape(5, c.num_layers, 2, c.num_kv_heads, c.head_dim)
    cos, sin = mine.rope.cos_sin(pos, fused.dtype)
    norms = mine.k_norm_weights()
    assert norms.shape == (c.num_layers, c.head_dim)
    for layer, (k, v) in enumerate(kv):
        k_manual = rms_norm(stacked[:, layer, 0], norms[layer], c.rms_norm_eps)
        k_manual = apply_rope(k_manual, cos, sin)
        assert rel_err(k_manual, k) <= TOL
        assert rel_err(stacked[:, layer, 1], v) <= TOL
    assert mine.rope.inv_freq.dtype == torch.float32 and mine.rope.inv_freq.shape == (c.head_dim // 2,)


def test_dflash2_forward_and_selector(tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy: the same candidates and tokens. Sampled: the reference draws its tokens with
    ``torch.multinomial``, blockdraft by inverse CDF (``sampling.sample_rows``), one uniform per
    row from the same global stream; with the reference's draw replaced by that rule, both
    draw the same tokens, so every row's ``q`` (which depends on the tokens before it)
    compares."""
    import dflash.model

    def inverse_cdf_draw(probs: torch.Tensor) -> torch.Tensor:
        flat = probs.reshape(-1, probs.shape[-1])
        return inverse_cdf(flat, torch.rand(flat.shape[0])).view(probs.shape[:-1])

    monkeypatch.setattr(dflash.model, "_sample_probs", inverse_cdf_draw)
    ref, mine = make_reference(tmp_path, dflash2=True, block_size=8)
    assert isinstance(mine, blockdraft.DFlash2Drafter)
    compare_forward(ref, mine, ctx_len=10, start=10, seed=seed)
    c = mine.config
    head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
    hidden = torch.randn(1, c.block_size - 1, c.hidden_size)
    anchor = torch.randint(0, c.vocab_size, (1,))
    with torch.no_grad():
        tokens, candidates, q = ref.propose(hidden, anchor, head, 0.0)
        greedy = mine.draft(hidden, anchor, head.weight)
        assert q is None and greedy.q is None
        assert greedy.candidates is not None
        assert torch.equal(greedy.candidates, candidates)
        assert torch.equal(greedy.tokens, tokens)
        for temperature in (0.7, 1.3):
            torch.manual_seed(seed + 1)
            tokens, candidates, q = ref.propose(hidden, anchor, head, temperature)
            torch.manual_seed(seed + 1)
            sampled = mine.draft(hidden, anchor, head.weight, temperature)
            assert sampled.q is not None and q is not None
            assert rel_err(sampled.q, q) <= TOL
            assert torch.allclose(sampled.q.sum(-1), torch.ones(1, c.block_size - 1))
            assert torch.equal(sampled.tokens, tokens), f"seed={seed} T={temperature}"


def test_dflash2_short_block_convolution(tmp_path: Path, seed: int) -> None:
    """Blocks shorter than the conv kernel (end of generation): taps past the start are zero."""
    _, mine = make_reference(tmp_path, dflash2=True, block_size=4)
    c = mine.config
    conv = mine.layer(0).attention_conv
    assert conv is not None and conv.kernel_size == 3
    x = torch.randn(1, 2, c.hidden_size)
    with torch.no_grad():
        out, _ = conv.prepare(x)
        # Row 0 sees only itself; row 1 itself and row 0 (the third tap falls before the block).
        full, _ = conv.prepare(torch.cat((x, torch.randn(1, 3, c.hidden_size)), dim=1))
    assert rel_err(out, full[:, :2]) <= TOL
