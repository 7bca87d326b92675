"""The target runtime against Hugging Face's own forward: logits, captured rows, greedy
decoding, every supported family; its weights; its refusals."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import blockdraft
from blockdraft import ConfigError, InvalidStateError, TargetRuntime
from blockdraft.kernels import triton_available

from support.runtime_models import CASES, VOCAB, hf_greedy, make_target
from support.scorecard import expect_clear_error, score
from support.tinypair import drafter_config, tiny_drafter

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="Triton is not importable here"))]
PROMPTS = [[3], [5, 9, 11, 2, 60, 7, 7, 1, 40], [(7 * i + 3) % VOCAB for i in range(23)]]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _hf(model: Any, prompt: list[int]) -> Any:
    with torch.no_grad():
        return model(torch.tensor([prompt]), output_hidden_states=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_rows_equal_hf(name: str, backend: str) -> None:
    """A ragged batch (1, 9 and 23 tokens over pages of 4, prefilled in chunks of 7 rows in
    all) and then a 4-row verify block per sequence: last-row logits, every verify row's
    logits and the captured rows equal Hugging Face's forward within 1e-5 (fp32)."""
    model = make_target(name)
    rt = TargetRuntime(model, num_pages=40, page_size=4, backend=backend, capture_layers=[0, 2],
                       prefill_chunk=7)
    seqs = [rt.new_sequence(len(p) + 4) for p in PROMPTS]
    chunks: list[tuple[list[int], list[range], torch.Tensor]] = []
    last = rt.prefill(seqs, PROMPTS, on_chunk=lambda i, s, r: chunks.append((i, s, r.clone())))
    assert max(r.shape[0] for _, _, r in chunks) <= 7
    for k, p in enumerate(PROMPTS):
        want = _hf(model, p)
        assert rel_err(last[k], want.logits[0, -1]) < 1e-5, (name, k)
        # the captured rows of the prompt, as HF's hidden_states[i + 1] (the last after the norm)
        hs = want.hidden_states
        rows = torch.cat([r[[j for j, idx in enumerate(_row_owner(i, s)) if idx == k]]
                          for i, s, r in chunks])
        assert rel_err(rows, torch.cat([hs[1][0], hs[3][0]], -1)) < 1e-5
    blocks = [[(5 * k + j) % VOCAB for j in range(4)] for k in range(len(PROMPTS))]
    out = rt.forward(seqs, blocks, logits="all")
    offset = 0
    for p, b in zip(PROMPTS, blocks):
        want = _hf(model, p + b).logits[0, len(p):]
        assert rel_err(out.logits[offset : offset + 4], want) < 1e-5
        offset += 4
    rt.free(seqs)
    assert rt.pool.num_free == rt.pool.num_pages
    score.invariant_checks += len(PROMPTS) * 3


def _row_owner(idx: list[int], spans: list[range]) -> list[int]:
    return [i for i, s in zip(idx, spans) for _ in s]


