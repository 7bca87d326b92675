"""``blockdraft serve``'s access control and limits, and the server at a model's limits.

One in-process server on loopback (the built-in pair on the CPU in fp32, its drafter under a
config whose ``max_position_embeddings`` is 64) with an API key and a 64 KiB body limit:
every route but ``/health`` needs the key (401 in OpenAI's shape otherwise), a body past the
limit is a 413 before it is parsed (with a ``Content-Length`` or chunked), error answers
carry no traceback or file path, a request past the drafter's positions is answered by the
target alone with the same text, and a prefill that runs out of device memory is a 503 for
that request while the others finish. :class:`~blockdraft.serve.access.AccessGuard` alone,
the loopback warning and the access flags are checked without a model. Every page is back
after every test.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

import blockdraft.faults
from blockdraft.cli import main
from blockdraft.serve import ServeConfig, build_engine, create_app
from blockdraft.serve.access import AccessGuard
from blockdraft.serve.server import is_loopback, serve

from support.scorecard import score
from support.serve_support import (
    MODEL,
    LiveServer,
    Pair,
    counter,
    refused_total,
    requests_total,
    sse_events,
)
from support.tls import self_signed

KEY = "sk-test-5f1c9a0e7b"
LIMIT = 64 * 1024
DRAFTER_POSITIONS = 64
PROMPT = "def fibonacci(n):"
N = 100  # past the drafter's positions: its last ~50 tokens come from the target alone


@pytest.fixture(scope="module")
def solo(pair: Pair) -> str:
    """The target's own greedy text for PROMPT (target-only decoding; computed before the
    server runs, so no two threads drive the model at once)."""
    ids = torch.tensor([pair.tokenizer.encode(PROMPT)])
    out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                               eos_token_id=pair.eos, pad_token_id=pair.eos)[0, ids.shape[1]:]
    return str(pair.tokenizer.decode(out.tolist(), skip_special_tokens=True))


@pytest.fixture(scope="module")
def server(pair: Pair, solo: str) -> Iterator[LiveServer]:
    short = copy.copy(pair.drafter)  # the same weights under a shorter config
    short.config = dataclasses.replace(pair.drafter.config, max_position_embeddings=DRAFTER_POSITIONS)
    engine = build_engine(pair.target, short, max_seq_len=512, max_active=4)
    config = ServeConfig(MODEL, builtin_chat=True, api_key=KEY, max_body_bytes=LIMIT)
    assert KEY not in repr(config)
    srv = LiveServer(create_app(engine, pair.tokenizer, config), api_key=KEY).start()
    try:
        yield srv
    finally:
        srv.stop()
    assert srv.loop.final is not None and srv.loop.final.all_back, srv.loop.final


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}


AUTH = {"Authorization": f"Bearer {KEY}"}
WRONG = [
    {},
    {"Authorization": "Bearer sk-wrong"},
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": "Bearer"},
    {"Authorization": KEY},
]


def test_every_route_but_health_needs_the_key(server: LiveServer) -> None:
    before = server.metrics()
    routes = [("POST", "/v1/completions", _completion()),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
              ("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/v1/nothing", None)]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for method, path, body in routes:
            for headers in WRONG:
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                err = r.json()["error"]
                assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "invalid_api_key")
                assert err["message"] and KEY not in r.text
                score.bad_inputs += 1
                score.clear_errors += 1
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        r = client.post("/v1/completions", json=_completion(), headers=AUTH)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    after = server.metrics()
    # The refused requests reached no route: counted as refused only, nothing generated but
    # the one.
    assert refused_total(after, "unauthorized") - refused_total(before, "unauthorized") == len(routes) * len(WRONG)
    assert refused_total(after, "too_large") == refused_total(before, "too_large")
    assert requests_total(after, "length") - requests_total(before, "length") == 1
    assert requests_total(after, "invalid") == requests_total(before, "invalid")
    assert (counter(after, "blockdraft_generated_tokens_total")
            - counter(before, "blockdraft_generated_tokens_total")) == 8


def test_the_openai_client_with_and_without_the_key(server: LiveServer) -> None:
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-nope", max_retries=0).models.list()
    got = server.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert got.usage is not None and got.usage.completion_tokens == 4


def _padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` as JSON followed by spaces up to ``size`` bytes (still valid JSON)."""
    raw = httpx.Request("POST", "/", json=body).content
    return raw + b" " * (size - len(raw))


