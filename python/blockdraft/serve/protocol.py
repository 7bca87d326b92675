"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``: parsing and checks.

Every field is checked for its type and range before anything reaches the engine; a bad one
is a 400 ``invalid_request_error`` naming the field. Fields the server does not know are
ignored (clients send many); known fields asking for something the server cannot do (``n >
1``, ``logprobs``, ``echo``, ``suffix``, several prompts) are refused rather than ignored,
so no client gets an answer to a question it did not ask. ``null`` means "the default", as
in OpenAI's API.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from blockdraft.sampling import SamplingParams
from blockdraft.serve.errors import APIError, invalid

Kind = Literal["completion", "chat"]

ROLES = ("system", "developer", "user", "assistant", "tool")

# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_TOKENS = 16


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request body.

    Attributes:
        prompt: the completion prompt: text or token ids (``None`` for chat).
        messages: the chat messages as ``{"role", "content"}`` with text content (``None``
            for completions).
        max_tokens: the most new tokens (``None``: the endpoint's default).
        sampling: the body's ``temperature``, ``top_p`` and ``top_k`` (``top_k`` 0 or -1:
            no top-k filter).
        stop: strings that end the generation (cut from the text).
    """

    kind: Kind
    model: str | None
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    return_meta_info: bool


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object.

    Raises:
        APIError: 400 when it is not JSON or not an object.
    """
    try:
        body = json.loads(raw)
    # Beside JSONDecodeError and UnicodeDecodeError (both ValueErrors), the parser raises a
    # plain ValueError for an integer past Python's digit limit and RecursionError for arrays
    # or objects nested past the recursion limit: a bad body all the same, not a server fault.
    except (ValueError, RecursionError) as exc:
        raise invalid(f"could not parse the JSON body of the request: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, not {_json_type(body)}",
                      code="invalid_json")
    return body


def parse_request(kind: Kind, body: dict[str, Any]) -> GenerationRequest:
    """Check a completion or chat body.

    Raises:
        APIError: 400 naming the first field at fault.
    """
    _refuse_unsupported(kind, body)
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    limit = "max_tokens"  # the field the token limit came from
    if kind == "completion":
        prompt = _prompt(body)
        max_tokens = _int(body, limit)
    else:
        messages = _messages(body)
        max_tokens = _int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _int(body, limit)
        else:
            limit = "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"{limit} must be >= 1, not {max_tokens}", limit)
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise invalid(f"temperature must be >= 0 (0 = greedy), not {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise invalid(f"top_p must be in (0, 1], not {top_p}", "top_p")
    top_k = _int(body, "top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    if top_k < 0:
        raise invalid(f"top_k must be >= 0 (0 or -1 = off), not {top_k}", "top_k")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    return GenerationRequest(
        kind=kind, model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
        sampling=SamplingParams(temperature, top_p, top_k), stop=_stop(body),
        seed=_int(body, "seed"), stream=_bool(body, "stream"),
        include_usage=_bool(options or {}, "include_usage", "stream_options.include_usage"),
        return_meta_info=_bool(body, "return_meta_info"),
    )


def _refuse_unsupported(kind: Kind, body: dict[str, Any]) -> None:
    for name in ("n", "best_of"):
        value = _int(body, name)
        if value is not None and value != 1:
            raise invalid(f"{name} = {value} is not supported: one choice per request", name,
                          code="unsupported")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise invalid("logprobs are not supported", "logprobs", code="unsupported")
    if kind == "completion":
        if body.get("echo") not in (None, False):
            raise invalid("echo is not supported", "echo", code="unsupported")
        if body.get("suffix") not in (None, ""):
            raise invalid("suffix is not supported", "suffix", code="unsupported")


def _prompt(body: dict[str, Any]) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt is required", "prompt", code="missing_required_parameter")
    value = body["prompt"]
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise invalid(f"prompt must be a string, a list of token ids or a list of one string, "
                      f"not {_json_type(value)}", "prompt")
    if all(_is_int(v) for v in value):
        return list(value)
    if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        if len(value) > 1:
            raise invalid(f"a batch of {len(value)} prompts is not supported: send one prompt "
                          "per request", "prompt", code="unsupported")
        one = value[0]
        if isinstance(one, str):
            return one
        if one and all(_is_int(v) for v in one):
            return list(one)
    raise invalid("prompt must be a string, a list of token ids or a list of one string",
                  "prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" not in body or body["messages"] is None:
        raise invalid("messages is required", "messages", code="missing_required_parameter")
    value = body["messages"]
    if not isinstance(value, list):
        raise _wrong_type("messages", "a list of messages", value)
    if not value:
        raise invalid("messages must hold at least one message", "messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _wrong_type(where, "an object", msg)
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(f"{where}.role must be one of {list(ROLES)}, not {role!r}", f"{where}.role")
        out.append({"role": role, "content": _content(msg.get("content"), f"{where}.content")})
    return out


def _content(value: Any, where: str) -> str:
    """A message's text: a string, ``null`` (an assistant turn without text) or a list of
    ``{"type": "text", "text": ...}`` parts, joined."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _wrong_type(where, "a string or a list of text parts", value)
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid(f"{where}[{j}]: only text parts ({{\"type\": \"text\"}}) are supported",
                          f"{where}[{j}]", code="unsupported")
        text = part.get("text")
        if not isinstance(text, str):
            raise _wrong_type(f"{where}[{j}].text", "a string", text)
        texts.append(text)
    return "".join(texts)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _wrong_type("stop", "a string or a list of strings", value)
    if any(not s for s in items):
        raise invalid("stop strings must not be empty", "stop")
    return tuple(dict.fromkeys(items))


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _wrong_type(name, "an integer", value)
    return int(value)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(name, "a number", value)
    try:
        number = float(value)
    except OverflowError:  # an integer past the float range (JSON integers are unbounded)
        number = math.inf if value > 0 else -math.inf
    if not math.isfinite(number):
        raise invalid(f"{name} must be finite, not {number}", name)
    return number


def _bool(body: dict[str, Any], name: str, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _wrong_type(where or name, "a boolean", value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong_type(name: str, want: str, value: Any) -> APIError:
    return invalid(f"{name} must be {want}, not {_json_type(value)}", name, code="invalid_type")


__all__ = ["DEFAULT_COMPLETION_TOKENS", "GenerationRequest", "Kind", "parse_json", "parse_request"]
