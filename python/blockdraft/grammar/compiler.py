"""Grammars compiled with llguidance for one tokenizer and vocabulary.

Turning a tokenizer into an :class:`llguidance.LLTokenizer` takes its whole vocabulary, so it
happens once per tokenizer and vocabulary size (:func:`compiler_for` keeps one
:class:`GrammarCompiler` each). A compiler keeps its last :data:`CACHE_SIZE` compiled grammars
by spec, so a server that sees one schema many times compiles it once. Compiling a large
grammar can take a while (llguidance releases the GIL meanwhile): a server compiles in its
request handler, never inside the engine's step.

The target's vocabulary may be larger than the tokenizer's (padded heads): the llguidance
tokenizer is built with the target's size and the ids past the tokenizer's are never allowed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf

from blockdraft.grammar.spec import GrammarSpec

log = logging.getLogger(__name__)

CACHE_SIZE = 64
"""Compiled grammars a :class:`GrammarCompiler` keeps (least recently used leaves first)."""

_COMPILERS_KEPT = 4


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar ready to constrain requests: a matcher in its start state, copied for each
    request (:func:`~blockdraft.grammar.matcher_for`).

    Attributes:
        spec: what it was compiled from.
        vocab_size: the vocabulary its masks cover (``ceil(vocab_size / 32)`` words).
        eos_token_ids: the end tokens the grammar allows once complete.
    """

    spec: GrammarSpec
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    start: llguidance.LLMatcher

    def __reduce__(self) -> Any:
        # The matcher inside is native state that cannot travel to another process.
        raise TypeError("a CompiledGrammar cannot be pickled; send its spec and compile it there")


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` values for one tokenizer and vocabulary, keeping the
    last :data:`CACHE_SIZE` (thread-safe).

    Args:
        tokenizer: a fast Hugging Face tokenizer (``PreTrainedTokenizerFast`` or
            transformers' ``TokenizersBackend``).
        vocab_size: the target's vocabulary (at least the tokenizer's).

    Raises:
        ValueError: a tokenizer llguidance cannot read (not a fast one), or a bad
            ``vocab_size``.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, not {vocab_size!r}")
        size = len(tokenizer)
        if vocab_size < size:
            raise ValueError(f"vocab_size ({vocab_size}) is smaller than the tokenizer's "
                             f"vocabulary ({size})")
        eos = getattr(tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise ValueError("the tokenizer has no eos_token_id: a grammar needs an end token")
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError as exc:
            raise ValueError(f"llguidance cannot read this tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        self.eos_token_ids = (eos,)
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled (from the cache when it was compiled before).

        Raises:
            ValueError: the grammar is not sound (an invalid schema, regex or Lark grammar),
                with llguidance's message.
        """
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"compile takes a GrammarSpec, not {type(spec).__name__}")
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def cached(self) -> int:
        """How many compiled grammars it keeps now."""
        with self._lock:
            return len(self._cache)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar = _llguidance_grammar(spec)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise ValueError(f"invalid {_NAMES[spec.kind]}: {messages[0].strip()}")
        for warning in messages:
            log.debug("grammar %s: %s", spec.kind, warning)
        start = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if start.is_error():
            raise ValueError(f"invalid {_NAMES[spec.kind]}: {start.get_error()}")
        return CompiledGrammar(spec, self.vocab_size, self.eos_token_ids, start)


_NAMES = {"json_object": "JSON object grammar", "json_schema": "JSON schema", "regex": "regex",
          "choice": "choice", "lark": "Lark grammar"}


def _json_grammar(schema: str | dict[str, Any]) -> str:
    # JSON is written on one line, separated as Python's json.dumps does: flexible whitespace
    # lets a model write newlines and indentation without end (a schema's own "x-guidance"
    # options win over these).
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})


def _llguidance_grammar(spec: GrammarSpec) -> str:
    if spec.kind == "json_object":
        return _json_grammar({"type": "object"})
    if spec.kind == "json_schema":
        try:
            return _json_grammar(spec.text)
        except ValueError as exc:
            raise ValueError(f"invalid JSON schema: {exc}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    lark = spec.lark_source()
    assert lark is not None
    return llguidance.LLMatcher.grammar_from_lark(lark)


_compilers: OrderedDict[tuple[int, int], tuple[Any, GrammarCompiler]] = OrderedDict()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The :class:`GrammarCompiler` of ``tokenizer`` and ``vocab_size``, built on first use
    and kept for the last few tokenizers.

    Raises:
        ValueError: as :class:`GrammarCompiler`.
    """
    key = (id(tokenizer), vocab_size)
    with _compilers_lock:
        hit = _compilers.get(key)
        # The entry holds the tokenizer, so its id cannot be reused while it is kept.
        if hit is not None and hit[0] is tokenizer:
            _compilers.move_to_end(key)
            return hit[1]
    compiler = GrammarCompiler(tokenizer, vocab_size)
    with _compilers_lock:
        _compilers[key] = (tokenizer, compiler)
        while len(_compilers) > _COMPILERS_KEPT:
            _compilers.popitem(last=False)
    return compiler


__all__ = ["CACHE_SIZE", "CompiledGrammar", "GrammarCompiler", "compiler_for"]