@pytest.mark.parametrize("name", ["qwen3", "llama-gqa3", "qwen2-sliding", "mistral-sliding-gqa4"])
def test_decode_equals_hf_generate(name: str) -> None:
    model = make_target(name)
    n = 14
    want = [hf_greedy(model, p, n) for p in PROMPTS]
    single = [blockdraft.decode(model, [p], max_new_tokens=n).tokens[0] for p in PROMPTS]
    batched = blockdraft.decode(model, PROMPTS, max_new_tokens=n)
    assert single == want and batched.tokens == want
    assert batched.stats.target_runtime == "blockdraft"
    assert batched.stats.num_new_tokens == n * len(PROMPTS)
    # a stop token mid-way through one continuation ends that one only
    stop = want[2][5]
    stopped = blockdraft.decode(model, PROMPTS, max_new_tokens=n, stop_token_ids=[stop])
    assert stopped.tokens == [hf_greedy(model, p, n, [stop]) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("max_new", [1, 6, 13])
def test_generate_on_the_runtime_equals_hf_generate(kind: str, max_new: int) -> None:
    from support.tinypair import tiny_target

    target = tiny_target(kind)
    drafter = tiny_drafter(drafter_config(block=4))
    prompts = [[1, 2, 3, 4, 5], [7], [(3 * i + 1) % 60 for i in range(19)]]
    want = [hf_greedy(target, p, max_new) for p in prompts]
    res = blockdraft.generate(target, drafter, prompts, max_new_tokens=max_new, runtime="blockdraft")
    assert res.tokens == want and res.stats.target_runtime == "blockdraft"
    hf = blockdraft.generate(target, drafter, prompts, max_new_tokens=max_new, runtime="hf")
    assert hf.tokens == want and hf.stats.target_runtime == "hf"
    stop = want[2][min(3, max_new - 1)]
    res = blockdraft.generate(target, drafter, prompts, max_new_tokens=max_new,
                              stop_token_ids=[stop], runtime="blockdraft")
    assert res.tokens == [hf_greedy(target, p, max_new, [stop]) for p in prompts]


def test_unsupported_architecture_is_named(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64,
                                      n_positions=128)).eval()
    with expect_clear_error(ConfigError, "GPT2LMHeadModel"):
        TargetRuntime(gpt2)
    with expect_clear_error(ConfigError, "GPT2LMHeadModel"):
        blockdraft.decode(gpt2, [[1, 2]], max_new_tokens=2)
    from blockdraft.engine import resolve_runtime

    with expect_clear_error(ConfigError, "GPT2LMHeadModel"):
        resolve_runtime("blockdraft", gpt2)
    with caplog.at_level(logging.INFO, logger="blockdraft"):
        assert resolve_runtime("auto", gpt2) == "hf"
    assert "GPT2LMHeadModel" in caplog.text
    with expect_clear_error(ConfigError, "runtime"):
        resolve_runtime("vllm", gpt2)


def test_unsupported_features_are_named() -> None:
    model = make_target("llama-gqa3")
    model.config.hidden_act = "gelu"
    with expect_clear_error(ConfigError, "hidden_act"):
        TargetRuntime(model)
    model = make_target("llama-gqa3")
    model.config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    with expect_clear_error(ConfigError, "longrope"):
        TargetRuntime(model)


def _storages(model: torch.nn.Module) -> dict[int, int]:
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


def test_fused_weights_are_the_models_own_storage() -> None:
    model = make_target("llama-mqa-bias")
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        before = model(ids).logits
    bytes_before = sum(_storages(model).values())
    rt = TargetRuntime(model, num_pages=8, page_size=4)
    assert sum(_storages(model).values()) == bytes_before  # nothing held twice
    layer = model.model.layers[1]
    fused = rt.forward_pass._layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.q_proj.weight.data_ptr() == fused.qkv.data_ptr()
    assert attn.v_proj.weight.data_ptr() == fused.qkv[-attn.v_proj.out_features].data_ptr()
    assert attn.k_proj.bias.data_ptr() == fused.qkv_bias[attn.q_proj.out_features].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == fused.gate_up[mlp.gate_proj.out_features].data_ptr()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # the model's own forward still works
        attn.k_proj.weight.mul_(2.0)  # a write through the module is a write to the fused tensor
    assert torch.equal(fused.qkv[attn.q_proj.out_features : attn.q_proj.out_features + 1],
                       attn.k_proj.weight[:1])
    again = TargetRuntime(model, num_pages=8, page_size=4)  # attaching twice fuses nothing new
    assert again.forward_pass._layers[1].qkv.data_ptr() == fused.qkv.data_ptr()
    assert sum(_storages(model).values()) == bytes_before


