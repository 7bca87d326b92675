"""Any Hugging Face causal LM as a target: GPT-2, GPT-NeoX and Phi (none of them on the
blockdraft runtime) served by ``runtime="auto"`` on the Hugging Face path, their hidden rows
found generically, and the models that path cannot serve refused by name."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PhiConfig,
    PhiForCausalLM,
)

import blockdraft
from blockdraft import ConfigError, SpeculativeEngine
from blockdraft.pair import DrafterShape, random_drafter
from blockdraft.target import TargetHead, find_layers, resolve_runtime

from support.oracle import OracleProposer
from support.scorecard import expect_clear_error
from support.tinypair import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, HIDDEN, LAYERS, BLOCK = 64, 32, 3, 4
PROMPTS = [[1, 2, 3, 4, 5], [7], [(7 * i + 3) % 60 for i in range(13)]]
WHERE = {"gpt2": "transformer.h", "neox": "gpt_neox.layers", "phi": "model.layers", "opt": "model.decoder.layers"}


def make_target(family: str, seed: int = 0) -> Any:
    """A random causal LM of ``family`` (3 layers, hidden 32, 64 tokens, 128 positions); its
    matrices ~ N(0, 0.4), so its greedy choices follow the context (a row left in the cache by
    a missed crop changes them)."""
    sizes: dict[str, Any] = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                                 vocab_size=VOCAB, max_position_embeddings=128)
    model: Any
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, vocab_size=VOCAB,
                                           n_positions=128))
    elif family == "neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(intermediate_size=64, **sizes))
    elif family == "phi":
        model = PhiForCausalLM(PhiConfig(intermediate_size=64, **sizes))
    elif family == "opt":
        model = OPTForCausalLM(OPTConfig(ffn_dim=64, word_embed_proj_dim=HIDDEN, **sizes))
    else:
        raise ValueError(family)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights 1, biases 0: random ones would outweigh the context
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
    return model.eval()


def drafter_for(target: Any) -> Any:
    """A random DFlash drafter fitted to ``target``, reading its first and last layers."""
    shape = DrafterShape.for_target(target.config, num_layers=1, block_size=BLOCK, mask_token_id=VOCAB - 1,
                                    target_layer_ids=[0, LAYERS - 1], intermediate_size=48)
    return random_drafter(shape, "cpu", torch.float32, seed=1)


def reference(target: Any, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation by Hugging Face ``generate``."""
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


class Opaque(torch.nn.Module):
    """A causal LM behind a module that hides its layers (the model is not a submodule): only
    its embeddings, head and forward are visible. ``states=False`` drops the hidden states
    from every output; ``kwargs=False`` makes the forward take no ``output_hidden_states``."""

    def __init__(self, inner: Any, *, states: bool = True, kwargs: bool = True) -> None:
        super().__init__()
        self._inner = [inner]
        self.config = inner.config
        self.lm_head = inner.get_output_embeddings()
        self.states, self.kwargs = states, kwargs

    def get_input_embeddings(self) -> Any:
        return self._inner[0].get_input_embeddings()

    def forward(self, input_ids: Any, past_key_values: Any = None, use_cache: bool = False,
                position_ids: Any = None, **kw: Any) -> Any:
        if not self.kwargs and kw:
            raise TypeError(f"forward() got an unexpected keyword argument {next(iter(kw))!r}")
        out = self._inner[0](input_ids=input_ids, past_key_values=past_key_values, use_cache=use_cache,
                             position_ids=position_ids, **kw)
        if not self.states:
            out.hidden_states = None
        return out


@pytest.mark.parametrize("family", ["gpt2", "neox", "phi", "opt"])
def test_found_layers_give_the_rows_of_output_hidden_states(family: str) -> None:
    model = make_target(family)
    found = find_layers(model)
    assert found is not None and found.where == WHERE[family] and len(found.layers) == LAYERS
    adapter = blockdraft.TargetAdapter(model, list(range(LAYERS)))
    assert adapter.capture == "hooks" and adapter.num_layers == LAYERS
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    out = adapter.forward(ids)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        # layer i's raw output is hidden_states[i + 1]: the last differs (its entry is after the final norm)
        raw: list[torch.Tensor] = []
        handle = found.layers[LAYERS - 1].register_forward_hook(
            lambda m, a, o: raw.append(o[0] if isinstance(o, tuple) else o))
        model(ids)
        handle.remove()
    assert len(ref.hidden_states) == LAYERS + 1
    rows = out.ctx_rows.view(2, 7, LAYERS, HIDDEN)
    for i in range(LAYERS):
        assert torch.equal(rows[:, :, i], ref.hidden_states[i + 1]), i
    assert not torch.allclose(raw[0], ref.hidden_states[LAYERS])
    assert torch.equal(out.logits, ref.logits)


