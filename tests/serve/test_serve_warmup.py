"""Readiness: a server that warms up answers /health 503 "warming up" until its warm-up ends,
then 200; requests that arrive meanwhile are answered after it."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from blockdraft.cli.app import build_parser
from blockdraft.serve import ServeConfig, build_engine, create_app

from support.serve_support import MODEL, LiveServer, Pair, counter, wait_until


def test_health_is_not_ready_until_warmup_ends(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build_engine(pair.target, pair.drafter, max_seq_len=256, max_active=2)
    started, release = threading.Event(), threading.Event()
    real = engine.warmup

    def blocked_warmup(**kw: Any) -> Any:
        started.set()
        assert release.wait(60), "the test never released the warm-up"
        return real(max_prompt=4, **kw)

    monkeypatch.setattr(engine, "warmup", blocked_warmup)
    app = create_app(engine, pair.tokenizer, ServeConfig(MODEL, builtin_chat=True, warmup=True))
    server = LiveServer(app).start()
    try:
        assert started.wait(60)
        r = httpx.get(f"{server.url}/health", timeout=10)
        assert r.status_code == 503 and r.json() == {"status": "warming up"}
        release.set()
        wait_until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 200,
                   "/health 200 after the warm-up")
        assert engine.is_warm
        done = server.openai().completions.create(model=MODEL, prompt="def f(x):", max_tokens=4)
        assert done.choices[0].text
        m = server.metrics()
        assert counter(m, "blockdraft_compiles_after_warmup_total") == 0
        assert counter(m, "blockdraft_graph_captures_after_warmup_total") == 0
        assert counter(m, "blockdraft_warmup_seconds") > 0
    finally:
        release.set()
        server.stop()
    final = server.loop.final
    assert final is not None and final.all_back, final


def test_no_warmup_is_accepted_by_serve_and_generate() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).no_warmup is False
    assert parser.parse_args(["serve", "--no-warmup"]).no_warmup is True
    assert parser.parse_args(["generate", "--no-warmup"]).no_warmup is True
    assert parser.parse_args(["generate"]).no_warmup is False
