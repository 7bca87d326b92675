"""``blockdraft serve`` under bad input and faults: OpenAI-style errors with nothing admitted,
a client leaving mid-stream or mid-wait, a full queue (429), a request failing inside a step
(alone, or a whole step failing), and a model without a chat template. Loopback only, the
built-in pair on the CPU in fp32; every page back after every test."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import blockdraft.faults

from support.scorecard import score
from support.serve_support import (
    MODEL,
    LiveServer,
    Pair,
    counter,
    live_server,
    requests_total,
    sse_chunks,
    sse_chunks_async,
    wait_until,
)

PROMPT = "def fibonacci(n):"
SERVER_KW = {"max_seq_len": 1024}


def _completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, **fields}


LONG = [5] * 1024  # as many token ids as the server's whole context

# (name, endpoint, body: dict or raw bytes, status, param, code)
BAD = [
    ("malformed JSON", "completions", b'{"prompt": "x",', 400, None, "invalid_json"),
    ("not an object", "completions", b'["x"]', 400, None, "invalid_json"),
    ("not UTF-8", "completions", b'{"prompt": "\xff"}', 400, None, "invalid_json"),
    ("missing prompt", "completions", {"model": MODEL, "max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    ("missing messages", "chat/completions", {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("empty messages", "chat/completions", _chat(messages=[]), 400, "messages", "invalid_value"),
    ("no user message", "chat/completions", _chat(messages=[{"role": "system", "content": "hi"}]),
     400, "messages", "invalid_value"),
    ("unknown role", "chat/completions", _chat(messages=[{"role": "robot", "content": "hi"}]),
     400, "messages[0].role", "invalid_value"),
    ("image part", "chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, "messages[0].content[0]", "unsupported"),
    ("max_tokens 0", "completions", _completion(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("max_tokens -3", "chat/completions", _chat(max_tokens=-3), 400, "max_tokens", "invalid_value"),
    ("max_tokens past the positions", "completions", _completion(max_tokens=5000),
     400, "max_tokens", "context_length_exceeded"),
    ("prompt past the positions", "completions", _completion(prompt=LONG), 400, "prompt", "context_length_exceeded"),
    ("chat prompt past the positions", "chat/completions",
     _chat(messages=[{"role": "user", "content": "x = 1\n" * 1500}]), 400, "messages", "context_length_exceeded"),
    ("empty prompt", "completions", _completion(prompt=""), 400, "prompt", "invalid_value"),
    ("token id past the vocabulary", "completions", _completion(prompt=[1, 2, 10**6]), 400, "prompt", "invalid_value"),
    ("negative token id", "completions", _completion(prompt=[1, -2]), 400, "prompt", "invalid_value"),
    ("unknown model", "completions", _completion(model="gpt-4"), 404, "model", "model_not_found"),
    ("unknown model, chat", "chat/completions", _chat(model="nope"), 404, "model", "model_not_found"),
    ("prompt a number", "completions", _completion(prompt=5), 400, "prompt", "invalid_value"),
    ("prompt mixed list", "completions", _completion(prompt=["a", 1]), 400, "prompt", "invalid_value"),
    ("too many prompts", "completions", _completion(prompt=["a"] * 65), 400, "prompt", "invalid_value"),
    ("max_tokens a string", "completions", _completion(max_tokens="8"), 400, "max_tokens", "invalid_type"),
    ("max_tokens a float", "completions", _completion(max_tokens=8.5), 400, "max_tokens", "invalid_type"),
    ("temperature a string", "completions", _completion(temperature="hot"), 400, "temperature", "invalid_type"),
    ("temperature negative", "completions", _completion(temperature=-0.5), 400, "temperature", "invalid_value"),
    ("temperature negative, chat", "chat/completions", _chat(temperature=-1), 400, "temperature", "invalid_value"),
    ("top_p 0", "completions", _completion(top_p=0), 400, "top_p", "invalid_value"),
    ("top_p above 1", "completions", _completion(top_p=1.5), 400, "top_p", "invalid_value"),
    ("top_k negative", "completions", _completion(top_k=-5), 400, "top_k", "invalid_value"),
    ("stream a string", "completions", _completion(stream="yes"), 400, "stream", "invalid_type"),
    ("stop a number", "completions", _completion(stop=7), 400, "stop", "invalid_type"),
    ("stop empty", "completions", _completion(stop=[""]), 400, "stop", "invalid_value"),
    ("seed a float", "completions", _completion(seed=1.5), 400, "seed", "invalid_type"),
    ("messages a string", "chat/completions", _chat(messages="hi"), 400, "messages", "invalid_type"),
    ("message content a number", "chat/completions", _chat(messages=[{"role": "user", "content": 3}]),
     400, "messages[0].content", "invalid_type"),
    ("model a number", "completions", _completion(model=3), 400, "model", "invalid_type"),
    ("return_meta_info a string", "completions", _completion(return_meta_info="yes"),
     400, "return_meta_info", "invalid_type"),
    ("stream_options a list", "completions", _completion(stream=True, stream_options=[]),
     400, "stream_options", "invalid_type"),
    ("n 17", "completions", _completion(n=17), 400, "n", "invalid_value"),
    ("best_of above n", "completions", _completion(best_of=2), 400, "best_of", "unsupported"),
    ("top_logprobs 21", "chat/completions", _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "invalid_value"),
    ("logit_bias", "chat/completions", _chat(logit_bias={"5": 1}), 400, "logit_bias", "unsupported"),
    ("echo", "completions", _completion(echo=True), 400, "echo", "unsupported"),
]


def test_bad_inputs_are_openai_errors_and_admit_nothing(server: LiveServer) -> None:
    before = server.metrics()
    for name, endpoint, body, status, param, code in BAD:
        forms = ([body] if isinstance(body, bytes)
                 else [json.dumps(body).encode(), json.dumps({"stream": True, **body}).encode()])
        for content in forms:
            score.bad_inputs += 1
            r = httpx.post(f"{server.url}/v1/{endpoint}", content=content,
                           headers={"Content-Type": "application/json"}, timeout=30)
            assert r.status_code == status, (name, r.text)
            assert r.headers["content-type"].startswith("application/json"), name
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], name
            assert (err["param"], err["code"]) == (param, code), (name, err)
            score.clear_errors += 1
    after = server.metrics()
    refused = sum(2 if not isinstance(b[2], bytes) else 1 for b in BAD)
    assert requests_total(after, "invalid") - requests_total(before, "invalid") == refused
    for name in ("blockdraft_generated_tokens_total", "blockdraft_spec_steps_total"):
        assert counter(after, name) == counter(before, name), name
    assert server.idle()
    # The server still answers, and the unknown fields of a body are ignored.
    ok = httpx.post(f"{server.url}/v1/completions", json=_completion(frobnicate={"x": 1}, user="u"),
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


def test_unknown_route_and_method_are_json_errors(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_openai_client_sees_the_errors(server: LiveServer) -> None:
    import openai

    client = server.openai()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1)


def test_disconnect_mid_stream_cancels_and_returns_pages(server: LiveServer) -> None:
    before = server.metrics()
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}/v1/completions",
                           json=_completion(max_tokens=900, stream=True)) as r:
            assert r.status_code == 200
            texts = []
            chunks = sse_chunks(r)
            for chunk in chunks:
                texts.append(chunk["choices"][0]["text"])
                if len(texts) == 3:
                    break
            assert server.pages_used()["target"] > 0  # it holds pages while it runs
            chunks.close()
    # The connection is closed: the server cancels the request and every page comes back.
    server.wait_idle()
    after = server.metrics()
    assert requests_total(after, "cancelled") - requests_total(before, "cancelled") == 1
    generated = (counter(after, "blockdraft_generated_tokens_total")
                 - counter(before, "blockdraft_generated_tokens_total"))
    assert 3 <= generated < 900


def test_disconnect_of_a_plain_request_cancels_it(server: LiveServer) -> None:
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=_completion(max_tokens=900), timeout=1.0)
    server.wait_idle()
    after = server.metrics()
    assert requests_total(after, "cancelled") - requests_total(before, "cancelled") == 1
    assert (counter(after, "blockdraft_generated_tokens_total")
            - counter(before, "blockdraft_generated_tokens_total")) < 900


def test_overload_queues_then_429_and_drops_nothing(pair: Pair) -> None:
    """Two run, two wait, the fifth is refused with 429 + Retry-After; a waiting client that
    leaves gives up its place; when the long ones end, the waiting ones run to the end."""
    want = pair.solo_text(PROMPT, 12)
    with live_server(pair, max_seq_len=1024, max_active=2, max_queue=2) as srv:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120,
                                         limits=httpx.Limits(max_connections=16)) as client:
                async def first_chunk(body: dict[str, Any]) -> tuple[Any, Any]:
                    cm = client.stream("POST", "/v1/completions", json=body)
                    r = await cm.__aenter__()
                    assert r.status_code == 200
                    return cm, r

                long = [await first_chunk(_completion(max_tokens=1000, stream=True)) for _ in range(2)]
                # Both running: each has sent a token. (The line iterators stay referenced: a
                # collected one closes its connection, which the server takes as a leaving client.)
                readers = [r.aiter_lines() for _, r in long]
                for lines in readers:
                    while not (await lines.__anext__()).startswith("data: {"):
                        pass
                queued = [await first_chunk(_completion(max_tokens=12, stream=True)) for _ in range(2)]
                wait_until(lambda: _gauges(srv) == (2, 2), "two running and two waiting")
                refused = await client.post("/v1/completions", json=_completion(max_tokens=12))
                assert refused.status_code == 429
                assert int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["type"] == "rate_limit_error"
                refused = await client.post("/v1/chat/completions", json=_chat(stream=True))
                assert refused.status_code == 429
                # A waiting client leaves: its place frees, so one more may wait.
                cm, _ = queued.pop()
                await cm.__aexit__(None, None, None)
                wait_until(lambda: _gauges(srv) == (2, 1), "the leaver's place to free")
                late = await first_chunk(_completion(max_tokens=12, stream=True))
                queued.append(late)
                for cm, _ in long:
                    await cm.__aexit__(None, None, None)
                for cm, r in queued:
                    text = "".join([c["choices"][0]["text"] async for c in sse_chunks_async(r)])
                    assert text == want
                    await cm.__aexit__(None, None, None)

        before = srv.metrics()
        asyncio.run(scenario())
        srv.wait_idle()
        after = srv.metrics()
        assert requests_total(after, "rejected") - requests_total(before, "rejected") == 2
        assert requests_total(after, "length") - requests_total(before, "length") == 2
        assert requests_total(after, "cancelled") - requests_total(before, "cancelled") == 3


def _gauges(srv: LiveServer) -> tuple[float, float]:
    m = srv.metrics()
    return m[("blockdraft_requests_running", ())], m[("blockdraft_requests_waiting", ())]


def _open_running_stream(
    client: httpx.Client, server: LiveServer, max_tokens: int
) -> tuple[Any, Iterator[dict[str, Any]]]:
    cm = client.stream("POST", f"{server.url}/v1/completions", json=_completion(max_tokens=max_tokens, stream=True))
    r = cm.__enter__()
    assert r.status_code == 200
    chunks = sse_chunks(r)
    first = next(chunks)
    assert first["choices"][0]["finish_reason"] is None
    return cm, _prepend(first, chunks)


def _prepend(first: dict[str, Any], rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield first
    yield from rest


def test_one_request_failing_leaves_the_others_running(server: LiveServer, pair: Pair) -> None:
    """A fault at one request's admission (its target pages): that request is a 500 naming
    the failure, the running one goes on to its solo output, the pools stay consistent."""
    want = pair.solo_text(PROMPT, 120)
    before = server.metrics()
    with httpx.Client(timeout=120) as client:
        cm, chunks = _open_running_stream(client, server, 120)
        with blockdraft.faults.inject("target_pages", 1) as plan:
            r = client.post(f"{server.url}/v1/completions", json=_completion(max_tokens=8))
        assert plan.fired
        score.fault_points += 1
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "fault injection" in err["message"]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        cm.__exit__(None, None, None)
    assert text == want
    server.wait_idle()
    after = server.metrics()
    assert requests_total(after, "error") - requests_total(before, "error") == 1
    assert requests_total(after, "length") - requests_total(before, "length") == 1


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(server: LiveServer, pair: Pair) -> None:
    """The target's verify raises once (a shared failure): every request of that step gets an
    error (500, or an error event on a stream); the next request runs normally."""
    target = server.engine.target
    real = target.verify
    calls = {"n": 0}

    def verify_once_broken(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated verify failure")
        return real(*args, **kw)

    before = server.metrics()
    with httpx.Client(timeout=120) as client:
        cm, chunks = _open_running_stream(client, server, 300)
        target.verify = verify_once_broken
        try:
            events = list(chunks)
        finally:
            cm.__exit__(None, None, None)
            del target.verify
    assert calls["n"] == 1
    assert "error" in events[-1] and "simulated verify failure" in events[-1]["error"]["message"]
    assert events[-1]["error"]["type"] == "server_error"
    server.wait_idle()
    got = server.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert got.choices[0].text == pair.solo_text(PROMPT, 16)
    after = server.metrics()
    assert requests_total(after, "error") - requests_total(before, "error") == 1
    assert server.loop.alive


def test_a_failing_step_answers_a_plain_request_with_500(server: LiveServer) -> None:
    target = server.engine.target
    real = target.verify

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("simulated verify failure")

    target.verify = broken
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(max_tokens=8), timeout=60)
    finally:
        del target.verify
    assert target.verify == real
    assert r.status_code == 500
    assert "simulated verify failure" in r.json()["error"]["message"]


def test_chat_without_a_template_is_a_400(pair: Pair) -> None:
    """A model whose tokenizer has no chat template (and is not the built-in one) cannot chat."""
    with live_server(pair, max_seq_len=256, max_active=2, builtin_chat=False) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=_chat(), timeout=30)
        assert r.status_code == 400
        err = r.json()["error"]
        assert "chat template" in err["message"] and err["code"] == "no_chat_template"
        assert httpx.post(f"{srv.url}/v1/completions", json=_completion(), timeout=60).status_code == 200
        srv.wait_idle()
