"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``
(:mod:`blockdraft.serve.protocol`): defaults, the accepted forms of each field, and the 400 that
names the field at fault, without a server."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockdraft.sampling import SamplingParams
from blockdraft.serve.errors import APIError
from blockdraft.serve.protocol import DEFAULT_COMPLETION_TOKENS, GenerationRequest, parse_json, parse_request

USER = [{"role": "user", "content": "def f():"}]


def completion(**fields: Any) -> GenerationRequest:
    return parse_request("completion", {"prompt": "x", **fields})


def chat(**fields: Any) -> GenerationRequest:
    return parse_request("chat", {"messages": USER, **fields})


def refused(kind: str, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(kind, body)  # type: ignore[arg-type]
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error" and err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error",
                                    "param": err.param, "code": err.code}}
    return err


def test_parse_json_returns_the_object() -> None:
    assert parse_json(b'{"prompt": "x", "n": 1}') == {"prompt": "x", "n": 1}
    assert parse_json('{"prompt": "héllo"}'.encode()) == {"prompt": "héllo"}


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "x",', "could not parse"),
    (b"", "could not parse"),
    (b'{"prompt": "\xff"}', "could not parse"),
    (b'["x"]', "not an array"),
    (b'"x"', "not a string"),
    (b"3", "not a number"),
    (b"null", "not null"),
    (b"true", "not a boolean"),
    (b'{"prompt": "x", "n": 1' + b"0" * 5000 + b"}", "could not parse"),
    (b"[" * 100_000 + b"]" * 100_000, "could not parse"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "could not parse"),
])
def test_parse_json_refuses_what_is_not_a_json_object(raw: bytes, words: str) -> None:
    with pytest.raises(APIError) as info:
        parse_json(raw)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "invalid_json", None)
    assert words in err.message


def test_a_minimal_completion_body_takes_every_default() -> None:
    req = parse_request("completion", {"prompt": "def f():"})
    assert req == GenerationRequest(
        kind="completion", model=None, prompts=["def f():"], messages=None, max_tokens=None,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0), stop=(), seed=None, stream=False,
        include_usage=False, return_meta_info=False)


def test_a_minimal_chat_body_takes_every_default() -> None:
    req = parse_request("chat", {"messages": USER})
    assert req == GenerationRequest(
        kind="chat", model=None, prompts=None, messages=USER, max_tokens=None,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0), stop=(), seed=None, stream=False,
        include_usage=False, return_meta_info=False)
    assert DEFAULT_COMPLETION_TOKENS == 16


FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
          "stream_options", "return_meta_info", "n", "best_of", "logprobs", "top_logprobs",
          "echo", "suffix", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "tools", "functions",
          "tool_choice", "function_call", "audio", "prediction", "modalities"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_null_means_the_default(kind: str) -> None:
    base: dict[str, Any] = {"prompt": "x"} if kind == "completion" else {"messages": USER}
    nulls = {name: None for name in FIELDS}
    if kind == "chat":
        nulls["max_completion_tokens"] = None
    assert parse_request(kind, {**base, **nulls}) == parse_request(kind, base)  # type: ignore[arg-type]


def test_unknown_fields_are_ignored() -> None:
    extra = {"user": "u", "frobnicate": {"x": [1, 2]}, "metadata": None, "store": False}
    assert completion(**extra) == completion()
    assert chat(**extra) == chat()


def test_every_field_is_read() -> None:
    req = completion(model="m", max_tokens=7, temperature=0, top_p=0.5, top_k=40, stop="\n",
                     seed=-3, stream=True, stream_options={"include_usage": True},
                     return_meta_info=True)
    assert (req.model, req.max_tokens, req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.stop,
            req.seed, req.stream, req.include_usage, req.return_meta_info) == (
        "m", 7, 0.0, 0.5, 40, ("\n",), -3, True, True, True)
    assert isinstance(req.sampling.temperature, float) and isinstance(req.sampling.top_p, float)


