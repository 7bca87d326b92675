"""The bad-input catalogue for the Rust core.

Every case runs against the same small world (a pool, a state with committed and uncommitted
rows, a second state of another owner, a freed state, raw pages, leftover plans) and asserts:
the exact exception type, a message naming the problem (each ``words`` entry is a regex that must
match), and a world snapshot identical before and after. A Rust panic would surface as pyo3's
``PanicException`` (a ``BaseException``) and fail the case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from blockdraft import (
    BlockPool,
    ConfigError,
    InvalidStateError,
    PoolExhaustedError,
    ctx_ceiling,
    ctx_window,
)
from blockdraft._core import plan_proposals
from blockdraft.core import (
    AppendPlan,
    ContextState,
    PrecomputePlan,
    propose_batch_max,
    read_ctx_cap,
    split_bands,
)

from support.core_checks import world_snapshot
from support.scorecard import expect_clear_error

ENV = "BLOCKDRAFT_DFLASH_CTX_CAP"


@dataclass
class World:
    pool: BlockPool
    state: ContextState  # positions 10..15, rows [0, 3) committed
    other: ContextState  # owner 1, positions 0..2, rows [0, 2) committed
    freed: ContextState
    raw: list[int]
    stale_plan: AppendPlan  # made for `state` before its last append
    pre_free_plan: AppendPlan  # made for `freed` before it was freed
    other_plan: AppendPlan  # valid for `other`
    resolved_plan: PrecomputePlan  # confirmed on `other`
    mp: pytest.MonkeyPatch
    keep_alive: list[object] = field(default_factory=list)  # outstanding plans made by set-ups

    def snapshot(self) -> object:
        return world_snapshot(self.pool, [self.state, self.other, self.freed])


def make_world(mp: pytest.MonkeyPatch) -> World:
    pool = BlockPool(8, 4)
    state = ContextState(pool, 8)
    state.apply_append(state.plan_append([10, 11, 12]))
    pre = state.plan_precompute()
    state.confirm_precompute(pre)
    stale = state.plan_append([20])
    state.apply_append(state.plan_append([13, 14, 15]))

    other = ContextState(pool, 6, owner=1)
    other.apply_append(other.plan_append([0, 1]))
    resolved = other.plan_precompute()
    other.confirm_precompute(resolved)
    other.apply_append(other.plan_append([2]))
    other_plan = other.plan_append([3])

    freed = ContextState(pool, 4)
    freed.apply_append(freed.plan_append([0]))
    pre_free = freed.plan_append([1])
    assert freed.free()

    raw = pool.alloc(2)
    return World(pool, state, other, freed, raw, stale, pre_free, other_plan, resolved, mp)


@dataclass(frozen=True)
class Case:
    name: str
    exc: type[BaseException]
    words: tuple[str, ...]
    # Set-up that may change the world (before the snapshot), returning the bad call.
    prepare: Callable[[World], Callable[[], object]]


def C(name: str, exc: type[BaseException], words: str | tuple[str, ...], call: Callable[[World], object]) -> Case:
    return Case(name, exc, (words,) if isinstance(words, str) else words, lambda w: lambda: call(w))


def pending_plan_then_another(w: World) -> Callable[[], object]:
    # Dropping the first plan would abort it, so the world keeps it alive.
    w.keep_alive.append(w.state.plan_precompute())
    return w.state.plan_precompute


def with_env(value: str, call: Callable[[], object]) -> Callable[[World], Callable[[], object]]:
    def prepare(w: World) -> Callable[[], object]:
        w.mp.setenv(ENV, value)
        return call

    return prepare


NEG = r"negative|-\d|>= ?0|at least|non-negative"
POS = "position"
FREED = "free"
PLAN = "plan|another state|foreign|stale|version"

CASES: list[Case] = [
    # BlockPool construction
    C("pool num_pages zero", ValueError, "num_pages", lambda w: BlockPool(0, 4)),
    C("pool num_pages negative", ValueError, "num_pages", lambda w: BlockPool(-3, 4)),
    C("pool page_size zero", ValueError, "page_size", lambda w: BlockPool(4, 0)),
    C("pool page_size negative", ValueError, "page_size", lambda w: BlockPool(4, -1)),
    C("pool num_pages str", TypeError, "num_pages", lambda w: BlockPool("4", 4)),  # type: ignore[arg-type]
    C("pool num_pages float", TypeError, "num_pages", lambda w: BlockPool(4.0, 4)),  # type: ignore[arg-type]
    C("pool page_size None", TypeError, "page_size", lambda w: BlockPool(4, None)),  # type: ignore[arg-type]
    # BlockPool.alloc / free
    C("alloc negative", ValueError, NEG, lambda w: w.pool.alloc(-1)),
    C("alloc huge", PoolExhaustedError, "exhausted", lambda w: w.pool.alloc(2**63 - 1)),
    C("alloc more than free", PoolExhaustedError, "exhausted", lambda w: w.pool.alloc(w.pool.num_free + 1)),
    C("alloc beyond 64 bits", ValueError, r"\bn\b", lambda w: w.pool.alloc(2**64)),
    C("alloc str", TypeError, r"\bn\b", lambda w: w.pool.alloc("2")),  # type: ignore[arg-type]
    C("alloc float", TypeError, r"\bn\b", lambda w: w.pool.alloc(1.5)),  # type: ignore[arg-type]
    C("alloc None", TypeError, r"\bn\b", lambda w: w.pool.alloc(None)),  # type: ignore[arg-type]
    C("free out of range", InvalidStateError, "99", lambda w: w.pool.free([w.raw[0], 99])),
    C("free negative id", InvalidStateError, "-1", lambda w: w.pool.free([w.raw[0], -1])),
    C(
        "free not allocated",
        InvalidStateError,
        "not allocated|free",
        lambda w: w.pool.free([w.raw[0], next(b for b in range(8) if not w.pool.is_allocated(b))]),
    ),
    C("free twice in one call", InvalidStateError, "twice|duplicate|more than once",
      lambda w: w.pool.free([w.raw[0], w.raw[1], w.raw[0]])),
    C("free str", TypeError, "pages", lambda w: w.pool.free("12")),  # type: ignore[arg-type]
    C("free None", TypeError, "pages", lambda w: w.pool.free(None)),  # type: ignore[arg-type]
    C("free float ids", TypeError, "pages", lambda w: w.pool.free([1.0])),  # type: ignore[list-item]
    # window policy
    C("window max_seq_len zero", ValueError, "max_seq_len", lambda w: ctx_window(0, 4)),
    C("window max_seq_len negative", ValueError, "max_seq_len", lambda w: ctx_window(-5, 4)),
    C("window block_size zero", ValueError, "block_size", lambda w: ctx_window(100, 0)),
    C("window block_size negative", ValueError, "block_size", lambda w: ctx_window(100, -1)),
    C("window budget negative", ValueError, "budget_tokens", lambda w: ctx_window(100, 4, budget_tokens=-1)),
    C("window cap negative", ValueError, "cap", lambda w: ctx_window(100, 4, cap=-1)),
    C("window max_seq_len beyond 64 bits", ValueError, "max_seq_len", lambda w: ctx_window(10**30, 4)),
    C("window max_seq_len str", TypeError, "max_seq_len", lambda w: ctx_window("100", 4)),  # type: ignore[arg-type]
    C("window max_seq_len None", TypeError, "max_seq_len", lambda w: ctx_window(None, 4)),  # type: ignore[arg-type]
    C("window block_size float", TypeError, "block_size", lambda w: ctx_window(100, 4.0)),  # type: ignore[arg-type]
    C("window budget float", TypeError, "budget_tokens", lambda w: ctx_window(100, 4, budget_tokens=1.5)),  # type: ignore[arg-type]
    C("window budget str", TypeError, "budget_tokens", lambda w: ctx_window(100, 4, budget_tokens="9")),  # type: ignore[arg-type]
    C("ceiling max_seq_len zero", ValueError, "max_seq_len", lambda w: ctx_ceiling(0)),
    C("ceiling cap negative", ValueError, "cap", lambda w: ctx_ceiling(10, cap=-2)),
    Case("env cap garbage (read)", ConfigError, (ENV,), with_env("garbage", read_ctx_cap)),
    Case("env cap negative (window)", ConfigError, (ENV,), with_env("-5", lambda: ctx_window(100, 4))),
    Case("env cap float (ceiling)", ConfigError, (ENV,), with_env("2.5", lambda: ctx_ceiling(100))),
    # ContextState construction
    C("state window zero", ValueError, "window", lambda w: ContextState(w.pool, 0)),
    C("state window negative", ValueError, "window", lambda w: ContextState(w.pool, -4)),
    C("state owner negative", ValueError, "owner", lambda w: ContextState(w.pool, 8, owner=-1)),
    C("state window str", TypeError, "window", lambda w: ContextState(w.pool, "8")),  # type: ignore[arg-type]
    C("state window float", TypeError, "window", lambda w: ContextState(w.pool, 8.0)),  # type: ignore[arg-type]
    C("state pool None", TypeError, "pool", lambda w: ContextState(None, 8)),  # type: ignore[arg-type]
    C("state pool wrong type", TypeError, "pool", lambda w: ContextState(w.state, 8)),  # type: ignore[arg-type]
    # appends
    C("append empty", ValueError, POS, lambda w: w.state.plan_append([])),
    C("append negative position", ValueError, POS, lambda w: ContextState(w.pool, 8).plan_append([-1])),
    C("append out of order", ValueError, POS, lambda w: w.state.plan_append([18, 17])),
    C("append duplicate position", ValueError, POS, lambda w: w.state.plan_append([17, 17])),
    C("append not after last", ValueError, POS, lambda w: w.state.plan_append([15])),
    C("append before last", ValueError, POS, lambda w: w.state.plan_append([3])),
    C("append more rows than window", ValueError, "window", lambda w: w.state.plan_append(list(range(16, 25)))),
    C("append str positions", TypeError, POS, lambda w: w.state.plan_append("16")),  # type: ignore[arg-type]
    C("append float position", TypeError, POS, lambda w: w.state.plan_append([16.0])),  # type: ignore[list-item]
    C("append None", TypeError, POS, lambda w: w.state.plan_append(None)),  # type: ignore[arg-type]
    C("apply foreign plan", InvalidStateError, PLAN, lambda w: w.state.apply_append(w.other_plan)),
    C("apply stale plan", InvalidStateError, PLAN, lambda w: w.state.apply_append(w.stale_plan)),
    C("apply wrong plan type", TypeError, "AppendPlan", lambda w: w.state.apply_append(w.resolved_plan)),  # type: ignore[arg-type]
    C("apply None", TypeError, "AppendPlan", lambda w: w.state.apply_append(None)),  # type: ignore[arg-type]
    # precompute
    C("confirm foreign plan", InvalidStateError, PLAN, lambda w: w.state.confirm_precompute(w.resolved_plan)),
    C("confirm resolved plan", InvalidStateError, "plan|resolved|confirmed",
      lambda w: w.other.confirm_precompute(w.resolved_plan)),
    C("confirm wrong plan type", TypeError, "PrecomputePlan", lambda w: w.state.confirm_precompute(w.other_plan)),  # type: ignore[arg-type]
    Case("precompute while one is outstanding", InvalidStateError, ("plan|outstanding|pending",),
         pending_plan_then_another),
    # proposal counters
    C("note_propose negative position", ValueError, POS, lambda w: w.state.note_propose(-1, 3)),
    C("note_propose negative drafts", ValueError, "num_drafted", lambda w: w.state.note_propose(16, -1)),
    C("note_propose position beyond 64 bits", ValueError, POS, lambda w: w.state.note_propose(2**70, 1)),
    C("note_propose str", TypeError, POS, lambda w: w.state.note_propose("16", 3)),  # type: ignore[arg-type]
    C("after_verify negative", ValueError, "num_accepted", lambda w: w.state.after_verify(-1)),
    C("after_verify more than drafted", ValueError, "num_accepted", lambda w: w.state.after_verify(1)),
    C("after_verify None", TypeError, "num_accepted", lambda w: w.state.after_verify(None)),  # type: ignore[arg-type]
    # the lifecycle: alloc, commit context, propose
    C("propose on a fresh state", InvalidStateError,
      ("^propose: ", "no committed context", "commit_ctx before propose"),
      lambda w: plan_proposals("propose", [ContextState(w.pool, 8)], [1], [0], 64, 0)),
    C("propose_batch with a fresh state", InvalidStateError, ("^propose_batch: ", "no committed context"),
      lambda w: plan_proposals("propose_batch", [w.state, ContextState(w.pool, 8)], [1, 1], [16, 0], 64, 0)),
    # use after free
    C("freed plan_append", InvalidStateError, FREED, lambda w: w.freed.plan_append([5])),
    C("freed apply_append", InvalidStateError, f"{FREED}|{PLAN}", lambda w: w.freed.apply_append(w.pre_free_plan)),
    C("freed plan_precompute", InvalidStateError, FREED, lambda w: w.freed.plan_precompute()),
    C("freed note_propose", InvalidStateError, FREED, lambda w: w.freed.note_propose(3, 2)),
    C("freed after_verify", InvalidStateError, FREED, lambda w: w.freed.after_verify(0)),
    # batch policy
    C("split_bands n zero", ValueError, r"\bn\b", lambda w: split_bands([1, 2, 3, 4], 0, 2, False)),
    C("split_bands n negative", ValueError, r"\bn\b", lambda w: split_bands([1, 2, 3, 4], -1, 2, False)),
    C("split_bands block zero", ValueError, "block", lambda w: split_bands([1, 2, 3, 4], 2, 0, False)),
    C("split_bands draft_cap zero", ValueError, "draft_cap", lambda w: split_bands([1, 2, 3, 4], 2, 2, True, 0)),
    C("split_bands tokens str", TypeError, "tokens", lambda w: split_bands("abcd", 2, 2, False)),  # type: ignore[arg-type]
    C("propose_batch_max width float", TypeError, "width", lambda w: propose_batch_max(True, 2.5, 4)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_clear_typed_error_and_changes_nothing(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    world = make_world(monkeypatch)
    call = case.prepare(world)
    before = world.snapshot()
    with expect_clear_error(case.exc, *case.words):
        call()
    assert world.snapshot() == before, f"{case.name} changed the world"
    world.pool.check_invariants()
    for st in (world.state, world.other):
        st.check_invariants()


def test_catalogue_names_are_unique() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


def test_free_id_beyond_64_bits_is_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    world = make_world(monkeypatch)
    before = world.snapshot()
    with expect_clear_error(InvalidStateError, "range"):
        world.pool.free([world.raw[0], 2**70])
    assert world.snapshot() == before
