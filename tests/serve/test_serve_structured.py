"""Structured outputs through the ``openai`` client: ``response_format`` (JSON object, JSON
schema) and the ``structured_outputs`` extension (regex, choice, Lark), streamed and not, with
``n`` > 1; each answer equals ``blockdraft.generate`` under the same grammar and validates;
bad grammars are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

import blockdraft
from blockdraft.grammar import GrammarSpec
from blockdraft.serve.errors import APIError
from blockdraft.serve.protocol import parse_request

from support.serve_support import MODEL, LiveServer, Pair

PROMPT = "def load(path):\n    return "
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["file", "dir"]},
        "parts": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}},
                                             "required": ["id"]}, "maxItems": 2},
    },
    "required": ["name", "size", "kind", "parts"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "entry", "schema": SCHEMA, "strict": True}}


def solo(pair: Pair, spec: GrammarSpec, prompt: list[int], n: int = 96) -> str:
    """``blockdraft.generate``'s greedy answer under ``spec``, as the server's text."""
    out = blockdraft.generate(pair.target, pair.drafter, [prompt], max_new_tokens=n, grammar=spec,
                              tokenizer=pair.tokenizer, stop_token_ids=[pair.eos]).tokens[0]
    return str(pair.tokenizer.decode(out, skip_special_tokens=True))


def test_chat_json_schema_streamed_and_not_with_n(server: LiveServer, pair: Pair) -> None:
    client = server.openai()
    messages = [{"role": "user", "content": PROMPT}]
    want = solo(pair, GrammarSpec.json_schema(SCHEMA), server_chat_prompt(server, pair, messages))
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=96, temperature=0,
                                         response_format=RESPONSE_FORMAT, n=2)
    assert [c.message.content for c in got.choices] == [want, want]
    assert all(c.finish_reason == "stop" for c in got.choices)
    jsonschema.validate(json.loads(want), SCHEMA)
    texts = ["", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=96, temperature=0,
                                                response_format=RESPONSE_FORMAT, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [want, want]


def server_chat_prompt(server: LiveServer, pair: Pair, messages: list[dict[str, str]]) -> list[int]:
    """The token ids the server renders ``messages`` to (the built-in chat format)."""
    return list(server.app.state.service.chat.render(messages))


def test_completions_json_object_and_sampled_choices_validate(server: LiveServer, pair: Pair) -> None:
    client = server.openai()
    want = solo(pair, GrammarSpec.json_object(), pair.tokenizer.encode(PROMPT))
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=96, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert got.choices[0].text == want and isinstance(json.loads(want), dict)
    # Sampled choices differ, and every one is valid.
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=96, temperature=1.0, seed=3,
                                    n=4, extra_body={"response_format": RESPONSE_FORMAT})
    for c in got.choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize(("field", "spec", "check"), [
    ({"regex": r"[a-z]{2,6}\.(py|txt)"}, GrammarSpec.regex(r"[a-z]{2,6}\.(py|txt)"),
     lambda s: s.split(".")[-1] in ("py", "txt")),
    ({"choice": ["open", "close", "read"]}, GrammarSpec.choice(["open", "close", "read"]),
     lambda s: s in ("open", "close", "read")),
    ({"grammar": 'start: "f(" ARG ")"\nARG: /[a-z]{1,4}/'}, GrammarSpec.lark('start: "f(" ARG ")"\nARG: /[a-z]{1,4}/'),
     lambda s: s.startswith("f(") and s.endswith(")")),
    ({"json": SCHEMA}, GrammarSpec.json_schema(SCHEMA), lambda s: jsonschema.validate(json.loads(s), SCHEMA) is None),
])
def test_structured_outputs_extension(server: LiveServer, pair: Pair, field: dict[str, Any], spec: GrammarSpec,
                                      check: Any) -> None:
    want = solo(pair, spec, pair.tokenizer.encode(PROMPT))
    client = server.openai()
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=96, temperature=0,
                                    extra_body={"structured_outputs": field})
    assert got.choices[0].text == want and check(want), want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=96, temperature=0, stream=True,
        extra_body={"structured_outputs": field}) if c.choices)
    assert streamed == want


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format", "must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format", "type must be"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "invalid Lark grammar"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
])
def test_bad_grammars_are_400s_naming_the_field(server: LiveServer, body: dict[str, Any], param: str,
                                                words: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and words in err["message"], err
    with pytest.raises(openai.BadRequestError, match=words):
        server.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=body)


def test_parsed_fields() -> None:
    base = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_request("chat", base).grammar is None
    assert parse_request("chat", {**base, "response_format": {"type": "text"}}).grammar is None
    req = parse_request("chat", {**base, "response_format": RESPONSE_FORMAT})
    assert req.grammar == GrammarSpec.json_schema(SCHEMA) and req.grammar_field == "response_format"
    req = parse_request("chat", {**base, "structured_outputs": {"json_object": True}})
    assert req.grammar == GrammarSpec.json_object() and req.grammar_field == "structured_outputs"
    with pytest.raises(APIError, match="json_object must be true"):
        parse_request("chat", {**base, "structured_outputs": {"json_object": 1}})