def test_bad_inputs_change_nothing() -> None:
    model = make_target("qwen3")
    rt = TargetRuntime(model, num_pages=12, page_size=4, max_seq_len=64)
    other = TargetRuntime(model, num_pages=4, page_size=4, max_seq_len=64)
    seq = rt.new_sequence(10)
    rt.forward([seq], [[1, 2, 3]])
    rt.accept([seq], [3])
    state = (seq.length, seq.pending, list(seq.pages), rt.pool.num_free)
    foreign = other.new_sequence(4)
    cases: list[tuple[type[Exception], str, Any]] = [
        (ValueError, "capacity", lambda: rt.new_sequence(0)),
        (ValueError, "max_seq_len", lambda: rt.new_sequence(65)),
        (TypeError, "capacity", lambda: rt.new_sequence(3.0)),  # type: ignore[arg-type]
        (ValueError, "vocabulary", lambda: rt.forward([seq], [[VOCAB]])),
        (ValueError, "vocabulary", lambda: rt.forward([seq], [[-1]])),
        (TypeError, "token", lambda: rt.forward([seq], [[1.5]])),  # type: ignore[list-item]
        (ValueError, "capacity", lambda: rt.forward([seq], [[1] * 8])),
        (ValueError, "token lists", lambda: rt.forward([seq], [[1], [2]])),
        (ValueError, "logits", lambda: rt.forward([seq], [[1]], logits="some")),
        (InvalidStateError, "another", lambda: rt.forward([foreign], [[1]])),
        (InvalidStateError, "another", lambda: rt.accept([foreign], [0])),
        (InvalidStateError, "another", lambda: rt.free([foreign])),
        (ValueError, "twice", lambda: rt.forward([seq, seq], [[1], [2]])),
        (ValueError, "pending", lambda: rt.accept([seq], [1])),
    ]
    for exc, word, call in cases:
        with expect_clear_error(exc, word):
            call()
        assert (seq.length, seq.pending, list(seq.pages), rt.pool.num_free) == state
        score.invariant_checks += 1
    rt.free([seq])
    with expect_clear_error(InvalidStateError, "freed"):
        rt.forward([seq], [[1]])
    rt.free([seq])  # idempotent
    other.free([foreign])
    assert rt.pool.num_free == rt.pool.num_pages and other.pool.num_free == other.pool.num_pages
    with expect_clear_error(ValueError, "empty"):
        blockdraft.decode(model, [[1], []], max_new_tokens=2)
    with expect_clear_error(ValueError, "max_seq_len"):
        blockdraft.decode(rt, [list(range(60))], max_new_tokens=8)
    with expect_clear_error(ConfigError, "max_position_embeddings"):
        TargetRuntime(model, max_seq_len=10_000)


def test_fixed_shape_graph_buffers_give_the_eager_output() -> None:
    """The graph path's static buffers (run eagerly: ``graphs="static"``) for decode and for
    verify blocks padded to B rows give the eager output token for token."""
    model = make_target("qwen3")
    want = [hf_greedy(model, p, 11) for p in PROMPTS]
    static = TargetRuntime(model, num_pages=40, page_size=4, graphs="static", max_batch=4)
    assert static.graphs is not None
    assert blockdraft.decode(static, PROMPTS, max_new_tokens=11).tokens == want
    assert static.graphs.calls >= 10  # every decode step took the fixed-shape path
    from support.tinypair import tiny_target

    target = tiny_target("qwen3")
    drafter = tiny_drafter(drafter_config(block=4))
    prompts = [[1, 2, 3], [9, 8], [(5 * i + 2) % 60 for i in range(13)]]
    want = [hf_greedy(target, p, 9) for p in prompts]
    for graphs in ("static", "off"):
        engine = blockdraft.SpeculativeEngine(target, drafter, graphs=graphs, max_seq_len=64,  # type: ignore[arg-type]
                                              num_pages=64, max_batch=4)
        assert engine.generate(prompts, max_new_tokens=9).tokens == want
        rt = engine.runtime
        assert rt is not None
        assert (rt.graphs is not None) == (graphs == "static")
        if rt.graphs is not None:
            assert rt.graphs.calls > 0
        assert engine.pages_used() == {"target": 0, "drafter": 0}


