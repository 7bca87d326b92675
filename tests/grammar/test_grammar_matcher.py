"""The grammar matcher against a fresh matcher replaying each asked prefix; specs, compile
errors and the compile cache; the masks of a padded vocabulary and of a finished grammar."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdraft.grammar import GrammarCompiler, GrammarSpec, compiler_for, matcher_for
from blockdraft.sampling import allowed_ids

from support.scorecard import expect_clear_error
from support.serve_support import builtin_pair

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "cd"]}},
    },
    "required": ["name", "n"],
}
# Valid documents that share prefixes and part at different points, so asks that move between
# them roll back to their common prefix.
DOCS = [
    '{"name": "abc", "n": 12, "tags": ["a", "cd"]}',
    '{"name": "abd", "n": 12}',
    '{"name": "abc", "n": 1234, "tags": []}',
    '{"name": "x", "n": -5, "tags": ["b", "b", "a"]}',
    '{"name": "abd", "n": 0, "tags": ["cd"]}',
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return builtin_pair().tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return compiler_for(tokenizer, len(tokenizer))


def replayed(compiler: GrammarCompiler, spec: GrammarSpec, tokens: list[int]) -> torch.Tensor:
    """The mask after ``tokens`` from a matcher that never rolled back."""
    return matcher_for(compiler.compile(spec))(tokens)


@settings(max_examples=60)
@given(asks=st.lists(st.tuples(st.integers(0, len(DOCS) - 1), st.floats(0, 1), st.booleans()),
                     min_size=1, max_size=12))
def test_rollback_equals_a_fresh_replay(compiler: GrammarCompiler, tokenizer: Any,
                                        asks: list[tuple[int, float, bool]]) -> None:
    """Random asks as the engine makes them (longer: drafts consumed; shorter or diverging:
    drafts rejected), some past the grammar's end token, each against a fresh matcher."""
    spec = GrammarSpec.json_schema(SCHEMA)
    docs = [list(tokenizer.encode(d)) + [tokenizer.eos_token_id] for d in DOCS]
    m = matcher_for(compiler.compile(spec))
    for doc, frac, bad in asks:
        tokens = docs[doc][: round(frac * len(docs[doc]))]
        if bad and len(tokens) < len(docs[doc]) - 1:
            # A token no grammar position allows (a special token): refused, and the matcher
            # goes on as if it had not been asked.
            wrong = tokenizer.convert_tokens_to_ids("<|mask|>")
            with pytest.raises(ValueError, match="not allowed by the json_schema grammar"):
                m([*tokens, wrong])
        assert torch.equal(m(tokens), replayed(compiler, spec, tokens)), (doc, tokens)


def test_a_diverging_ask_rolls_back_and_a_kept_prefix_does_not(compiler: GrammarCompiler,
                                                                tokenizer: Any) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    a, b = (list(tokenizer.encode(d)) for d in DOCS[:2])
    m = matcher_for(compiler.compile(spec))
    for k in range(len(a) + 1):  # as drafts are fitted, one prefix after the other
        m(a[:k])
    # As verification asks the same prefixes again: kept masks, no move.
    assert torch.equal(m(a[:3]), replayed(compiler, spec, a[:3])) and m.rollbacks == 0
    assert torch.equal(m(b), replayed(compiler, spec, b)) and m.rollbacks == 1
    assert m.consumed == tuple(b)


def test_masks_follow_the_grammar(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = matcher_for(compiler.compile(GrammarSpec.choice(["yes", "no"])))
    first = allowed_ids(m([]), compiler.vocab_size)
    texts = {tokenizer.decode([t]) for t in first.nonzero().flatten().tolist()}
    assert texts and all("yes".startswith(s) or "no".startswith(s) for s in texts)
    done = allowed_ids(m(tokenizer.encode("yes")), compiler.vocab_size)
    # Complete, and nothing can follow: only the end token.
    assert done.nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert m.is_accepting()


def test_a_padded_vocabulary_never_allows_the_extra_ids(tokenizer: Any) -> None:
    size = len(tokenizer)
    padded = compiler_for(tokenizer, size + 40)
    mask = matcher_for(padded.compile(GrammarSpec.regex(r"[a-z ]+")))([])
    assert mask.shape == ((size + 40 + 31) // 32,) and mask.dtype == torch.int32
    allowed = allowed_ids(mask, size + 40)
    assert allowed[:size].any() and not allowed[size:].any()


def test_compiled_once_per_spec(compiler: GrammarCompiler) -> None:
    a = compiler.compile(GrammarSpec.json_schema({"type": "object", "properties": {"q": {"type": "string"}}}))
    b = compiler.compile(GrammarSpec.json_schema('{"type": "object", "properties": {"q": {"type": "string"}}}'))
    assert a is b
    # Property order is part of the spec (the output writes properties in that order).
    c = compiler.compile(GrammarSpec.json_schema({"properties": {"q": {"type": "string"}}, "type": "object"}))
    assert c is not a


@pytest.mark.parametrize(("spec", "words"), [
    (lambda: GrammarSpec.json_schema({"type": "integr"}), ("invalid JSON schema", "integr")),
    (lambda: GrammarSpec.json_schema({"type": "string", "pattern": "a("}), ("invalid JSON schema", "unclosed")),
    (lambda: GrammarSpec.regex("a("), ("invalid regex", "unclosed group")),
    (lambda: GrammarSpec.lark("start: missing"), ("invalid Lark grammar", "missing")),
])
def test_compile_errors_name_what_is_wrong(compiler: GrammarCompiler, spec: Any, words: tuple[str, ...]) -> None:
    with expect_clear_error(ValueError, *words):
        compiler.compile(spec())


@pytest.mark.parametrize(("make", "words"), [
    (lambda: GrammarSpec.json_schema("[1, 2]"), ("must be an object",)),
    (lambda: GrammarSpec.json_schema("{not json"), ("not valid JSON",)),
    (lambda: GrammarSpec.choice([]), ("non-empty list",)),
    (lambda: GrammarSpec.choice(["a", ""]), ("choice.1. must be a non-empty string",)),
    (lambda: GrammarSpec.regex(""), ("regex",)),
    (lambda: GrammarSpec("xml", "<a/>"), ("grammar kind", "xml")),  # type: ignore[arg-type]
])
def test_bad_specs_are_refused(make: Any, words: tuple[str, ...]) -> None:
    with expect_clear_error(ValueError, *words):
        make()


def test_choice_escapes_quotes(compiler: GrammarCompiler, tokenizer: Any) -> None:
    spec = GrammarSpec.choice(['say "hi"', "a\\b"])
    assert json.loads(spec.text) == ['say "hi"', "a\\b"]
    m = matcher_for(compiler.compile(spec))
    done = allowed_ids(m(tokenizer.encode('say "hi"')), compiler.vocab_size)
    assert done.nonzero().flatten().tolist() == [tokenizer.eos_token_id]
