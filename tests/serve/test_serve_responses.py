"""The server's JSON shapes on their own: whole answers, stream chunks and usage
(:mod:`blockdraft.serve.responses`), the SSE framing (:mod:`blockdraft.serve.sse`) and the
OpenAI-style errors (:mod:`blockdraft.serve.errors`)."""

from __future__ import annotations

import json

import pytest

from blockdraft.serve.errors import APIError, invalid, queue_full, server_error, unavailable
from blockdraft.serve.responses import Head, choice, chunk, meta_info, response, usage, usage_chunk
from blockdraft.serve.sse import DONE, event

COMPLETION = Head("completion", "cmpl-1", 7, "m")
CHAT = Head("chat", "chatcmpl-1", 7, "m")
HEAD = {"created": 7, "model": "m"}


def test_heads_are_new_each_time() -> None:
    a, b = Head.new("completion", "m"), Head.new("chat", "m")
    assert a.id.startswith("cmpl-") and b.id.startswith("chatcmpl-")
    assert Head.new("completion", "m").id != a.id and a.model == "m" and a.created > 0


def test_usage_and_meta_info() -> None:
    assert usage(5, 3) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert meta_info([3, 1, 2]) == {"spec_accept_length": 2.0, "spec_verify_ct": 3}
    assert meta_info([]) == {"spec_accept_length": 0.0, "spec_verify_ct": 0}


def test_whole_answers() -> None:
    use = usage(2, 1)
    assert response(COMPLETION, [choice(COMPLETION, "hi", "length")], use, None) == {
        "id": "cmpl-1", "object": "text_completion", **HEAD, "usage": use,
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "text": "hi"}]}
    assert response(CHAT, [choice(CHAT, "hi", "stop")], use, {"spec_verify_ct": 1}) == {
        "id": "chatcmpl-1", "object": "chat.completion", **HEAD, "usage": use,
        "meta_info": {"spec_verify_ct": 1},
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "hi"}}]}
    lps = {"content": [], "refusal": None}
    two = response(CHAT, [choice(CHAT, "a", "stop", index=0), choice(CHAT, "b", "length", index=1, logprobs=lps)],
                   use, None)
    assert [(c["index"], c["message"]["content"], c["finish_reason"], c["logprobs"]) for c in two["choices"]] == [
        (0, "a", "stop", None), (1, "b", "length", lps)]


def test_chat_stream_chunks() -> None:
    def choice(c: dict[str, object]) -> object:
        assert c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1"
        return c["choices"]

    assert choice(chunk(CHAT, None)) == [
        {"index": 0, "logprobs": None, "finish_reason": None, "delta": {"role": "assistant", "content": ""}}]
    assert choice(chunk(CHAT, "ab")) == [
        {"index": 0, "logprobs": None, "finish_reason": None, "delta": {"content": "ab"}}]
    closing = chunk(CHAT, None, "stop", meta={"spec_verify_ct": 2})
    assert choice(closing) == [{"index": 0, "logprobs": None, "finish_reason": "stop", "delta": {}}]
    assert closing["meta_info"] == {"spec_verify_ct": 2} and "usage" not in closing


def test_completion_stream_chunks() -> None:
    assert chunk(COMPLETION, "ab")["choices"] == [
        {"index": 0, "logprobs": None, "finish_reason": None, "text": "ab"}]
    lps = {"tokens": ["ab"], "token_logprobs": [-0.5], "top_logprobs": [{"ab": -0.5}], "text_offset": [0]}
    assert chunk(COMPLETION, "ab", index=3, logprobs=lps)["choices"] == [
        {"index": 3, "logprobs": lps, "finish_reason": None, "text": "ab"}]
    closing = chunk(COMPLETION, None, "length")
    assert closing["object"] == "text_completion"
    assert closing["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "length", "text": ""}]


@pytest.mark.parametrize("head, object_", [(COMPLETION, "text_completion"), (CHAT, "chat.completion.chunk")])
def test_usage_field_and_usage_chunk(head: Head, object_: str) -> None:
    with_field = chunk(head, "x", usage_field=True)
    assert "usage" in with_field and with_field["usage"] is None
    assert "usage" not in chunk(head, "x")
    last = usage_chunk(head, usage(1, 2))
    assert last == {"id": head.id, "object": object_, **HEAD, "choices": [], "usage": usage(1, 2)}


def test_sse_events() -> None:
    ev = event({"a": "é", "b": [1, 2]})
    assert ev == 'data: {"a":"é","b":[1,2]}\n\n'
    assert json.loads(ev[len("data: "):]) == {"a": "é", "b": [1, 2]}
    assert event({"t": "x\ny"}).count("\n") == 2  # a newline in the data stays escaped
    assert DONE == "data: [DONE]\n\n"


def test_errors_in_openai_shape() -> None:
    err = invalid("top_p must be in (0, 1]", "top_p")
    assert isinstance(err, Exception) and str(err) == err.message
    assert (err.status, err.headers) == (400, {})
    assert err.body() == {"error": {"message": "top_p must be in (0, 1]", "type": "invalid_request_error",
                                    "param": "top_p", "code": "invalid_value"}}
    full = queue_full(64, 3)
    assert (full.status, full.type, full.code, full.headers) == (429, "rate_limit_error", "queue_full",
                                                                 {"Retry-After": "3"})
    assert "64" in full.message
    assert (server_error("boom").status, server_error("boom").body()["error"]["type"]) == (500, "server_error")
    gone = unavailable("shutting down")
    assert (gone.status, gone.code, gone.param) == (503, "unavailable", None)
    assert APIError(404, "no", code="model_not_found", param="model").body()["error"]["code"] == "model_not_found"
