"""A request's grammar as the engine's mask function (:data:`blockdraft.engine.MaskFn`).

The engine asks ``mask_fn(generated)`` for the tokens allowed next: after the tokens generated
so far when it drafts, and after each prefix of the drafts when it verifies them
(``generated + drafts[:j]`` for row ``j``). Drafts the target then rejects are not part of
the output, so the next ask is shorter than, or diverges from, what the matcher consumed.
:class:`GrammarMatcher` keeps the token sequence its llguidance matcher has consumed, rolls
back to the longest prefix that sequence shares with the ask, and consumes the rest; the
mask of each prefix it has computed is kept until a rollback passes it, so the verify row
that repeats the drafting ask costs nothing.

Once the grammar is complete its mask allows the end token (and, when nothing can follow,
only the end token), so a constrained request ends at the grammar's end: the engine stops on
that token when it is among the request's stop tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from blockdraft.grammar.compiler import CompiledGrammar, GrammarCompiler, compiler_for
from blockdraft.grammar.spec import GrammarSpec

_PREFIX_TAIL = 64  # how far back from the end a divergence is looked for first
_MASKS_KEPT = 64  # masks kept, by prefix length (a few blocks' worth)


class GrammarMatcher:
    """One request's grammar state; calling it with the generated tokens returns the packed
    int32 bitmask ``[ceil(V/32)]`` of the tokens allowed next.

    Raises (on call):
        ValueError: the tokens asked about break the grammar (the engine never asks so:
            every token it keeps was chosen under the mask).
    """

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._matcher = grammar.start.deep_copy()
        self._consumed: list[int] = []
        self._fed: int | None = None  # consumed tokens fed to llguidance (None: all), the rest end tokens past a stop
        self._seen: list[int] = []  # the sequence the kept masks are for (by prefix length)
        self._masks: dict[int, Tensor] = {}
        self._words = (grammar.vocab_size + 31) // 32
        self.rollbacks = 0
        """Rollbacks made (tokens consumed ahead of the output and then rejected)."""

    @property
    def consumed(self) -> tuple[int, ...]:
        """The tokens its llguidance matcher has consumed."""
        return tuple(self._consumed)

    def is_accepting(self) -> bool:
        """Whether the consumed tokens complete the grammar."""
        return bool(self._matcher.is_accepting())

    def __call__(self, generated: Sequence[int]) -> Tensor:
        seq = list(generated)
        at = _shared_prefix(seq, self._seen)
        if at == len(seq) and at in self._masks:
            return self._masks[at]  # a prefix asked again: the matcher need not move
        self._move_to(seq)
        if at < len(seq) and at < len(self._seen):
            # A different continuation: the masks past the split were for the old one.
            del self._seen[at:]
            for length in [n for n in self._masks if n > at]:
                del self._masks[length]
        self._seen.extend(seq[len(self._seen):])
        return self._mask()

    def _move_to(self, seq: list[int]) -> None:
        """Roll the llguidance matcher back to the prefix it shares with ``seq``, then
        consume the rest of ``seq`` (nothing changes when the grammar refuses it)."""
        keep = _shared_prefix(seq, self._consumed)
        if keep < len(self._consumed):
            self._rollback(keep)
        new = seq[keep:]
        if new:
            done = self._consume(new)
            self._consumed.extend(new[:done])
            if done < len(new):
                self._rollback(keep)  # nothing of the refused ask stays consumed
                raise ValueError(f"token {new[done]} at output position {keep + done} is not "
                                 f"allowed by the {self.grammar.spec.kind} grammar")

    def _consume(self, tokens: list[int]) -> int:
        """Consume what it can of ``tokens``; returns how many it took."""
        m = self._matcher
        done = 0
        while True:
            done += m.try_consume_tokens(tokens[done:])
            if done == len(tokens):
                return done
            # A stopped grammar takes no token but its end token, which llguidance does not
            # keep in its history (a rollback would miscount it): it is kept here only.
            if not (tokens[done] in self.grammar.eos_token_ids and m.is_stopped()):
                return done
            if self._fed is None:
                self._fed = len(self._consumed) + done
            done += 1

    def _rollback(self, keep: int) -> None:
        if keep == len(self._consumed):
            return
        self.rollbacks += 1
        fed = len(self._consumed) if self._fed is None else self._fed
        if keep < fed and not self._matcher.rollback(fed - keep):
            # llguidance cannot roll back past an end token it consumed: replay instead.
            self._matcher = self.grammar.start.deep_copy()
            if keep and not self._matcher.consume_tokens(self._consumed[:keep]):
                raise ValueError(f"the grammar refused a replay: {self._matcher.get_error()}")
        del self._consumed[keep:]
        if self._fed is not None and self._fed >= keep:
            self._fed = None

    def _mask(self) -> Tensor:
        """The mask after the consumed tokens, computed and kept."""
        at = len(self._consumed)
        raw = bytearray(self._matcher.compute_bitmask())
        words = torch.frombuffer(raw, dtype=torch.int32)[: self._words]
        mask = torch.zeros(self._words, dtype=torch.int32)
        mask[: words.numel()] = words
        self._masks[at] = mask
        for old in [n for n in self._masks if n <= at - _MASKS_KEPT]:
            del self._masks[old]
        return mask


def _shared_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    # Asks share the output and part within the last block or so: look there first.
    lo = max(0, n - _PREFIX_TAIL)
    if a[:lo] != b[:lo]:
        lo = 0
    k = lo
    while a[k] == b[k]:
        k += 1
    return k


def matcher_for(grammar: GrammarSpec | CompiledGrammar, tokenizer: Any = None,
                vocab_size: int | None = None) -> GrammarMatcher:
    """A :class:`GrammarMatcher` for one request, to pass as ``grammar_bitmask_fn`` to
    :meth:`blockdraft.SpeculativeEngine.submit`.

    Args:
        grammar: a spec (compiled through :func:`~blockdraft.grammar.compiler_for` with
            ``tokenizer`` and ``vocab_size``, cached) or a grammar compiled already.
        tokenizer: the target's Hugging Face tokenizer (for a spec).
        vocab_size: the target's vocabulary (for a spec; default: the tokenizer's).

    Raises:
        ValueError: the grammar does not compile (named), or a spec without a tokenizer.
    """
    if isinstance(grammar, CompiledGrammar):
        return GrammarMatcher(grammar)
    if not isinstance(grammar, GrammarSpec):
        raise TypeError(f"grammar must be a GrammarSpec or a CompiledGrammar, not {type(grammar).__name__}")
    if tokenizer is None:
        raise ValueError("a grammar spec needs the tokenizer to compile with")
    compiler: GrammarCompiler = compiler_for(tokenizer, len(tokenizer) if vocab_size is None else vocab_size)
    return GrammarMatcher(compiler.compile(grammar))


__all__ = ["GrammarMatcher", "matcher_for"]
