"""Chat messages to prompt tokens (:mod:`blockdraft.serve.chat`): a tokenizer's chat template,
the built-in pair's code-continuation format, and the 400s of a model that cannot chat."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blockdraft.pretrained
from blockdraft.serve.chat import ChatFormat
from blockdraft.serve.errors import APIError
from blockdraft.serve.protocol import ROLES

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "    return a + b"},
    {"role": "user", "content": "def fibonacci(n):"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return blockdraft.pretrained.load_tokenizer()


@pytest.fixture(scope="module")
def templated() -> Any:
    """The built-in tokenizer with a chat template of its own (a copy: the other keeps none)."""
    tok = blockdraft.pretrained.load_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


class _Recorder:
    """A stand-in tokenizer that records how it is called; ids are code points."""

    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> str:
        self.calls.append(("apply_chat_template", messages, kw))
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    def encode(self, text: str, **kw: Any) -> list[int]:
        self.calls.append(("encode", text, kw))
        return [ord(c) for c in text]


def _refusal(chat: ChatFormat, messages: list[dict[str, str]]) -> APIError:
    with pytest.raises(APIError) as info:
        chat.render(messages)
    err = info.value
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "messages")
    return err


def test_the_builtin_pair_has_no_template(tokenizer: Any) -> None:
    assert not ChatFormat(tokenizer, builtin=True).has_template


def test_builtin_continues_the_last_user_message(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, builtin=True)
    assert chat.render(CONVERSATION) == tokenizer.encode("def fibonacci(n):")
    assert chat.render(CONVERSATION[:3]) == tokenizer.encode("def add(a, b):")
    assert chat.render([{"role": "user", "content": "x = 1"}]) == tokenizer.encode("x = 1")


@given(st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": st.text(max_size=20)}),
                min_size=1, max_size=6))
@settings(max_examples=50, deadline=None)
def test_builtin_renders_exactly_the_last_user_content(tokenizer: Any, messages: list[dict[str, str]]) -> None:
    chat = ChatFormat(tokenizer, builtin=True)
    users = [m["content"] for m in messages if m["role"] == "user"]
    if users:
        assert chat.render(messages) == list(tokenizer.encode(users[-1]))
    else:
        assert "user message" in _refusal(chat, messages).message


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "def f():"}],
    [{"role": "assistant", "content": "def f():"}, {"role": "tool", "content": "x"}],
    [{"role": "developer", "content": "x"}],
])
def test_builtin_without_a_user_message_is_a_400(tokenizer: Any, messages: list[dict[str, str]]) -> None:
    err = _refusal(ChatFormat(tokenizer, builtin=True), messages)
    assert err.code == "invalid_value" and "user message" in err.message


def test_builtin_empty_user_content_renders_to_no_tokens(tokenizer: Any) -> None:
    """The server refuses an empty prompt after rendering, for chat and completions alike."""
    assert ChatFormat(tokenizer, builtin=True).render([{"role": "user", "content": ""}]) == []


@pytest.mark.parametrize("template", [None, ""])
def test_a_model_without_a_template_cannot_chat(template: str | None) -> None:
    tok = _Recorder(template)
    chat = ChatFormat(tok, builtin=False)
    assert not chat.has_template
    err = _refusal(chat, CONVERSATION)
    assert err.code == "no_chat_template" and "/v1/completions" in err.message
    assert tok.calls == []  # no format is guessed


def test_the_builtin_tokenizer_unflagged_cannot_chat(tokenizer: Any) -> None:
    assert _refusal(ChatFormat(tokenizer, builtin=False), CONVERSATION).code == "no_chat_template"


@pytest.mark.parametrize("builtin", [False, True])
def test_a_template_renders_every_message_and_the_generation_prompt(templated: Any, builtin: bool) -> None:
    chat = ChatFormat(templated, builtin=builtin)
    assert chat.has_template
    text = ("<|system|>You write Python.\n<|user|>def add(a, b):\n<|assistant|>    return a + b\n"
            "<|user|>def fibonacci(n):\n<|assistant|>")
    assert chat.render(CONVERSATION) == templated.encode(text, add_special_tokens=False)
    assert templated.decode(chat.render(CONVERSATION)) == text


def test_a_template_renders_without_a_user_message(templated: Any) -> None:
    system = [{"role": "system", "content": "hi"}]
    assert ChatFormat(templated, builtin=True).render(system) == templated.encode(
        "<|system|>hi\n<|assistant|>", add_special_tokens=False)


def test_special_tokens_in_a_template_encode_as_themselves() -> None:
    tok = blockdraft.pretrained.load_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content }}<|endoftext|>{% endfor %}"
    ids = ChatFormat(tok, builtin=False).render([{"role": "user", "content": "x"}])
    assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1


def test_the_template_is_asked_for_text_with_the_generation_prompt() -> None:
    tok = _Recorder("{{ messages }}")
    messages = [{"role": "user", "content": "ab"}]
    assert ChatFormat(tok, builtin=False).render(messages) == [ord(c) for c in "user:ab|assistant:"]
    assert tok.calls == [
        ("apply_chat_template", messages, {"add_generation_prompt": True, "tokenize": False}),
        # the template places any special tokens itself: encode adds none
        ("encode", "user:ab|assistant:", {"add_special_tokens": False}),
    ]
