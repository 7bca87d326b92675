"""Target sequences' page tables (``SeqPages``) and the whole-step calls over them
(``plan_forward`` / ``ForwardPlan``, ``accept_rows``, ``free_all``) through the binding.

A hypothesis state machine drives one pool shared by sequences of two owners against a Python
model, checking conservation, page ownership and every sequence's shape after each step (the
pages counterpart of invariants 1-3 of ``rust/blockdraft-core/src/lib.rs``), and that every
refused call changes nothing (5), frees are idempotent (6) and the pool ends full (7). The
plan is checked against a plain recomputation on random cases; ``ForwardPlan.fill`` against
``page_table`` and on the tensors it must refuse. The bad-input catalogue lives in
``test_core_pages_bad.py``; threads in ``test_core_threads.py``.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event, given
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from blockdraft import BlockPool, InvalidStateError, PoolExhaustedError
from blockdraft.core import ForwardPlan, SeqPages, accept_rows, free_all, plan_forward

from support.core_checks import assert_seq_freed, ceil_div, check_pages_world, pages_snapshot
from support.scorecard import expect_clear_error, score

OWNER = 11
OTHER = 12

# The exception a refused call raises and the patterns its message must match.
Refusal = tuple[type[BaseException], tuple[str, ...]]


@dataclass
class Model:
    """What a SeqPages must look like, updated by the rules independently of the core."""

    capacity: int
    owner: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    pending: int = 0
    freed: bool = False


@dataclass
class Expected:
    """The plan a forward must return, recomputed from the models."""

    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    q_starts: list[int] = field(default_factory=lambda: [0])
    kv_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)


def expected_plan(models: list[Model], rows: list[int], page_size: int) -> Expected:
    out = Expected()
    for m, r in zip(models, rows):
        for p in range(m.length, m.length + r):
            out.positions.append(p)
            out.slots.append(m.pages[p // page_size] * page_size + p % page_size)
        out.q_starts.append(len(out.positions))
        out.kv_lens.append(m.length + r)
        # the pages of the tokens the forward reads, not the whole reservation
        out.tables.append(list(m.pages[: -(-(m.length + r) // page_size)]))
    return out


def check_plan(plan: ForwardPlan, want: Expected, rows: list[int]) -> None:
    assert plan.positions == want.positions
    assert plan.slots == want.slots
    assert plan.q_starts == want.q_starts
    assert plan.kv_lens == want.kv_lens
    assert plan.n_rows == len(want.positions) == sum(rows)
    assert plan.max_rows == max(rows, default=0)
    widest = max((len(t) for t in want.tables), default=0)
    assert plan.max_pages == widest
    for width in (widest, widest + 2):
        table = [row[k] if k < len(row) else 0 for row in want.tables for k in range(width)]
        assert plan.page_table(width) == table
        out = torch.full((len(rows), width), -7, dtype=torch.int32)
        plan.fill(out, width)
        assert out.flatten().tolist() == table
        # without padding: each row's pages, and what the row held past them
        plan.fill(out.fill_(-7), width, pad=False)
        assert out.tolist() == [row + [-7] * (width - len(row)) for row in want.tables]
    score.invariant_checks += 10


class PagesMachine(RuleBasedStateMachine):
    live = Bundle("live")
    freed = Bundle("freed")

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.models: dict[int, Model] = {}
        self.live_seqs: list[SeqPages] = []
        self.freed_seqs: list[SeqPages] = []
        score.sequences += 1

    @property
    def the_pool(self) -> BlockPool:
        assert self.pool is not None
        return self.pool

    def snapshot(self) -> object:
        return pages_snapshot(self.the_pool, self.live_seqs + self.freed_seqs)

    def model(self, seq: SeqPages) -> Model:
        return self.models[id(seq)]

    def mark_freed(self, seq: SeqPages) -> None:
        m = self.model(seq)
        m.freed, m.pages, m.length, m.pending = True, [], 0, 0
        self.live_seqs.remove(seq)
        self.freed_seqs.append(seq)

    def call_with(self, data: st.DataObject) -> list[SeqPages]:
        """Some of the live sequences of ``OWNER`` (about half, in random order), now and then
        with one of the other owner's or one freed sequence put in at a random place."""
        mine = [s for s in self.live_seqs if self.model(s).owner == OWNER]
        picked = [s for s in mine if data.draw(st.booleans(), label="in the call")]
        seqs: list[SeqPages] = data.draw(st.permutations(picked), label="order")
        others = [s for s in self.live_seqs if self.model(s).owner != OWNER]
        for extra in (others, self.freed_seqs):
            if extra and data.draw(st.integers(0, 5), label="add one") == 0:
                one = data.draw(st.sampled_from(extra), label="which")
                at = data.draw(st.integers(0, len(seqs)), label="at")
                seqs = seqs[:at] + [one] + seqs[at:]
        return seqs

    @initialize(num_pages=st.integers(1, 32), page_size=st.integers(1, 4))
    def make_pool(self, num_pages: int, page_size: int) -> None:
        self.pool = BlockPool(num_pages, page_size)
        score.operations += 1

    @rule(target=live, capacity=st.integers(1, 14), owner=st.sampled_from([OWNER] * 4 + [OTHER]))
    def create(self, capacity: int, owner: int) -> object:
        pool = self.the_pool
        need = ceil_div(capacity, pool.page_size)
        score.operations += 1
        if need > pool.num_free:
            event("create: exhausted")
            before = self.snapshot()
            with expect_clear_error(PoolExhaustedError, "exhausted", f"{need} pages requested"):
                SeqPages(pool, capacity, owner)
            assert self.snapshot() == before
            return multiple()
        free_before = pool.num_free
        seq = SeqPages(pool, capacity, owner)
        assert (seq.capacity, seq.owner, seq.page_size) == (capacity, owner, pool.page_size)
        assert (seq.length, seq.pending, seq.freed) == (0, 0, False)
        assert seq.num_pages == need and pool.num_free == free_before - need
        self.models[id(seq)] = Model(capacity, owner, seq.pages)
        self.live_seqs.append(seq)
        return seq

    @rule(capacity=st.integers(-3, 0))
    def create_bad(self, capacity: int) -> None:
        before = self.snapshot()
        with expect_clear_error(ValueError, "capacity"):
            SeqPages(self.the_pool, capacity, OWNER)
        score.operations += 1
        assert self.snapshot() == before

    @precondition(lambda self: bool(self.live_seqs))
    @rule(data=st.data())
    def forward(self, data: st.DataObject) -> None:
        seqs = self.call_with(data)
        rows: list[int] = []
        for s in seqs:
            m = self.model(s)
            room = m.capacity - m.length
            kind = data.draw(st.sampled_from(["ok"] * 20 + ["zero", "negative", "past"]), label="rows")
            if kind == "ok" and room > 0:
                rows.append(data.draw(st.integers(1, room), label="n"))
            else:
                rows.append({"zero": 0, "negative": -1}.get(kind, room + 1))
        models = [self.model(s) for s in seqs]
        before = self.snapshot()
        score.operations += 1
        foreign = next((i for i, m in enumerate(models) if m.owner != OWNER), None)
        if foreign is not None:
            with expect_clear_error(InvalidStateError, f"^forward: sequence {foreign}: ", "another owner"):
                plan_forward("forward", seqs, rows, OWNER)
            assert self.snapshot() == before
            return
        for i, (m, r) in enumerate(zip(models, rows)):
            refused: Refusal | None = None
            if m.freed:
                refused = (InvalidStateError, (f"sequence {i}: the state was freed",))
            elif r < 1:
                refused = (ValueError, (f"sequence {i}: ", "rows", ">= 1"))
            elif m.length + r > m.capacity:
                refused = (ValueError, (f"sequence {i}: ", f"capacity of {m.capacity} tokens"))
            if refused is not None:
                event("forward: refused")
                with expect_clear_error(refused[0], *refused[1]):
                    plan_forward("forward", seqs, rows, OWNER)
                assert self.snapshot() == before
                return
        event(f"forward: {min(len(seqs), 3)}{'+' if len(seqs) >= 3 else ''} sequences")
        want = expected_plan(models, rows, self.the_pool.page_size)
        pool_before = pages_snapshot(self.the_pool)
        plan = plan_forward("forward", seqs, rows, OWNER)
        assert pages_snapshot(self.the_pool) == pool_before, "a forward took or gave pages"
        check_plan(plan, want, rows)
        for m, r in zip(models, rows):
            m.pending = r

    @precondition(lambda self: bool(self.live_seqs))
    @rule(data=st.data())
    def accept(self, data: st.DataObject) -> None:
        seqs = self.call_with(data)
        models = [self.model(s) for s in seqs]
        counts = []
        for m in models:
            kind = data.draw(st.sampled_from(["ok"] * 20 + ["over", "negative"]), label="count")
            if kind == "ok":
                counts.append(data.draw(st.integers(0, m.pending), label="k"))
            else:
                counts.append(m.pending + 1 if kind == "over" else -1)
        before = self.snapshot()
        score.operations += 1
        refused: Refusal | None = None
        foreign = next((i for i, m in enumerate(models) if m.owner != OWNER), None)
        if foreign is not None:
            refused = (InvalidStateError, (f"sequence {foreign}: ", "another owner"))
        else:
            for i, (m, k) in enumerate(zip(models, counts)):
                if m.freed:
                    refused = (InvalidStateError, (f"sequence {i}: the state was freed",))
                elif k < 0:
                    refused = (ValueError, (f"sequence {i}: ", "counts", ">= 0"))
                elif k > m.pending:
                    refused = (ValueError, (f"sequence {i}: ", f"exceeds the {m.pending} pending"))
                if refused is not None:
                    break
        if refused is not None:
            event("accept: refused")
            with expect_clear_error(refused[0], *refused[1]):
                accept_rows("accept", seqs, counts, OWNER)
            assert self.snapshot() == before
            return
        if len(seqs) == 1 and data.draw(st.booleans(), label="method"):
            seqs[0].accept(counts[0])
        else:
            accept_rows("accept", seqs, counts, OWNER)
        for m, k in zip(models, counts):
            m.length += k
            m.pending = 0

    @rule(seq=live, pos=st.integers(0, 30))
    def slot(self, seq: SeqPages, pos: int) -> None:
        m = self.model(seq)
        ps = self.the_pool.page_size
        score.operations += 1
        if pos >= m.capacity:
            with expect_clear_error(ValueError, "^slot: ", f"capacity of {m.capacity}"):
                seq.slot(pos)
        else:
            assert seq.slot(pos) == m.pages[pos // ps] * ps + pos % ps

    @rule(seq=live, call=st.sampled_from(["forward", "accept", "free_all"]))
    def duplicate_in_call(self, seq: SeqPages, call: str) -> None:
        before = self.snapshot()
        with expect_clear_error(ValueError, f"^{call}: sequence 1: ", "twice"):
            if call == "forward":
                plan_forward(call, [seq, seq], [1, 1], self.model(seq).owner)
            elif call == "accept":
                accept_rows(call, [seq, seq], [0, 0], self.model(seq).owner)
            else:
                free_all(call, [seq, seq], self.model(seq).owner)
        score.operations += 1
        assert self.snapshot() == before

    @rule(seq=live, call=st.sampled_from(["forward", "accept", "free_all", "free"]))
    def another_owner(self, seq: SeqPages, call: str) -> None:
        m = self.model(seq)
        wrong = OTHER if m.owner == OWNER else OWNER
        words = ("another owner", f"owner {m.owner}, expected {wrong}")
        before = self.snapshot()
        with expect_clear_error(InvalidStateError, f"^{call}: ", *words):
            if call == "forward":
                plan_forward(call, [seq], [1], wrong)
            elif call == "accept":
                accept_rows(call, [seq], [0], wrong)
            elif call == "free_all":
                free_all(call, [seq], wrong)
            else:
                seq.free(wrong)
        score.operations += 1
        assert self.snapshot() == before

    @rule(target=freed, seq=consumes(live), with_owner=st.booleans())
    def free(self, seq: SeqPages, with_owner: bool) -> SeqPages:
        pool = self.the_pool
        held = seq.pages
        free_before = pool.num_free
        assert seq.free(self.model(seq).owner if with_owner else None) is True
        score.operations += 1
        assert pool.num_free == free_before + len(held)
        assert not any(pool.is_allocated(b) for b in held)
        assert (seq.capacity, seq.owner) == (self.model(seq).capacity, self.model(seq).owner)
        assert_seq_freed(seq)
        self.mark_freed(seq)
        return seq

    @precondition(lambda self: bool(self.live_seqs))
    @rule(target=freed, data=st.data())
    def free_everything(self, data: st.DataObject) -> object:
        """``free_all`` per owner over live sequences taken out of the bundle, with some freed
        ones in the call (skipped)."""
        pool = self.the_pool
        n = data.draw(st.integers(1, min(4, len(self.live_seqs))), label="live ones")
        seqs: list[SeqPages] = [data.draw(consumes(PagesMachine.live)) for _ in range(n)]
        again = data.draw(st.lists(st.sampled_from(self.freed_seqs), max_size=2, unique=True)
                          if self.freed_seqs else st.just([]), label="freed ones")
        score.operations += 1
        for owner in (OWNER, OTHER):
            mine = [s for s in seqs if self.model(s).owner == owner]
            call = mine + [s for s in again if self.model(s).owner == owner]
            held = sum(len(s.pages) for s in mine)
            free_before = pool.num_free
            assert free_all("free", call, owner) == len(mine)
            assert pool.num_free == free_before + held
            for s in mine:
                assert_seq_freed(s)
                self.mark_freed(s)
        return multiple(*seqs)

    @rule(seq=freed)
    def double_free(self, seq: SeqPages) -> None:
        before = self.snapshot()
        assert seq.free() is False
        assert seq.free(self.model(seq).owner) is False
        assert free_all("free", [seq], self.model(seq).owner) == 0
        score.operations += 3
        assert self.snapshot() == before
        assert_seq_freed(seq)

    @rule(seq=freed, op=st.sampled_from(["accept", "slot", "forward", "accept_rows", "foreign free"]))
    def use_after_free(self, seq: SeqPages, op: str) -> None:
        owner = self.model(seq).owner
        before = self.snapshot()
        if op == "foreign free":
            # The owner is checked on a freed sequence too.
            with expect_clear_error(InvalidStateError, "^free: ", "another owner"):
                seq.free(owner + 100)
        else:
            with expect_clear_error(InvalidStateError, f"^{op.split('_')[0]}: ", "the state was freed"):
                if op == "accept":
                    seq.accept(0)
                elif op == "slot":
                    seq.slot(0)
                elif op == "forward":
                    plan_forward("forward", [seq], [1], owner)
                else:
                    accept_rows("accept", [seq], [0], owner)
        score.operations += 1
        assert self.snapshot() == before

    @invariant()
    def pool_and_sequences_consistent(self) -> None:
        if self.pool is None:
            return
        check_pages_world(self.pool, self.live_seqs)

    @invariant()
    def sequences_match_model(self) -> None:
        for seq in self.live_seqs:
            m = self.model(seq)
            assert seq.pages == m.pages, "a live page table changed"
            assert (seq.length, seq.pending, seq.freed) == (m.length, m.pending, False)
            assert (seq.capacity, seq.owner) == (m.capacity, m.owner)
            score.invariant_checks += 1
        for seq in self.freed_seqs:
            assert seq.freed and seq.pages == [] and seq.length == seq.pending == 0
            score.invariant_checks += 1

    def teardown(self) -> None:
        if self.pool is None:
            return
        for seq in list(self.live_seqs):
            assert seq.free() is True
            self.mark_freed(seq)
        # With every sequence freed the pool is exactly full again.
        assert self.pool.num_free == self.pool.num_pages and self.pool.num_used == 0
        self.pool.check_invariants()
        for seq in self.freed_seqs:
            assert_seq_freed(seq)
        score.invariant_checks += 1


TestPagesMachine = PagesMachine.TestCase


seq_cases = st.lists(
    st.tuples(st.integers(1, 40), st.floats(0, 1), st.integers(1, 12), st.integers(0, 2)),
    max_size=6,
)


@given(cases=seq_cases, page_size=st.integers(1, 8))
def test_forward_plan_equals_a_recomputation(
    cases: list[tuple[int, float, int, int]], page_size: int
) -> None:
    """Sequences with committed tokens, on pages interleaved with someone else's blocks, and a
    forward over each: every field of the plan as plain Python computes it."""
    pool = BlockPool(sum(ceil_div(c, page_size) + gap for c, _, _, gap in cases) + 1, page_size)
    seqs, models, rows, raw = [], [], [], []
    for capacity, frac, want_rows, gap in cases:
        raw += pool.alloc(gap)
        seq = SeqPages(pool, capacity, OWNER)
        m = Model(capacity, OWNER, seq.pages)
        committed = int(frac * (capacity - 1))
        if committed:
            plan_forward("prefill", [seq], [committed], OWNER)
            seq.accept(committed)
            m.length = committed
        seqs.append(seq)
        models.append(m)
        rows.append(min(want_rows, capacity - committed))
    want = expected_plan(models, rows, page_size)
    check_plan(plan_forward("forward", seqs, rows, OWNER), want, rows)
    assert [s.pending for s in seqs] == rows
    assert [s.length for s in seqs] == [m.length for m in models]
    check_pages_world(pool, seqs, raw)
    assert free_all("free", seqs, OWNER) == len(seqs)
    pool.free(raw)
    assert pool.num_free == pool.num_pages
    score.sequences += 1
    score.operations += 2 + len(seqs)


def test_a_rejected_draft_is_overwritten_by_the_next_forward() -> None:
    pool = BlockPool(8, 4)
    seq = SeqPages(pool, 16, OWNER)
    draft = plan_forward("verify", [seq], [5], OWNER)
    seq.accept(2)
    retry = plan_forward("verify", [seq], [3], OWNER)
    # the rows after the two accepted ones reuse the rejected rows' slots
    assert retry.positions == [2, 3, 4] and retry.slots == draft.slots[2:5]
    assert retry.kv_lens == [5] and (seq.length, seq.pending) == (2, 3)
    # a forward with rows pending replaces them
    decode = plan_forward("decode", [seq], [1], OWNER)
    assert decode.slots == [draft.slots[2]] and seq.pending == 1
    seq.accept(1)
    assert (seq.length, seq.pending) == (3, 0)


def test_an_empty_call_is_an_empty_plan() -> None:
    plan = plan_forward("forward", [], [], OWNER)
    assert (plan.n_rows, plan.positions, plan.q_starts, plan.kv_lens) == (0, [], [0], [])
    assert (plan.max_rows, plan.max_pages, plan.page_table(0)) == (0, 0, [])
    plan.fill(torch.empty((0, 1), dtype=torch.int32), 1)
    accept_rows("accept", [], [], OWNER)
    assert free_all("free", (), OWNER) == 0


def test_an_unfreed_sequence_returns_its_pages_when_dropped() -> None:
    pool = BlockPool(6, 2)
    seq = SeqPages(pool, 9, OWNER)
    plan_forward("forward", [seq], [4], OWNER)
    assert pool.num_free == 1
    del seq
    gc.collect()
    assert pool.num_free == 6
    pool.check_invariants()


def three_sequence_plan() -> tuple[ForwardPlan, BlockPool, list[SeqPages]]:
    pool = BlockPool(12, 2)
    seqs = [SeqPages(pool, c, OWNER) for c in (5, 2, 7)]
    return plan_forward("forward", seqs, [1, 2, 7], OWNER), pool, seqs


def test_fill_writes_the_page_table_into_a_view() -> None:
    plan, _, seqs = three_sequence_plan()
    assert plan.max_pages == 4
    big = torch.full((5, 4), -1, dtype=torch.int32)
    view = big[1:4]  # contiguous, at an offset into its storage
    plan.fill(view, 4)
    assert view.flatten().tolist() == plan.page_table(4)
    assert big[0].tolist() == [-1] * 4 and big[4].tolist() == [-1] * 4
    assert view[1].tolist() == seqs[1].pages + [0, 0, 0]
    # the first sequence holds three pages; its one token's forward reads the first only
    assert view[0].tolist() == seqs[0].pages[:1] + [0, 0, 0]
    score.invariant_checks += 4


def refused_tensors(n: int, width: int) -> list[tuple[str, torch.Tensor]]:
    int32 = torch.int32
    sparse = torch.zeros((n, width), dtype=int32).to_sparse()
    return [
        ("int64", torch.full((n, width), -1, dtype=torch.int64)),
        ("float32", torch.full((n, width), -1.0)),
        ("one row short", torch.full((n - 1, width), -1, dtype=int32)),
        ("one column more", torch.full((n, width + 1), -1, dtype=int32)),
        ("flat", torch.full((n * width,), -1, dtype=int32)),
        ("transposed", torch.full((width, n), -1, dtype=int32).t()),
        ("strided rows", torch.full((n, 2 * width), -1, dtype=int32)[:, ::2]),
        ("sparse", sparse),
        ("meta", torch.empty((n, width), dtype=int32, device="meta")),
    ]


def test_fill_refuses_other_tensors_and_writes_nothing() -> None:
    plan, _, _ = three_sequence_plan()
    for name, bad in refused_tensors(3, 4):
        readable = bad.layout == torch.strided and bad.device.type == "cpu"
        keep = bad.clone() if readable else None
        with expect_clear_error(ValueError, "^fill: ", "contiguous CPU int32 tensor", r"\[3, 4\]"):
            plan.fill(bad, 4)
        if keep is not None:
            assert torch.equal(bad, keep), f"{name}: a refused fill wrote"
    # not a tensor, or a subclass (whose data pointer need not be real storage)
    param = torch.nn.Parameter(torch.zeros((3, 4), dtype=torch.int32), requires_grad=False)
    for bad_obj in ([[0] * 4] * 3, param):
        with expect_clear_error(TypeError, "^fill: ", "torch.Tensor"):
            plan.fill(bad_obj, 4)
    assert not param.any()
    # the right tensor but a width below the widest sequence's pages: untouched
    narrow = torch.full((3, 3), -1, dtype=torch.int32)
    with expect_clear_error(ValueError, "^fill: ", "width", "4 pages"):
        plan.fill(narrow, 3)
    assert (narrow == -1).all()
    with expect_clear_error(ValueError, "^page_table: ", "width"):
        plan.page_table(3)
    with expect_clear_error(ValueError, "width"):
        plan.fill(narrow, -1)


@pytest.mark.parametrize("width", [4, 5, 9])
def test_fill_equals_page_table(width: int) -> None:
    plan, _, _ = three_sequence_plan()
    out = torch.full((3, width), -3, dtype=torch.int32)
    plan.fill(out, width)
    assert out.flatten().tolist() == plan.page_table(width)
    score.invariant_checks += 1
