"""Constrained speculative generation on the built-in pair: the output equals target-only
decoding under the same grammar token for token, and it parses and validates."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

import blockdraft
from blockdraft.engine import Request
from blockdraft.grammar import GrammarSpec, matcher_for
from blockdraft.sampling import SamplingParams, allowed_ids

from support.serve_support import Pair, builtin_pair

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 10}},
            "required": ["id", "name"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False,
    },
    "enum_array": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
                                 "minItems": 1, "maxItems": 3}},
        "required": ["color", "sizes"], "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}, "ok": {"type": "boolean"}},
        "required": ["x", "ok"], "additionalProperties": False,
    },
    "patterns": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                "maxItems": 2}},
        "required": ["code", "tags"], "additionalProperties": False,
    },
}
PROMPTS = ["def parse(x):\n    return ", "import json\nconfig = ", "# settings\n"]
MAX_NEW = 64


@pytest.fixture(scope="module")
def pair() -> Pair:
    return builtin_pair()


def target_only(pair: Pair, spec: GrammarSpec, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by the target alone, each token the argmax of the allowed ones."""
    mask_fn = matcher_for(spec, pair.tokenizer, len(pair.tokenizer))
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n:
            logits = pair.target(torch.tensor([prompt + out])).logits[0, -1].float()
            allowed = allowed_ids(mask_fn(out), logits.shape[-1])
            out.append(int(torch.argmax(logits.masked_fill(~allowed, float("-inf")))))
            if out[-1] == pair.eos:
                break
    return out


def constrained(pair: Pair, spec: GrammarSpec, prompts: list[list[int]]) -> list[list[int]]:
    res = blockdraft.generate(pair.target, pair.drafter, prompts, max_new_tokens=MAX_NEW, grammar=spec,
                              tokenizer=pair.tokenizer, stop_token_ids=[pair.eos])
    return [list(t) for t in res.tokens]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_output_equals_target_only_and_validates(pair: Pair, name: str) -> None:
    spec = GrammarSpec.json_schema(SCHEMAS[name])
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
    for prompt, got in zip(prompts, constrained(pair, spec, prompts)):
        assert got == target_only(pair, spec, prompt, MAX_NEW)
        assert got[-1] == pair.eos, "the grammar's end ends the output"
        jsonschema.validate(json.loads(pair.tokenizer.decode(got[:-1])), SCHEMAS[name])


@pytest.mark.parametrize(("spec", "check"), [
    (GrammarSpec.regex(r"[0-9]{3}-[a-z]{2,4}"), lambda s: len(s) >= 6 and s[3] == "-" and s[:3].isdigit()),
    (GrammarSpec.choice(["alpha", "beta", "gamma delta"]), lambda s: s in ("alpha", "beta", "gamma delta")),
    (GrammarSpec.lark('start: "x = " NUM\nNUM: /[1-9][0-9]?/'), lambda s: s.startswith("x = ") and s[4:].isdigit()),
])
def test_regex_choice_and_lark(pair: Pair, spec: GrammarSpec, check: Any) -> None:
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS[:2]]
    for prompt, got in zip(prompts, constrained(pair, spec, prompts)):
        assert got == target_only(pair, spec, prompt, MAX_NEW)
        text = pair.tokenizer.decode(got[:-1])
        assert got[-1] == pair.eos and check(text), text


def test_grammar_and_a_mask_function_are_exclusive(pair: Pair) -> None:
    with pytest.raises(ValueError, match="grammar or grammar_bitmask_fn"):
        blockdraft.generate(pair.target, pair.drafter, [[5, 6]], max_new_tokens=4,
                            grammar=GrammarSpec.json_object(), tokenizer=pair.tokenizer,
                            grammar_bitmask_fn=lambda i, g: None)


def test_drafts_are_fitted_to_the_grammar(pair: Pair) -> None:
    """Forced tokens replace refused drafts; a refused draft where the grammar leaves a choice
    ends the drafts; a stop token ends them."""
    tok = pair.tokenizer
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"key": {"type": "integer"}},
                                    "required": ["key"], "additionalProperties": False})
    req = Request(id=0, prompt=[5], max_new_tokens=32, params=SamplingParams(), stops=frozenset({pair.eos}),
                  mask_fn=matcher_for(spec, tok, len(tok)), generator=None, submitted_at=0.0)
    want = tok.encode('{"key": 7}') + [pair.eos]
    assert req.fit_drafts(want + [pair.eos, 9]) == want  # valid drafts stay, up to the stop
    # Wrong drafts where the grammar forces every token of '{"key":' are replaced by them.
    forced = tok.encode('{"key":')
    fitted = req.fit_drafts([tok.encode("x")[0]] * (len(forced) + 1))
    assert fitted == forced, tok.decode(fitted)
    # After '{"key":' the next token is a choice (" ", " 7", ...): a refused draft there
    # ends the drafts.
    assert req.fit_drafts([*forced, tok.encode("x")[0], *tok.encode(" 7}")]) == forced


@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_sampled_output_validates(pair: Pair, sampled_drafts: bool) -> None:
    """At T = 1 (drafts greedy and fitted, or sampled and left as drawn) every output still
    follows the grammar: acceptance is against the masked target distribution."""
    schema = SCHEMAS["enum_array"]
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
    res = blockdraft.generate(pair.target, pair.drafter, prompts, max_new_tokens=MAX_NEW,
                              grammar=GrammarSpec.json_schema(schema), tokenizer=pair.tokenizer,
                              stop_token_ids=[pair.eos], sampling=SamplingParams(temperature=1.0),
                              sampled_drafts=sampled_drafts, generator=torch.Generator().manual_seed(0))
    for got in res.tokens:
        assert got[-1] == pair.eos
        jsonschema.validate(json.loads(pair.tokenizer.decode(got[:-1])), schema)