@pytest.mark.parametrize("prompt, want", [
    ("def f():", ["def f():"]),
    ("", [""]),  # the empty prompt is refused once it is encoded (it may be whitespace-free text)
    ([1, 2, 3], [[1, 2, 3]]),
    (["def f():"], ["def f():"]),
    ([[4, 5]], [[4, 5]]),
    (["a", "b", "a"], ["a", "b", "a"]),  # several prompts, in order
    ([[1], [2, 3]], [[1], [2, 3]]),
    (["p"] * 64, ["p"] * 64),
])
def test_prompt_forms(prompt: Any, want: list[str | list[int]]) -> None:
    assert completion(prompt=prompt).prompts == want


@pytest.mark.parametrize("prompt, code", [
    (5, "invalid_value"),
    ({"text": "x"}, "invalid_value"),
    ([], "invalid_value"),
    ([[]], "invalid_value"),
    (["a", 1], "invalid_value"),
    ([1, "a"], "invalid_value"),
    ([True, 1], "invalid_value"),
    ([1.5], "invalid_value"),
    ([["a"]], "invalid_value"),
    (["a", [1]], "invalid_value"),
    ([[1], []], "invalid_value"),
    ([[1], [True]], "invalid_value"),
    (["p"] * 65, "invalid_value"),  # past MAX_PROMPTS
    ([[1]] * 65, "invalid_value"),
])
def test_bad_prompts_name_the_prompt(prompt: Any, code: str) -> None:
    err = refused("completion", {"prompt": prompt})
    assert (err.param, err.code) == ("prompt", code)


def test_prompt_is_required() -> None:
    for body in ({}, {"prompt": None}):
        err = refused("completion", body)
        assert (err.param, err.code) == ("prompt", "missing_required_parameter")


def test_a_chat_body_needs_no_prompt_and_a_completion_body_no_messages() -> None:
    assert chat(prompt=[1, 2]).prompts is None
    assert completion(messages="anything").messages is None


def test_every_role_and_the_content_forms() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": ""},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "assistant"},
        {"role": "tool", "content": [], "tool_call_id": "t1", "name": "n"},
    ]
    assert chat(messages=messages).messages == [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": ""},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": ""},
    ]


