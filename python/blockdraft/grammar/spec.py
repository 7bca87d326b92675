"""What a request's output must match: :class:`GrammarSpec`, a typed, hashable value.

A spec holds its grammar as canonical text (a JSON schema as compact JSON in its own key
order, since the order of an object's properties is the order the output writes them), so two
equal specs compile once (:mod:`blockdraft.grammar.compiler`). Building one checks its shape
only; whether the grammar itself is sound is known when it compiles.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "lark"]

KINDS: tuple[GrammarKind, ...] = ("json_object", "json_schema", "regex", "choice", "lark")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on generated text.

    Attributes:
        kind: ``"json_object"`` (any JSON object), ``"json_schema"`` (JSON that validates
            against a schema), ``"regex"`` (a regular expression, Rust ``regex`` syntax),
            ``"choice"`` (one of some strings) or ``"lark"`` (a Lark grammar in
            llguidance's dialect).
        text: the grammar as canonical text: the schema as compact JSON, the regex, the
            choices as a JSON list, the Lark source (empty for ``"json_object"``).
    """

    kind: GrammarKind
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {list(KINDS)}, not {self.kind!r}")
        if not isinstance(self.text, str):
            raise TypeError(f"grammar text must be a string, not {type(self.text).__name__}")

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> GrammarSpec:
        """JSON that validates against ``schema`` (an object, or its JSON text).

        Raises:
            ValueError: ``schema`` is not a JSON object (or JSON text of one).
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON schema must be an object, not {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the JSON schema cannot be written as JSON: {exc}") from None
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """Text that matches ``pattern`` whole.

        Raises:
            ValueError: ``pattern`` is not a non-empty string.
        """
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("a regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        """Exactly one of ``options``.

        Raises:
            ValueError: ``options`` is not a non-empty list of non-empty strings.
        """
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise ValueError("choice must be a non-empty list of strings")
        for i, opt in enumerate(options):
            if not isinstance(opt, str) or not opt:
                raise ValueError(f"choice[{i}] must be a non-empty string")
        return cls("choice", json.dumps(list(dict.fromkeys(options)), ensure_ascii=False))

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        """Text the Lark ``grammar`` (start rule ``start``) derives.

        Raises:
            ValueError: ``grammar`` is not a non-empty string.
        """
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError("a Lark grammar must be a non-empty string")
        return cls("lark", grammar)

    def lark_source(self) -> str | None:
        """The spec as Lark source for the kinds written that way (``choice``, ``lark``),
        else ``None``."""
        if self.kind == "lark":
            return self.text
        if self.kind == "choice":
            # llguidance's Lark takes JSON string literals, escapes included.
            return "start: " + " | ".join(json.dumps(o) for o in json.loads(self.text))
        return None


__all__ = ["KINDS", "GrammarKind", "GrammarSpec"]
