"""The runtime under random interleavings of prefill, verify (any block lengths), accept k,
free and double free: the pool's invariants after every step, and the K/V a sequence keeps is
exactly its accepted tokens' (its next logits equal Hugging Face's on that history)."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from blockdraft import InvalidStateError, PoolExhaustedError, TargetRuntime

from support.runtime_models import VOCAB, make_target
from support.scorecard import expect_clear_error, score

MODEL = make_target("qwen2-sliding")  # biases, a full and two sliding layers
PAGE = 4


def hf_last_logits(tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return MODEL(torch.tensor([tokens])).logits[0, -1]


class RuntimeMachine(RuleBasedStateMachine):
    live = Bundle("live")
    freed = Bundle("freed")

    def __init__(self) -> None:
        super().__init__()
        self.rt = TargetRuntime(MODEL, num_pages=24, page_size=PAGE, max_seq_len=48, graphs="off")
        self.seqs: list[object] = []  # every sequence made, live or freed
        self.history: dict[int, list[int]] = {}  # id(seq) -> accepted tokens
        self.pending: dict[int, list[int]] = {}
        score.sequences += 1

    @rule(target=live, prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
          extra=st.integers(1, 30))
    def prefill(self, prompt: list[int], extra: int) -> object:
        try:
            seq = self.rt.new_sequence(len(prompt) + extra)
        except PoolExhaustedError:
            score.invariant_checks += 1
            return None
        last = self.rt.prefill([seq], [prompt])
        assert float((last[0] - hf_last_logits(prompt)).abs().max()) < 1e-4
        self.seqs.append(seq)
        self.history[id(seq)] = list(prompt)
        self.pending[id(seq)] = []
        score.operations += 1
        return seq

    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        seqs = [s for s in self._live()]
        if not seqs:
            return
        picks = data.draw(st.permutations(seqs).map(lambda p: p[: max(1, len(p) // 2)]))
        blocks = []
        for s in picks:
            room = s.capacity - s.length
            blocks.append(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                             max_size=max(1, min(5, room)))))
        if any(s.length + len(b) > s.capacity for s, b in zip(picks, blocks)):
            with expect_clear_error(ValueError, "capacity"):
                self.rt.forward(picks, blocks)
            return
        out = self.rt.forward(picks, blocks, logits="all")
        offset = 0
        for s, b in zip(picks, blocks):
            self.pending[id(s)] = b
            # the block's last row sees the history and the whole block
            want = hf_last_logits(self.history[id(s)] + b)
            got = out.logits[offset + len(b) - 1]
            assert float((got - want).abs().max()) < 1e-4
            offset += len(b)
        score.operations += 1
        score.invariant_checks += len(picks)

    @rule(data=st.data())
    def accept(self, data: st.DataObject) -> None:
        waiting = [s for s in self._live() if s.pending]
        if not waiting:
            return
        s = data.draw(st.sampled_from(waiting))
        k = data.draw(st.integers(0, s.pending))
        self.rt.accept([s], [k])
        self.history[id(s)] += self.pending[id(s)][:k]
        self.pending[id(s)] = []
        assert s.length == len(self.history[id(s)]) and s.pending == 0
        score.operations += 1

    @rule(target=freed, s=consumes(live))
    def free(self, s: object) -> object:
        if s is not None:
            self.rt.free([s])  # type: ignore[list-item]
        return s

    @rule(s=freed)
    def double_free_and_use_after_free(self, s: object) -> None:
        if s is None:
            return
        self.rt.free([s])  # type: ignore[list-item]
        with expect_clear_error(InvalidStateError, "freed"):
            self.rt.forward([s], [[1]])  # type: ignore[list-item]
        score.operations += 2

    def _live(self) -> list:  # type: ignore[type-arg]
        return [s for s in self.seqs if not s.freed]  # type: ignore[attr-defined]

    @invariant()
    def pool_conserved(self) -> None:
        live = self._live()
        pool = self.rt.pool
        assert pool.num_free + sum(s.num_pages for s in live) == pool.num_pages
        held = [p for s in live for p in s.pages]
        assert len(held) == len(set(held))
        for s in live:
            assert s.num_pages == -(-s.capacity // PAGE)
            assert s.length == len(self.history[id(s)]) and s.length + s.pending <= s.capacity
        pool.check_invariants()
        score.invariant_checks += 3

    def teardown(self) -> None:
        self.rt.free(self._live())
        assert self.rt.pool.num_free == self.rt.pool.num_pages


TestRuntimeMachine = RuntimeMachine.TestCase
# Each rule runs real forwards of the model and of Hugging Face's: shorter runs keep the count.
TestRuntimeMachine.settings = settings(settings.default, stateful_step_count=20)
