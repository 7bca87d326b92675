"""Serving with speculation off (``blockdraft serve --no-speculation``; ``build_engine(...,
speculate=False)``): greedy text equals the speculative pair's (``blockdraft.generate``),
streamed or not; the metrics say speculation is off and count one token per step; every page
comes back. The command itself, flag to metrics, runs in ``tests/bench/test_bench_serve.py``."""

from __future__ import annotations

import httpx
import pytest

from blockdraft.cli.app import build_parser

from support.serve_support import MODEL, builtin_pair, counter, live_server, sse_chunks

PROMPT = "def fibonacci(n):"
N = 24


def test_help_lists_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "--no-speculation" in capsys.readouterr().out
    assert parser.parse_args(["serve", "--no-speculation"]).no_speculation is True
    assert parser.parse_args(["serve"]).no_speculation is False


def test_served_text_equals_speculative_generation() -> None:
    pair = builtin_pair()
    want = pair.solo_text(PROMPT, N)
    with live_server(pair, max_active=4, speculate=False) as server:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                "return_meta_info": True}
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == want and got["choices"][0]["finish_reason"] == "length"
        assert got["usage"]["completion_tokens"] == N
        # The first token comes from the prefill, each later one from its own target step.
        assert got["meta_info"]["spec_accept_length"] == 1.0
        assert got["meta_info"]["spec_verify_ct"] == N - 1
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            chunks = list(sse_chunks(r))
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
        server.wait_idle()
        m = server.metrics()
        assert counter(m, "blockdraft_speculation") == 0
        assert counter(m, "blockdraft_spec_accepted_tokens_total") == 0
        assert counter(m, "blockdraft_spec_steps_total") == 2 * (N - 1)
        assert counter(m, "blockdraft_generated_tokens_total") == 2 * N
        assert m[("blockdraft_pool_pages_total", (("pool", "target"),))] > 0
    with live_server(pair, max_active=4) as spec:
        assert counter(spec.metrics(), "blockdraft_speculation") == 1
