"""Structured outputs: grammars (JSON schemas, regexes, choices, Lark) that constrain what a
request generates, compiled with llguidance, as the engine's per-request mask function.

Speculation stays lossless: the target's choice at every verify row is masked after the
drafts before that row, so constrained speculative output equals constrained target-only
decoding (see ``docs/design/structured-outputs.md``).

Example::

    from blockdraft.grammar import GrammarSpec, matcher_for

    spec = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    rid = engine.submit(prompt, max_new_tokens=64, stop_token_ids=[tokenizer.eos_token_id],
                        grammar_bitmask_fn=matcher_for(spec, tokenizer, vocab_size))
"""

from blockdraft.grammar.compiler import CACHE_SIZE, CompiledGrammar, GrammarCompiler, compiler_for
from blockdraft.grammar.matcher import GrammarMatcher, matcher_for
from blockdraft.grammar.spec import KINDS, GrammarKind, GrammarSpec

__all__ = ["CACHE_SIZE", "KINDS", "CompiledGrammar", "GrammarCompiler", "GrammarKind", "GrammarMatcher",
           "GrammarSpec", "compiler_for", "matcher_for"]
