"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``: parsing and checks.

Every field is checked for its type and range before anything reaches the engine; a bad one
is a 400 ``invalid_request_error`` naming the field. Fields the server does not know are
ignored (clients send many); known fields asking for something the server cannot do
(``echo``, ``suffix``, ``best_of > n``, ``logit_bias``, tools, audio) are refused rather than
ignored, so no client gets an answer to a question it did not ask. ``null`` means "the
default", as in OpenAI's API. The limits (:data:`MAX_N` choices, :data:`MAX_PROMPTS` prompts,
:data:`MAX_STOPS` stop strings of :data:`MAX_STOP_CHARS` characters, ...) keep one request
from flooding the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from blockdraft.grammar.spec import GrammarSpec
from blockdraft.sampling import SamplingParams
from blockdraft.serve.errors import APIError, invalid
from blockdraft.serve.structured import grammar_of

Kind = Literal["completion", "chat"]

ROLES = ("system", "developer", "user", "assistant", "tool")

# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_TOKENS = 16

MAX_N = 16
"""The most choices per prompt (``n``)."""
MAX_PROMPTS = 64
"""The most prompts in one completions request."""
MAX_CHOICES = 64
"""The most choices in one request: prompts × ``n`` (each is an engine request)."""
MAX_STOPS = 16
"""The most stop strings, and the most ``stop_token_ids``."""
MAX_STOP_CHARS = 256
"""The longest stop string, in characters."""
MAX_TOP_LOGPROBS = 20
"""Chat's ``top_logprobs`` at most (OpenAI's limit)."""
MAX_LOGPROBS = 5
"""Completions' ``logprobs`` at most (OpenAI's limit)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request body.

    Attributes:
        prompts: the completion prompts, each text or token ids (``None`` for chat).
        messages: the chat messages as ``{"role", "content"}`` with text content (``None``
            for completions).
        max_tokens: the most new tokens (``None``: the endpoint's default).
        sampling: the body's ``temperature``, ``top_p``, ``top_k`` (``top_k`` 0 or -1: no
            top-k filter) and penalties.
        stop: strings that end the generation (cut from the text).
        n: choices per prompt.
        logprobs: alternatives reported with each token's log-probability (chat's
            ``top_logprobs`` once ``logprobs`` is true, completions' ``logprobs``); ``None``:
            no log-probabilities.
        stop_token_ids: token ids that end the generation besides the model's end token.
        ignore_eos: the model's end token does not end the generation.
        min_tokens: no stop token or stop string ends the generation before this many tokens.
        grammar: what the output must match (``response_format`` or ``structured_outputs``;
            :mod:`blockdraft.serve.structured`), from the field ``grammar_field``.
    """

    kind: Kind
    model: str | None
    prompts: list[str | list[int]] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    return_meta_info: bool
    n: int = 1
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    grammar: GrammarSpec | None = None
    grammar_field: str = "response_format"


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
    prompts: list[str | list[int]] | None = None
    messages: list[dict[str, str]] | None = None
    limit = "max_tokens"  # the field the token limit came from
    if kind == "completion":
        prompts = _prompts(body)
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
    presence, frequency, repetition = _penalties(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _wrong_type("model", "a string", model)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    stop = _stop(body)
    n = _choices(body, len(prompts) if prompts is not None else 1)
    min_tokens = _int(body, "min_tokens") or 0
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise invalid(f"min_tokens must be in [0, max_tokens], not {min_tokens}", "min_tokens")
    grammar, grammar_field = grammar_of(body)
    return GenerationRequest(
        kind=kind, model=model, prompts=prompts, messages=messages, max_tokens=max_tokens,
        sampling=SamplingParams(temperature, top_p, top_k, presence, frequency, repetition),
        stop=stop, seed=_int(body, "seed"), stream=_bool(body, "stream"),
        include_usage=_bool(options or {}, "include_usage", "stream_options.include_usage"),
        return_meta_info=_bool(body, "return_meta_info"), n=n,
        logprobs=_logprobs(kind, body), stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos"), min_tokens=min_tokens, grammar=grammar,
        grammar_field=grammar_field,
    )


# Fields that ask for something this server does not do, per endpoint: refused (400
# "unsupported") unless absent, null, empty or the value that asks for nothing.
_UNSUPPORTED: dict[Kind, tuple[tuple[str, tuple[Any, ...]], ...]] = {
    "completion": (("echo", (False,)), ("suffix", ("",)), ("logit_bias", ({},))),
    "chat": (("logit_bias", ({},)), ("tools", ([],)), ("functions", ([],)),
             ("tool_choice", ("none", "auto")), ("function_call", ("none", "auto")),
             ("audio", ()), ("prediction", ()), ("modalities", ([], ["text"]))),
}


def _refuse_unsupported(kind: Kind, body: dict[str, Any]) -> None:
    for name, nothing in _UNSUPPORTED[kind]:
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in nothing):
            raise invalid(f"{name} is not supported", name, code="unsupported")


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """One prompt (text, or token ids) or several (a list of texts, or of token id lists)."""
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt is required", "prompt", code="missing_required_parameter")
    value = body["prompt"]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid(f"prompt must be a string, a list of token ids, a list of strings or a "
                      f"list of token id lists, not {_json_type(value)}", "prompt")
    if all(_is_int(v) for v in value):
        return [list(value)]
    texts = all(isinstance(v, str) for v in value)
    if not texts and not all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value):
        raise invalid("prompt must be a string, a list of token ids, a list of strings or a "
                      "list of non-empty token id lists", "prompt")
    if len(value) > MAX_PROMPTS:
        raise invalid(f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} per request",
                      "prompt")
    return [v if texts else list(v) for v in value]


