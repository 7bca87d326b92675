"""The target runtime with ``BLOCKDRAFT_SKINNY_GEMM`` on: forwards of at most 16 rows run their
projections on the weight-streaming kernels (fp32 here, under Triton's CPU interpreter) and give
the target's own greedy tokens, as with the lever off; larger forwards keep ``F.linear``."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from blockdraft import ConfigError, TargetRuntime
from blockdraft.kernels import SKINNY_MAX_ROWS
from blockdraft.levers import ENV_SKINNY_GEMM, read_skinny_gemm

from support.kernel_support import need_triton
from support.runtime_models import VOCAB, hf_greedy, make_target

PROMPTS = [[5, 9, 11, 2, 60, 7, 7, 1, 40], [3], [(7 * i + 3) % VOCAB for i in range(23)]]
WIDE = [(3 * j) % VOCAB for j in range(20)]


def _counting(ops: Any, calls: Counter[str]) -> Any:
    def wrap(name: str) -> Callable[..., torch.Tensor]:
        fn = getattr(ops, name)

        def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
            assert x.shape[0] <= SKINNY_MAX_ROWS
            calls[name] += 1
            return fn(x, *args)  # type: ignore[no-any-return]

        return counted

    return dataclasses.replace(ops, **{n: wrap(n) for n in ("linear", "linear_silu_mul")})


def _greedy(model: Any, steps: int, calls: Counter[str]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of every prompt on the runtime (prefill in chunks of 7 rows, then decodes
    of 3 rows), and the logits of one 20-row verify after them (more rows than the kernels
    take: no kernel call)."""
    rt = TargetRuntime(model, num_pages=60, page_size=4, backend="triton", prefill_chunk=7)
    proj = rt.forward_pass.proj
    proj.ops = _counting(proj.ops, calls)
    seqs = [rt.new_sequence(len(p) + steps + 24) for p in PROMPTS]
    last = rt.prefill(seqs, PROMPTS)
    tokens = [[int(torch.argmax(row))] for row in last]
    for _ in range(steps - 1):
        out = rt.forward(seqs, [[t[-1]] for t in tokens], logits="last")
        rt.accept(seqs, [1] * len(seqs))
        for t, row in zip(tokens, out.logits):
            t.append(int(torch.argmax(row)))
    before = sum(calls.values())
    wide = rt.forward(seqs[:1], [WIDE], logits="all").logits.clone()
    assert sum(calls.values()) == before
    return tokens, wide


@pytest.mark.parametrize("name", ["llama-mqa-bias", "qwen3-odd"])
def test_streaming_gemms_keep_the_greedy_tokens(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target's own greedy continuations (Hugging Face's ``generate``), and the logits of a
    later forward on the K/V the streamed forwards wrote within 1e-5 of Hugging Face's."""
    need_triton(torch.device("cpu"))
    monkeypatch.setenv(ENV_SKINNY_GEMM, "on")
    model = make_target(name)
    steps = 5
    calls: Counter[str] = Counter()
    tokens, wide = _greedy(model, steps, calls)
    assert tokens == [hf_greedy(model, p, steps) for p in PROMPTS]
    # q/k/v, o, down and the head on the streaming linear, gate/up fused with SwiGLU
    layers = model.config.num_hidden_layers
    assert calls["linear_silu_mul"] > 0 and calls["linear_silu_mul"] % layers == 0
    assert calls["linear"] > 3 * calls["linear_silu_mul"]
    seq = PROMPTS[0] + tokens[0][: steps - 1]
    with torch.no_grad():
        want = model(torch.tensor([seq + WIDE])).logits[0, len(seq):]
    assert float((wide - want).abs().max() / want.abs().max()) < 1e-5


def test_lever_values() -> None:
    assert read_skinny_gemm({}) is None  # unset: the runtime decides
    assert read_skinny_gemm({ENV_SKINNY_GEMM: " "}) is None
    assert read_skinny_gemm({ENV_SKINNY_GEMM: "on"}) is True
    assert read_skinny_gemm({ENV_SKINNY_GEMM: " OFF "}) is False
    with pytest.raises(ConfigError, match=ENV_SKINNY_GEMM):
        read_skinny_gemm({ENV_SKINNY_GEMM: "fast"})


def test_unset_streams_unless_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the lever is on where Triton compiles (CUDA) and off under the CPU interpreter;
    set, it is what it says either way."""
    need_triton(torch.device("cpu"))
    from blockdraft.kernels import projections

    monkeypatch.delenv(ENV_SKINNY_GEMM, raising=False)
    ops = TargetRuntime(make_target("qwen3"), num_pages=8, page_size=4, backend="triton").forward_pass.ops
    for interpreted, setting, want in [(True, None, False), (False, None, True), (True, True, True),
                                       (False, False, False)]:
        monkeypatch.setattr(projections, "interpreting", lambda v=interpreted: v)
        assert projections.Projections(ops, setting).streaming is want, (interpreted, setting)


def test_the_torch_backend_never_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SKINNY_GEMM, "on")
    rt = TargetRuntime(make_target("qwen3"), num_pages=8, page_size=4, backend="torch")
    assert not rt.forward_pass.proj.streaming


def test_streaming_gemms_under_tensor_parallelism() -> None:
    """Two ranks (gloo): q/k/v and gate/up on their rows, o and down on their columns then the
    all-reduce, the head whole; the greedy tokens are the target's own."""
    need_triton(torch.device("cpu"))
    from blockdraft.parallel import launch

    from support.tp_support import PROMPTS as TP_PROMPTS
    from support.tp_support import skinny_gemm_case

    model = make_target("llama-bias-gqa")
    want = [hf_greedy(model, p, 6) for p in TP_PROMPTS]
    for tokens, calls in launch(skinny_gemm_case, 2, ["llama-bias-gqa"], device="cpu",
                                timeout_s=120.0):
        assert tokens == want and calls > 0
