"""The target runtime on the GPU: Triton kernels end to end against Hugging Face's forward
(bf16 within bf16 tolerance; fp32 token for token)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import blockdraft
from blockdraft import TargetRuntime
from blockdraft import pair as bd_pair

pytestmark = pytest.mark.gpu
GPU = torch.device("cuda")
SHAPE = bd_pair.Shape("gpu-runtime", 6, 512, 8, 2, 64, 1024, 4096, 2, (1, 4), 8, 4095)


def _target(dtype: torch.dtype) -> Any:
    return bd_pair.random_target(SHAPE, GPU, dtype, seed=3)


def _prompts(n: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, SHAPE.vocab - 1, (lengths[i % len(lengths)],), generator=gen).tolist()
            for i in range(n)]


def _hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=GPU)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return list(out[0, len(prompt):].tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_runtime_logits_equal_hf(dtype: torch.dtype) -> None:
    model = _target(dtype)
    prompts = _prompts(3, [1, 700, 2100])
    rt = TargetRuntime(model, num_pages=400, page_size=16, capture_layers=[1, 4], prefill_chunk=512)
    assert rt.backend == "triton"
    seqs = [rt.new_sequence(len(p) + 16) for p in prompts]
    last = rt.prefill(seqs, prompts)
    blocks = [[(13 * k + j) % SHAPE.vocab for j in range(16)] for k in range(3)]
    out = rt.forward(seqs, blocks, logits="all")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    offset = 0
    for k, (p, b) in enumerate(zip(prompts, blocks)):
        with torch.no_grad():
            want = model(torch.tensor([p + b], device=GPU)).logits[0].float()
        scale = want.abs().max()
        assert float((last[k].float() - want[len(p) - 1]).abs().max() / scale) < tol
        got = out.logits[offset : offset + 16].float()
        assert float((got - want[len(p):]).abs().max() / scale) < tol
        offset += 16
    rt.free(seqs)
    assert rt.pool.num_free == rt.pool.num_pages


def test_fp32_decode_and_generate_equal_hf_greedy() -> None:
    model = _target(torch.float32)
    drafter = bd_pair.random_drafter(SHAPE, GPU, torch.float32, seed=4)
    prompts = _prompts(4, [5, 300, 61, 1200])
    want = [_hf_greedy(model, p, 24) for p in prompts]
    assert blockdraft.decode(model, prompts, max_new_tokens=24).tokens == want
    res = blockdraft.generate(model, drafter, prompts, max_new_tokens=24, runtime="blockdraft")
    assert res.tokens == want and res.stats.target_runtime == "blockdraft"


def test_captured_graphs_equal_the_eager_runtime() -> None:
    """Decode and the speculative engine, replayed from CUDA graphs, give the eager runtime's
    tokens (fp32), across batch-size buckets and blocks padded to B rows."""
    model = _target(torch.float32)
    drafter = bd_pair.random_drafter(SHAPE, GPU, torch.float32, seed=4)
    prompts = _prompts(5, [3, 250, 900, 40, 1])
    out = {}
    for mode in ("off", "capture"):
        rt = TargetRuntime(model, num_pages=600, page_size=16, graphs=mode, max_batch=8)  # type: ignore[arg-type]
        out[("decode", mode)] = blockdraft.decode(rt, prompts, max_new_tokens=20).tokens
        if mode == "capture":
            assert rt.graphs is not None and rt.graphs.disabled is None and rt.graphs.replays >= 19
        engine = blockdraft.SpeculativeEngine(model, drafter, graphs=mode, max_seq_len=1024,  # type: ignore[arg-type]
                                              max_active=8, max_batch=8)
        out[("spec", mode)] = engine.generate(prompts, max_new_tokens=21).tokens
        out[("spec1", mode)] = engine.generate(prompts[:1], max_new_tokens=21).tokens
        assert engine.runtime is not None
        graphs = engine.runtime.graphs
        if mode == "capture":
            assert graphs is not None and graphs.disabled is None and graphs.replays > 10
        assert engine.pages_used() == {"target": 0, "drafter": 0}
        engine.close()
    for kind in ("decode", "spec", "spec1"):
        assert out[(kind, "capture")] == out[(kind, "off")], kind


def test_streaming_gemms_equal_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    """``BLOCKDRAFT_SKINNY_GEMM=on`` (bf16): a 16-row verify and 1-row decodes of one sequence,
    replayed from CUDA graphs, run their projections on the streaming kernels; the logits are
    Hugging Face's within bf16 tolerance, as on cuBLAS."""
    import dataclasses

    monkeypatch.setenv("BLOCKDRAFT_SKINNY_GEMM", "on")
    model = _target(torch.bfloat16)
    prompt = _prompts(1, [300])[0]
    rt = TargetRuntime(model, num_pages=100, page_size=16, graphs="capture")
    proj = rt.forward_pass.proj
    assert proj.streaming
    calls = {"linear": 0, "linear_silu_mul": 0}
    ops = proj.ops

    def counting(name: str) -> Any:
        def call(*args: Any) -> torch.Tensor:
            calls[name] += 1
            return getattr(ops, name)(*args)  # type: ignore[no-any-return]
        return call

    proj.ops = dataclasses.replace(ops, **{n: counting(n) for n in calls})
    seq = rt.new_sequence(len(prompt) + 32)
    rt.prefill([seq], [prompt])  # 300 rows: cuBLAS
    block = [(7 * j + 1) % SHAPE.vocab for j in range(16)]
    verify = rt.forward([seq], [block], logits="all").logits.float().clone()
    rt.accept([seq], [16])
    decoded = []
    for t in (5, 9):  # each decoded row is accepted before the next forward
        decoded.append(rt.forward([seq], [[t]], logits="last").logits.float().clone())
        rt.accept([seq], [1])
    assert calls["linear_silu_mul"] > 0 and calls["linear"] > 0
    assert rt.graphs is not None and rt.graphs.disabled is None and rt.graphs.captures > 0
    with torch.no_grad():
        want = model(torch.tensor([prompt + block + [5, 9]], device=GPU)).logits[0].float()
    scale = want.abs().max()
    assert float((verify - want[len(prompt):len(prompt) + 16]).abs().max() / scale) < 2e-2
    for i, got in enumerate(decoded):
        assert float((got[0] - want[len(prompt) + 16 + i]).abs().max() / scale) < 2e-2