@pytest.mark.parametrize("site", ["workspace", "target_forward"])
def test_a_failed_forward_leaves_nothing_to_accept(site: str) -> None:
    """Fault injection at the runtime's allocation and forward sites: the sequences keep their
    length, nothing is pending (no half-written row can be accepted), no page moves; the next
    forward gives Hugging Face's logits."""
    from blockdraft import faults

    model = make_target("qwen3")
    rt = TargetRuntime(model, num_pages=10, page_size=4, capture_layers=[0, 2], graphs="off")
    seq = rt.new_sequence(20)
    rt.prefill([seq], [PROMPTS[1]])
    before = (seq.length, list(seq.pages), rt.pool.num_free)
    with faults.inject(site, 1), pytest.raises(Exception, match="fault injection"):
        rt.forward([seq], [[4, 5, 6]])
    assert (seq.length, list(seq.pages), rt.pool.num_free) == before and seq.pending == 0
    with expect_clear_error(ValueError, "pending"):
        rt.accept([seq], [1])
    out = rt.forward([seq], [[4, 5, 6]], logits="all")
    assert rel_err(out.logits[-1], _hf(model, PROMPTS[1] + [4, 5, 6]).logits[0, -1]) < 1e-5
    rt.free([seq])
    score.fault_points += 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_decodes_as_one_shot(backend: str) -> None:
    """Ragged prompts (1, 9 and 23 tokens) prefilled in chunks of 5 rows in all, then
    decoded greedily, give the same tokens as one-shot prefill (one chunk holds them all) and
    the same last-row logits within 1e-5 (fp32)."""
    model = make_target("qwen3")
    prompts = PROMPTS
    out = {}
    for chunk in (5, 512):
        rt = TargetRuntime(model, num_pages=60, page_size=4, backend=backend, prefill_chunk=chunk)
        seqs = [rt.new_sequence(len(p) + 8) for p in prompts]
        last = rt.prefill(seqs, prompts)
        rt.free(seqs)
        out[chunk] = (last, blockdraft.decode(rt, prompts, max_new_tokens=4).tokens)
        assert rt.pool.num_free == rt.pool.num_pages
    assert rel_err(out[5][0], out[512][0]) < 1e-5
    assert out[5][1] == out[512][1]


@pytest.mark.parametrize("chunk", [5, 512])
def test_equal_prompts_share_one_prefill(chunk: int) -> None:
    """A prompt given three times (beside another) runs through the model once: the copies
    get its K/V and ctx rows chunk by chunk (bit for bit), then decode in their own pages as
    the first does; the prompt's logits are those of a prefill of it alone."""
    model = make_target("qwen3")
    a, b = PROMPTS[2], PROMPTS[1]
    prompts = [a, b, a, a]
    rt = TargetRuntime(model, num_pages=80, page_size=4, prefill_chunk=chunk, capture_layers=(0, 1))
    rows_run: list[int] = []
    forward = rt.forward
    rt.forward = lambda seqs, toks, **kw: (rows_run.append(sum(map(len, toks))), forward(seqs, toks, **kw))[1]
    got: dict[int, list[torch.Tensor]] = {}

    def on_chunk(idx: list[int], spans: list[range], rows: torch.Tensor) -> None:
        at = 0
        for i, span in zip(idx, spans):
            got.setdefault(i, []).append(rows[at:at + len(span)].clone())
            at += len(span)

    seqs = [rt.new_sequence(len(p) + 8) for p in prompts]
    last = rt.prefill(seqs, prompts, on_chunk=on_chunk)
    assert sum(rows_run) == len(a) + len(b)  # the copies ran no rows
    assert [s.length for s in seqs] == [len(p) for p in prompts]
    for i in (2, 3):
        assert torch.equal(last[i], last[0])
        assert torch.equal(torch.cat(got[i]), torch.cat(got[0]))
        for pos in range(len(a)):
            src, dst = seqs[0].slot(pos), seqs[i].slot(pos)
            cache = rt.forward_pass.cache
            assert torch.equal(cache.k.flatten(1, 2)[:, dst], cache.k.flatten(1, 2)[:, src])
            assert torch.equal(cache.v.flatten(1, 2)[:, dst], cache.v.flatten(1, 2)[:, src])
    # Each copy decodes on in its own pages as the first does.
    steps = [rt.forward(seqs, [[7]] * 4, logits="last").logits]
    rt.accept(seqs, [1] * 4)
    assert torch.equal(steps[0][2], steps[0][0]) and torch.equal(steps[0][3], steps[0][0])
    rt.free(seqs)
    assert rt.pool.num_free == rt.pool.num_pages
    alone = TargetRuntime(model, num_pages=80, page_size=4, prefill_chunk=chunk)
    seq = alone.new_sequence(len(a) + 8)
    assert rel_err(alone.prefill([seq], [a])[0], last[0]) < 1e-5  # another batch: fp32 rounding