@pytest.mark.parametrize("messages, param, code", [
    ("hi", "messages", "invalid_type"),
    ({"role": "user", "content": "x"}, "messages", "invalid_type"),
    ([], "messages", "invalid_value"),
    (["hi"], "messages[0]", "invalid_type"),
    ([{"content": "x"}], "messages[0].role", "invalid_value"),
    ([{"role": "robot", "content": "x"}], "messages[0].role", "invalid_value"),
    ([{"role": "User", "content": "x"}], "messages[0].role", "invalid_value"),
    ([{"role": 1, "content": "x"}], "messages[0].role", "invalid_value"),
    ([{"role": "user", "content": 3}], "messages[0].content", "invalid_type"),
    ([{"role": "user", "content": {"text": "x"}}], "messages[0].content", "invalid_type"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]", "unsupported"),
    ([{"role": "user", "content": ["x"]}], "messages[0].content[0]", "unsupported"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text", "invalid_type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "invalid_type"),
    (USER + [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
     "messages[1].content[1]", "unsupported"),
])
def test_bad_messages_name_the_message_at_fault(messages: Any, param: str, code: str) -> None:
    err = refused("chat", {"messages": messages})
    assert (err.param, err.code) == (param, code)


def test_messages_are_required() -> None:
    for body in ({}, {"messages": None}, {"prompt": "x"}):
        err = refused("chat", body)
        assert (err.param, err.code) == ("messages", "missing_required_parameter")


def test_max_tokens() -> None:
    assert completion(max_tokens=1).max_tokens == 1
    assert completion(max_tokens=10**6).max_tokens == 10**6  # the context limit is the server's
    assert chat(max_tokens=9).max_tokens == 9
    assert chat(max_completion_tokens=5).max_tokens == 5
    assert chat(max_completion_tokens=5, max_tokens=9).max_tokens == 5
    assert chat(max_completion_tokens=None, max_tokens=9).max_tokens == 9
    # /v1/completions has no max_completion_tokens: an unknown field there.
    assert completion(max_completion_tokens=5).max_tokens is None


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("value, code", [
    (0, "invalid_value"), (-3, "invalid_value"), ("8", "invalid_type"), (8.0, "invalid_type"),
    (8.5, "invalid_type"), (True, "invalid_type"), ([8], "invalid_type"),
])
def test_bad_max_tokens(kind: str, value: Any, code: str) -> None:
    base: dict[str, Any] = {"prompt": "x"} if kind == "completion" else {"messages": USER}
    err = refused(kind, {**base, "max_tokens": value})
    assert (err.param, err.code) == ("max_tokens", code)


@pytest.mark.parametrize("value, code", [("5", "invalid_type"), (0, "invalid_value"), (-1, "invalid_value")])
def test_bad_max_completion_tokens_names_it(value: Any, code: str) -> None:
    err = refused("chat", {"messages": USER, "max_completion_tokens": value, "max_tokens": 4})
    assert (err.param, err.code) == ("max_completion_tokens", code)
    assert "max_completion_tokens" in err.message


def test_sampling_ranges_at_their_edges() -> None:
    assert completion(temperature=0).sampling.temperature == 0.0
    assert completion(temperature=7.5).sampling.temperature == 7.5
    assert completion(top_p=1).sampling.top_p == 1.0
    assert completion(top_p=1e-9).sampling.top_p == 1e-9
    assert completion(top_k=-1).sampling.top_k == 0
    assert completion(top_k=0).sampling.top_k == 0
    assert completion(top_k=1).sampling.top_k == 1


@pytest.mark.parametrize("field, value, code", [
    ("temperature", -0.5, "invalid_value"),
    ("temperature", -1e-12, "invalid_value"),
    ("temperature", "hot", "invalid_type"),
    ("temperature", True, "invalid_type"),
    ("temperature", [1], "invalid_type"),
    ("temperature", math.inf, "invalid_value"),
    ("temperature", math.nan, "invalid_value"),
    # JSON integers past the float range
    pytest.param("temperature", 10**400, "invalid_value", id="temperature-10**400"),
    pytest.param("top_p", -(10**400), "invalid_value", id="top_p--10**400"),
    ("top_p", 0, "invalid_value"),
    ("top_p", -0.1, "invalid_value"),
    ("top_p", 1.0000001, "invalid_value"),
    ("top_p", 1.5, "invalid_value"),
    ("top_p", math.nan, "invalid_value"),
    ("top_p", "1", "invalid_type"),
    ("top_k", -2, "invalid_value"),
    ("top_k", 2.5, "invalid_type"),
    ("top_k", False, "invalid_type"),
    ("seed", 1.5, "invalid_type"),
    ("seed", "1", "invalid_type"),
    ("seed", True, "invalid_type"),
    ("model", 3, "invalid_type"),
    ("model", ["m"], "invalid_type"),
])
def test_bad_sampling_fields_name_the_field(field: str, value: Any, code: str) -> None:
    for kind, base in (("completion", {"prompt": "x"}), ("chat", {"messages": USER})):
        err = refused(kind, {**base, field: value})
        assert (err.param, err.code) == (field, code)


@given(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-10**6, 10**6))
def test_temperature_is_accepted_exactly_when_it_is_not_negative(value: float) -> None:
    if value >= 0:
        assert completion(temperature=value).sampling.temperature == float(value)
    else:
        assert refused("completion", {"prompt": "x", "temperature": value}).param == "temperature"


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_top_p_is_accepted_exactly_in_zero_to_one(value: float) -> None:
    if 0 < value <= 1:
        assert completion(top_p=value).sampling.top_p == value
    else:
        assert refused("completion", {"prompt": "x", "top_p": value}).param == "top_p"