def _chunks(data: bytes, size: int = 8192) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_a_body_past_the_limit_is_a_413_before_parsing(server: LiveServer) -> None:
    before = server.metrics()
    url = f"{server.url}/v1/completions"
    with httpx.Client(timeout=30, headers=AUTH) as client:
        # Not even JSON: were it parsed first, this would be a 400.
        for r in (client.post(url, content=b"{" + b" " * LIMIT),
                  client.post(url, content=_chunks(b"[" * (LIMIT + 10_000)))):
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("invalid_request_error", "request_too_large")
            assert str(LIMIT) in err["message"]
            score.bad_inputs += 1
            score.clear_errors += 1
        chunked = client.build_request("POST", url, content=_chunks(b"[" * (LIMIT + 1)))
        assert "content-length" not in chunked.headers and chunked.headers["transfer-encoding"] == "chunked"
        assert client.send(chunked).status_code == 413
        # At the limit exactly, either way, the body is read whole and answered.
        exact = _padded(_completion(max_tokens=4), LIMIT)
        assert len(exact) == LIMIT
        for content in (exact, _chunks(exact)):
            r = client.post(url, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # Without the key the size is never looked at.
        assert httpx.post(url, content=b" " * (LIMIT + 1), timeout=30).status_code == 401
    after = server.metrics()
    assert requests_total(after, "invalid") == requests_total(before, "invalid")
    assert requests_total(after, "length") - requests_total(before, "length") == 2
    assert refused_total(after, "too_large") - refused_total(before, "too_large") == 3
    assert refused_total(after, "unauthorized") - refused_total(before, "unauthorized") == 1


def test_error_answers_carry_no_traceback_or_path(server: LiveServer, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A route that raises: a 500 naming the error's type only (the log has the rest). A
    generation failure whose message holds a path and a traceback: its first line, the path
    masked."""
    service = server.app.state.service
    secret = f"{Path(__file__).resolve()}"

    async def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError(f"boom in {secret}")

    monkeypatch.setattr(service, "handle", broken)
    with caplog.at_level(logging.ERROR, logger="blockdraft.serve.app"):
        r = httpx.post(f"{server.url}/v1/completions", json=_completion(), headers=AUTH, timeout=30)
    assert r.status_code == 500
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("server_error", "internal_error")
    assert "RuntimeError" in err["message"] and "boom" not in r.text and secret not in r.text
    assert "boom" in caplog.text  # the log keeps it
    monkeypatch.undo()

    target = server.engine.target

    def failing(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("kernel launch failed at /opt/lib/python3/site-packages/k/attn.py:41\n"
                           "Traceback (most recent call last):\n  File \"/opt/lib/x.py\", line 3")

    monkeypatch.setattr(target, "verify", failing)
    r = httpx.post(f"{server.url}/v1/completions", json=_completion(), headers=AUTH, timeout=60)
    monkeypatch.undo()
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "kernel launch failed at <path>:41" in message
    for leak in ("/opt/", "Traceback", "File ", "line 3"):
        assert leak not in r.text, leak


def test_past_the_drafters_positions_the_target_answers_alone(server: LiveServer, solo: str) -> None:
    prompt_tokens = len(server.app.state.service.tokenizer.encode(PROMPT))
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                   json=_completion(max_tokens=N, return_meta_info=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == solo and body["choices"][0]["finish_reason"] == "length"
    # Every token after the first anchor whose block would pass the drafter's 64 positions
    # (at the latest 64) took a verify step of its own; drafting all the way, at ~4 tokens a
    # step, far fewer steps would do.
    alone = prompt_tokens + N - 1 - DRAFTER_POSITIONS
    assert body["meta_info"]["spec_verify_ct"] >= alone
    assert body["meta_info"]["spec_verify_ct"] < N - 1  # drafts were accepted before


def test_out_of_memory_in_a_prefill_is_a_503_and_the_others_go_on(server: LiveServer, solo: str) -> None:
    before = server.metrics()
    with httpx.Client(base_url=server.url, timeout=120, headers=AUTH) as client:
        with client.stream("POST", "/v1/completions", json=_completion(max_tokens=N, stream=True)) as running:
            events = sse_events(running)
            first = next(events)
            assert isinstance(first, dict)
            with blockdraft.faults.inject("prefill", 1) as plan:
                r = client.post("/v1/completions", json=_completion())
            assert plan.fired and r.status_code == 503
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("server_error", "out_of_memory")
            assert "out of device memory" in err["message"] and "retry" in err["message"]
            with blockdraft.faults.inject("prefill", 1) as plan:
                with client.stream("POST", "/v1/completions", json=_completion(stream=True)) as failing:
                    assert failing.status_code == 200  # taken before its prefill
                    got = list(sse_events(failing))
            assert plan.fired and got[-1] == "[DONE]"
            assert got[-2]["error"]["code"] == "out_of_memory"  # type: ignore[index]
            text = first["choices"][0]["text"] + "".join(
                e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
    assert text == solo
    score.fault_points += 2
    server.wait_idle()
    after = server.metrics()
    assert requests_total(after, "unavailable") - requests_total(before, "unavailable") == 2
    assert requests_total(after, "length") - requests_total(before, "length") == 1


async def _echo(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app that answers with the body it read."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def test_the_guard_alone() -> None:
    """Open paths, the key, the body limit by Content-Length and while a stream arrives; a
    body within the limit reaches the app whole."""

    async def scenario() -> None:
        guard = AccessGuard(_echo, api_key=KEY, max_body_bytes=100, open_paths=("/health", "/metrics"),
                            on_refused=refused.append)
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/metrics")).status_code == 200
            assert (await client.post("/health", content=b"x" * 10)).content == b"x" * 10
            assert (await client.post("/v1/x", content=b"x")).status_code == 401
            ok = await client.post("/v1/x", content=b"y" * 100, headers=AUTH)
            assert ok.status_code == 200 and ok.content == b"y" * 100

            async def stream(n: int) -> AsyncIterator[bytes]:
                for _ in range(n):
                    yield b"z" * 30

            assert (await client.post("/v1/x", content=stream(3), headers=AUTH)).content == b"z" * 90
            assert (await client.post("/v1/x", content=stream(4), headers=AUTH)).status_code == 413
            assert (await client.post("/health", content=b"x" * 101)).status_code == 413

    refused: list[str] = []
    asyncio.run(scenario())
    assert refused == ["unauthorized", "too_large", "too_large"]
    with pytest.raises(ValueError, match="api_key"):
        AccessGuard(_echo, api_key="", max_body_bytes=1)
    with pytest.raises(ValueError, match="max_body_bytes"):
        ServeConfig(MODEL, max_body_bytes=0)


def test_listening_beyond_loopback_without_a_key_is_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
    import blockdraft.serve.server as server_module

    monkeypatch.setattr(server_module._Server, "run", lambda self, sockets=None: None)  # never listens
    for host, key, warned in [("0.0.0.0", None, True), ("0.0.0.0", KEY, False), ("127.0.0.1", None, False),
                              ("localhost", None, False)]:
        caplog.clear()
        app = SimpleNamespace(state=SimpleNamespace(config=ServeConfig(MODEL, api_key=key),
                                                    loop=SimpleNamespace(drain=lambda s: None)))
        with caplog.at_level(logging.WARNING, logger="blockdraft.serve.server"):
            assert serve(app, host=host, port=1) is False
        assert ("not a loopback address, without an API key" in caplog.text) == warned, (host, key)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A key and its certificate, and another key."""
    key, cert = self_signed(tmp_path_factory.mktemp("tls"))
    other, _ = self_signed(tmp_path_factory.mktemp("other"))
    return key, cert, other


def test_access_flags_are_one_line(certs: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    key, cert, other = certs
    cases = [
        (["--ssl-keyfile", str(key)], "give both --ssl-keyfile and --ssl-certfile"),
        (["--ssl-keyfile", "/nonexistent.pem", "--ssl-certfile", str(cert)],
         "--ssl-keyfile /nonexistent.pem: no such file"),
        (["--ssl-keyfile", str(other), "--ssl-certfile", str(cert)], "cannot load them as a certificate and its key"),
        (["--api-key", ""], "--api-key must not be empty"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
    ]
    for flags, words in cases:
        assert main(["serve", "--device", "cpu", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("blockdraft: error: ") and words in err[0], (flags, err)
