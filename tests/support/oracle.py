"""A proposer whose drafts are mostly right: long acceptances and rejections at every offset."""

from __future__ import annotations

from typing import Any

from blockdraft.proposer import DFlashProposer, DFlashState


class OracleProposer(DFlashProposer):
    """Real drafting and bookkeeping, but the returned drafts are the target's own greedy
    continuation (``truth[i]``: prompt ``i`` and its continuation) with every third draft
    corrupted: exercises long acceptances and rejections at every offset inside a block.

    The engine allocates states in prompt order, so the ``k``-th state allocated drafts from
    ``truth[k % len(truth)]``.
    """

    def __init__(self, *args: Any, truth: list[list[int]], vocab: int = 64, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.truth = truth
        self.vocab = vocab
        self.owner_of: dict[int, int] = {}
        self.calls = 0
        self.allocs = 0

    def alloc_state_for(self, budget_tokens: int) -> DFlashState:
        st = super().alloc_state_for(budget_tokens)
        self.owner_of[id(st)] = self.allocs % len(self.truth)
        self.allocs += 1
        return st

    def _fix(self, st: DFlashState, position: int, drafts: list[int]) -> list[int]:
        seq = self.truth[self.owner_of[id(st)]]
        out = []
        for j in range(len(drafts)):
            tok = seq[position + 1 + j] if position + 1 + j < len(seq) else 0
            self.calls += 1
            out.append((tok + 1) % self.vocab if self.calls % 3 == 0 else tok)
        return out

    def propose(
        self, st: Any, last_token: int, position: int, num_drafts: int, grammar_bitmask: Any = None
    ) -> list[int]:
        return self._fix(st, position, super().propose(st, last_token, position, num_drafts, grammar_bitmask))

    def propose_batch(self, states: Any, last_tokens: Any, positions: Any, num_drafts: int) -> Any:
        got = super().propose_batch(states, last_tokens, positions, num_drafts)
        if got is None:
            return None
        return [self._fix(s, p, d) for s, p, d in zip(states, positions, got)]