def _penalties(body: dict[str, Any]) -> tuple[float, float, float]:
    out = []
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, 0.0)
        if not -2.0 <= value <= 2.0:
            raise invalid(f"{name} must be in [-2, 2], not {value}", name)
        out.append(value)
    repetition = _number(body, "repetition_penalty", 1.0)
    if not repetition > 0:
        raise invalid(f"repetition_penalty must be > 0 (1 = off), not {repetition}", "repetition_penalty")
    return out[0], out[1], repetition


def _choices(body: dict[str, Any], prompts: int) -> int:
    """``n``, checked against its limits and ``best_of`` (which may only equal it)."""
    n = _int(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}], not {n}", "n")
    if n * prompts > MAX_CHOICES:
        raise invalid(f"n = {n} for {prompts} prompts asks for {n * prompts} choices; at most "
                      f"{MAX_CHOICES} per request", "n")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of < n:
        raise invalid(f"best_of must be >= n = {n}, not {best_of}", "best_of")
    if best_of is not None and best_of > n:
        raise invalid(f"best_of = {best_of} > n is not supported: every choice generated is "
                      "returned", "best_of", code="unsupported")
    return n


def _logprobs(kind: Kind, body: dict[str, Any]) -> int | None:
    """How many alternatives to report with each token's log-probability (``None``: no
    log-probabilities): chat's ``top_logprobs`` once ``logprobs`` is true; completions'
    ``logprobs`` (an integer; ``top_logprobs`` belongs to chat)."""
    if kind == "chat":
        top = _int(body, "top_logprobs")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {top}", "top_logprobs")
        if not _bool(body, "logprobs"):
            if top:
                raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return top or 0
    if body.get("top_logprobs") is not None:
        raise invalid("top_logprobs is a chat field; completions take logprobs (an integer)",
                      "top_logprobs")
    value = _int(body, "logprobs")
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}], not {value}", "logprobs")
    return value


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise _wrong_type("stop_token_ids", "a list of token ids", value)
    if len(value) > MAX_STOPS:
        raise invalid(f"stop_token_ids holds {len(value)} ids; at most {MAX_STOPS}", "stop_token_ids")
    if any(v < 0 for v in value):
        raise invalid("stop_token_ids must be token ids (>= 0)", "stop_token_ids")
    return tuple(dict.fromkeys(int(v) for v in value))


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
    if len(items) > MAX_STOPS:
        raise invalid(f"stop holds {len(items)} strings; at most {MAX_STOPS}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise invalid(f"a stop string is longer than {MAX_STOP_CHARS} characters", "stop")
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


__all__ = [
    "DEFAULT_COMPLETION_TOKENS",
    "MAX_CHOICES",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MAX_TOP_LOGPROBS",
    "GenerationRequest",
    "Kind",
    "parse_json",
    "parse_request",
]
