"""The structured-output fields of a request body: OpenAI's ``response_format`` and the
``structured_outputs`` extension, read into a :class:`~blockdraft.grammar.GrammarSpec`.

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema":
  {...}, "strict": ...}}`` (JSON valid against ``schema``; without one, any JSON object).
- ``structured_outputs``: an object with one of ``"json"`` (a schema, object or JSON text),
  ``"regex"``, ``"choice"`` (a list of strings), ``"grammar"`` (Lark, llguidance's dialect)
  or ``"json_object": true``.

Only the shape is checked here; a schema, regex or grammar that does not compile is found when
the handler compiles it (also a 400 naming the field).
"""

from __future__ import annotations

from typing import Any

from blockdraft.grammar.spec import GrammarSpec
from blockdraft.serve.errors import invalid

FIELDS = ("response_format", "structured_outputs")

_EXTENSION_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def grammar_of(body: dict[str, Any]) -> tuple[GrammarSpec | None, str]:
    """``(the body's grammar or None, the field it came from)``.

    Raises:
        APIError: 400 naming the field at fault (both fields given, a wrong shape).
    """
    given = [name for name in FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise invalid("give response_format or structured_outputs, not both", "structured_outputs")
    if not given:
        return None, FIELDS[0]
    name = given[0]
    value = body[name]
    try:
        spec = _response_format(value) if name == "response_format" else _extension(value)
    except ValueError as exc:
        raise invalid(f"{name}: {exc}", name) from None
    return spec, name


def _response_format(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict):
        raise ValueError("must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind != "json_schema":
        raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', not {kind!r}")
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise ValueError("json_schema must be an object holding the schema")
    name = inner.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError("json_schema.name must be a string")
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError("json_schema.strict must be a boolean")
    schema = inner.get("schema")
    if schema is None:
        return GrammarSpec.json_object()
    if not isinstance(schema, dict):
        raise ValueError("json_schema.schema must be an object")
    return GrammarSpec.json_schema(schema)


def _extension(value: Any) -> GrammarSpec:
    if not isinstance(value, dict):
        raise ValueError(f"must be an object with one of {list(_EXTENSION_KEYS)}")
    keys = [k for k in _EXTENSION_KEYS if value.get(k) is not None and value.get(k) is not False]
    if len(keys) != 1:
        raise ValueError(f"must hold exactly one of {list(_EXTENSION_KEYS)}, not {keys or 'none'}")
    key = keys[0]
    item = value[key]
    if key == "json":
        if not isinstance(item, (dict, str)):
            raise ValueError("json must be a JSON schema (an object, or its JSON text)")
        return GrammarSpec.json_schema(item)
    if key == "json_object":
        if item is not True:
            raise ValueError("json_object must be true")
        return GrammarSpec.json_object()
    if key == "regex":
        return GrammarSpec.regex(item)
    if key == "choice":
        if not isinstance(item, list):
            raise ValueError("choice must be a list of strings")
        return GrammarSpec.choice(item)
    return GrammarSpec.lark(item)


__all__ = ["FIELDS", "grammar_of"]