@pytest.mark.parametrize("stop, want", [
    ("\n", ("\n",)),
    (["\n\n", "def "], ("\n\n", "def ")),
    (["b", "a", "b", "a"], ("b", "a")),  # duplicates once, first order kept
    ([], ()),
    (" ", (" ",)),
])
def test_stop_forms(stop: Any, want: tuple[str, ...]) -> None:
    assert completion(stop=stop).stop == want
    assert chat(stop=stop).stop == want


@pytest.mark.parametrize("stop, code", [
    (7, "invalid_type"),
    ({"s": 1}, "invalid_type"),
    (["a", 1], "invalid_type"),
    ([None], "invalid_type"),
    ("", "invalid_value"),
    (["a", ""], "invalid_value"),
])
def test_bad_stop(stop: Any, code: str) -> None:
    err = refused("completion", {"prompt": "x", "stop": stop})
    assert (err.param, err.code) == ("stop", code)


def test_stream_options() -> None:
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True, stream_options={"include_usage": False}).include_usage
    assert not completion(stream=True, stream_options={}).include_usage
    assert not completion(stream=True, stream_options={"include_usage": None}).include_usage
    assert not completion(stream=True, stream_options={"other": 1}).include_usage


@pytest.mark.parametrize("body, param", [
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"return_meta_info": "yes"}, "return_meta_info"),
    ({"return_meta_info": 0}, "return_meta_info"),
    ({"stream_options": []}, "stream_options"),
    ({"stream_options": "include_usage"}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
def test_bad_booleans_name_the_field(body: dict[str, Any], param: str) -> None:
    err = refused("completion", {"prompt": "x", **body})
    assert (err.param, err.code) == (param, "invalid_type")


@pytest.mark.parametrize("kind, body, param", [
    ("completion", {"echo": True}, "echo"),
    ("completion", {"suffix": "}"}, "suffix"),
    ("completion", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": -100}}, "logit_bias"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("chat", {"function_call": {"name": "f"}}, "function_call"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("completion", {"best_of": 3}, "best_of"),
    ("chat", {"n": 2, "best_of": 3}, "best_of"),
])
def test_options_the_server_cannot_honour_are_refused(kind: str, body: dict[str, Any], param: str) -> None:
    base: dict[str, Any] = {"prompt": "x"} if kind == "completion" else {"messages": USER}
    err = refused(kind, {**base, **body})
    assert (err.param, err.code) == (param, "unsupported")


def test_the_values_that_ask_for_nothing_are_accepted() -> None:
    same = {"n": 1, "best_of": 1, "echo": False, "suffix": "", "logit_bias": {}, "logprobs": None,
            "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
            "stop_token_ids": [], "ignore_eos": False, "min_tokens": 0}
    assert completion(**same) == completion()
    chat_same = {**same, "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
                 "functions": [], "function_call": "auto", "modalities": ["text"]}
    del chat_same["echo"], chat_same["suffix"]
    assert chat(**chat_same) == chat()
    assert completion(n=3, best_of=3) == completion(n=3)


def test_request_fields_are_read() -> None:
    req = completion(prompt=["a", "b"], n=3, logprobs=5, presence_penalty=-2, frequency_penalty=2,
                     repetition_penalty=1.3, stop_token_ids=[7, 0, 7], ignore_eos=True, min_tokens=4,
                     max_tokens=4)
    assert (req.prompts, req.n, req.logprobs, req.stop_token_ids, req.ignore_eos, req.min_tokens) == (
        ["a", "b"], 3, 5, (7, 0), True, 4)
    assert req.sampling == SamplingParams(1.0, 1.0, 0, -2.0, 2.0, 1.3)
    assert completion(logprobs=0).logprobs == 0  # the chosen token's log-probability only
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=20).logprobs == 20
    assert chat(logprobs=False).logprobs is None
    assert completion(n=16).n == 16 and completion(n=2, prompt=["p"] * 32).n == 2


@pytest.mark.parametrize("kind, body, param, code", [
    ("completion", {"n": 0}, "n", "invalid_value"),
    ("completion", {"n": 17}, "n", "invalid_value"),  # past MAX_N
    ("chat", {"n": -1}, "n", "invalid_value"),
    ("completion", {"n": "2"}, "n", "invalid_type"),
    ("completion", {"n": 3, "prompt": ["p"] * 22}, "n", "invalid_value"),  # 66 choices
    ("completion", {"n": 2, "best_of": 1}, "best_of", "invalid_value"),
    ("completion", {"logprobs": 6}, "logprobs", "invalid_value"),
    ("completion", {"logprobs": -1}, "logprobs", "invalid_value"),
    ("completion", {"logprobs": True}, "logprobs", "invalid_type"),
    ("completion", {"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ("chat", {"logprobs": 2}, "logprobs", "invalid_type"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "invalid_value"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "invalid_value"),  # without logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 1.5}, "top_logprobs", "invalid_type"),
    ("completion", {"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ("chat", {"frequency_penalty": -2.01}, "frequency_penalty", "invalid_value"),
    ("chat", {"presence_penalty": "1"}, "presence_penalty", "invalid_type"),
    ("completion", {"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ("chat", {"repetition_penalty": -1}, "repetition_penalty", "invalid_value"),
    ("completion", {"repetition_penalty": math.inf}, "repetition_penalty", "invalid_value"),
    ("completion", {"stop_token_ids": 5}, "stop_token_ids", "invalid_type"),
    ("chat", {"stop_token_ids": [1, "2"]}, "stop_token_ids", "invalid_type"),
    ("chat", {"stop_token_ids": [-1]}, "stop_token_ids", "invalid_value"),
    ("completion", {"stop_token_ids": list(range(17))}, "stop_token_ids", "invalid_value"),
    ("completion", {"ignore_eos": 1}, "ignore_eos", "invalid_type"),
    ("completion", {"min_tokens": -1}, "min_tokens", "invalid_value"),
    ("chat", {"min_tokens": 5, "max_tokens": 4}, "min_tokens", "invalid_value"),
    ("chat", {"min_tokens": 2.0}, "min_tokens", "invalid_type"),
    ("completion", {"stop": ["s"] * 17}, "stop", "invalid_value"),  # past MAX_STOPS
    ("chat", {"stop": "x" * 257}, "stop", "invalid_value"),  # past MAX_STOP_CHARS
])
def test_bad_request_fields_name_the_field(kind: str, body: dict[str, Any], param: str, code: str) -> None:
    base: dict[str, Any] = {"prompt": "x"} if kind == "completion" else {"messages": USER}
    err = refused(kind, {**base, **body})
    assert (err.param, err.code) == (param, code)


def test_the_limits_are_reached_exactly() -> None:
    assert completion(stop=[str(i) for i in range(16)]).stop == tuple(str(i) for i in range(16))
    assert chat(stop="x" * 256).stop == ("x" * 256,)
    assert completion(stop_token_ids=list(range(16))).stop_token_ids == tuple(range(16))
    assert completion(n=2, prompt=["p"] * 32).n == 2
    assert completion(logprobs=5).logprobs == 5


def test_the_first_field_at_fault_is_named() -> None:
    """An unsupported option is reported before a bad prompt, a bad prompt before a bad
    max_tokens, max_tokens before the sampling fields, and those before the choices and
    outputs."""
    bad = {"echo": True, "prompt": 5, "max_tokens": 0, "temperature": -1, "top_p": 2,
           "presence_penalty": 3, "stop": 3, "n": 0, "min_tokens": -1, "logprobs": 9,
           "stop_token_ids": "x"}
    good = {"echo": False, "prompt": "x", "max_tokens": 1, "temperature": 0, "top_p": 1,
            "presence_penalty": 0, "stop": "s", "n": 1, "min_tokens": 1, "logprobs": 1,
            "stop_token_ids": [3]}
    for name in good:
        assert refused("completion", bad).param == name
        bad[name] = good[name]
    assert parse_request("completion", bad) == completion(**good)


def test_a_request_round_trips_through_json() -> None:
    body = {"prompt": [1, 2], "max_tokens": 3, "stop": ["x"], "stream": True, "seed": 4}
    assert parse_request("completion", parse_json(json.dumps(body).encode())) == completion(**body)