def test_hidden_layers_fall_back_to_output_hidden_states() -> None:
    model = make_target("gpt2")
    hidden = Opaque(model)
    assert find_layers(hidden) is None
    adapter = blockdraft.TargetAdapter(hidden, [2, 0])
    hooked = blockdraft.TargetAdapter(model, [2, 0])
    assert adapter.capture == "hidden_states" and adapter.num_layers == LAYERS
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    full = adapter.forward(ids)
    assert torch.equal(full.ctx_rows, hooked.forward(ids).ctx_rows)
    # Incremental with a rolled-back block, as the Hugging Face path runs it.
    cache = adapter.new_cache()
    first = adapter.forward(ids[:, :5], past_key_values=cache)
    adapter.forward(torch.randint(0, VOCAB, (1, 4)), past_key_values=cache)
    adapter.crop_cache(cache, 5)
    second = adapter.forward(ids[:, 5:], past_key_values=cache)
    torch.testing.assert_close(torch.cat((first.ctx_rows, second.ctx_rows)), full.ctx_rows)
    adapter.close()
    with pytest.raises(RuntimeError, match="did not run"):
        adapter.forward(ids)
    # The engine serves it the same way.
    drafter = drafter_for(model)
    res = SpeculativeEngine(hidden, drafter, runtime="auto").generate(PROMPTS[:2], max_new_tokens=6)
    assert res.tokens == [reference(model, p, 6) for p in PROMPTS[:2]]


@pytest.mark.parametrize("family", ["gpt2", "neox", "phi"])
def test_auto_serves_the_family_token_identical(family: str, caplog: pytest.LogCaptureFixture) -> None:
    target = make_target(family)
    drafter = drafter_for(target)
    n = 10
    want = [reference(target, p, n) for p in PROMPTS]
    with caplog.at_level(logging.INFO, logger="blockdraft"):
        engine = SpeculativeEngine(target, drafter, runtime="auto", max_active=4)
    assert f"target runtime 'auto': hf, the model's own Hugging Face forward one sequence at a time, because " \
           f"the blockdraft runtime does not support {type(target).__name__}" in caplog.text
    assert f"rows of layers [0, {LAYERS - 1}] hooked at {WHERE[family]}" in caplog.text
    assert engine.target_runtime == "hf" and engine.max_seq_len == 128  # n_positions / max_position_embeddings
    res = engine.generate(PROMPTS, max_new_tokens=n)
    assert res.tokens == want and res.stats.target_runtime == "hf"
    # Mostly-right drafts: long acceptances, and rejected rows cropped off the cache.
    truth = [p + w for p, w in zip(PROMPTS, want)]
    prop = OracleProposer(drafter, target, truth=truth, vocab=VOCAB, max_seq_len=64, num_pages=64, max_batch=4)
    oracle = SpeculativeEngine(target, drafter, proposer=prop, runtime="auto", max_seq_len=64)
    res = oracle.generate(PROMPTS, max_new_tokens=n)
    assert res.tokens == want
    steps = [a for seq in res.stats.acceptance_lengths for a in seq]
    assert max(steps) >= 3 and min(steps) < BLOCK
    assert prop.pool.num_free == prop.pool.num_pages
    alone = SpeculativeEngine(target, drafter, runtime="auto", max_seq_len=64, speculate=False)
    assert alone.generate(PROMPTS, max_new_tokens=n).tokens == want


def test_auto_names_the_runtime_it_picks(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="blockdraft"):
        assert resolve_runtime("auto", tiny_target("qwen3")) == "blockdraft"
    assert "target runtime 'auto': blockdraft, because it supports Qwen3ForCausalLM" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="blockdraft"):
        assert resolve_runtime("hf", make_target("gpt2")) == "hf"
        assert resolve_runtime("blockdraft", tiny_target("llama")) == "blockdraft"
    assert "target runtime" not in caplog.text  # asked for by name: nothing to explain


def test_a_target_without_hidden_states_is_refused() -> None:
    model = make_target("gpt2")
    drafter = drafter_for(model)
    with expect_clear_error(ConfigError, "target Opaque", "decoder layers were not found",
                            "returns no hidden_states with output_hidden_states=True"):
        SpeculativeEngine(Opaque(model, states=False), drafter, runtime="auto")
    with expect_clear_error(ConfigError, "decoder layers were not found",
                            "output_hidden_states=True failed: .*unexpected keyword argument"):
        blockdraft.TargetAdapter(Opaque(model, kwargs=False), [0])


def test_a_recurrent_cache_is_refused() -> None:
    mamba = MambaForCausalLM(MambaConfig(hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=VOCAB,
                                         state_size=4)).eval()
    shape = DrafterShape.for_target(make_target("gpt2").config, num_layers=1, block_size=BLOCK,
                                    mask_token_id=VOCAB - 1, target_layer_ids=[1])
    with expect_clear_error(ConfigError, "MambaForCausalLM", "Hugging Face path", "recurrent state",
                            "crop"):
        SpeculativeEngine(mamba, random_drafter(shape, "cpu", torch.float32), runtime="auto", max_seq_len=64)


def test_fit_checks_read_the_family_names() -> None:
    gpt2 = make_target("gpt2")
    shape = DrafterShape.for_target(gpt2.config, num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1)
    assert (shape.hidden_size, shape.num_target_layers, shape.intermediate_size, shape.max_positions) == (
        HIDDEN, LAYERS, 4 * HIDDEN, 128)  # n_embd, n_layer, 4 x n_embd (n_inner unset), n_positions
    head = TargetHead.from_target(gpt2)
    assert (head.hidden_size, head.num_layers, head.max_positions) == (HIDDEN, LAYERS, 128)
    with expect_clear_error(ConfigError, "target layer id 3 is out of range: the target has 3 layers"):
        head.check_fits(drafter_hidden=HIDDEN, target_layer_ids=[0, 3], mask_token_id=1)
    with expect_clear_error(ConfigError, "drafter hidden_size 48 != target hidden_size 32"):
        head.check_fits(drafter_hidden=48, target_layer_ids=[0], mask_token_id=1)
