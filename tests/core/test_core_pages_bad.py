"""The bad-input catalogue for target sequences (``SeqPages``, ``plan_forward``,
``accept_rows``, ``free_all``, ``ForwardPlan``).

Every case runs against the same small world (a sequence with committed and pending tokens, a
fresh one, one of another owner, a freed one, a drafter ``ContextState`` on the same pool, and
the forward plan that made the pending rows) and asserts the exact exception type, a message
naming the problem (each ``words`` entry is a regex that must match), and a world snapshot
identical before and after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from blockdraft import BlockPool, InvalidStateError, PoolExhaustedError
from blockdraft.core import (
    ContextState,
    ForwardPlan,
    SeqPages,
    accept_rows,
    free_all,
    plan_forward,
)

from support.core_checks import pages_snapshot, state_snapshot
from support.scorecard import expect_clear_error

OWNER = 11
OTHER = 12


@dataclass
class World:
    pool: BlockPool
    a: SeqPages  # capacity 10: 4 tokens committed, 3 pending
    b: SeqPages  # capacity 5, fresh
    other: SeqPages  # owner OTHER
    freed: SeqPages
    ctx: ContextState  # a drafter state on the same pool
    plan: ForwardPlan  # the forward that left `a`'s 3 rows pending

    def snapshot(self) -> object:
        return (
            pages_snapshot(self.pool, [self.a, self.b, self.other, self.freed]),
            state_snapshot(self.ctx),
        )


def make_world() -> World:
    pool = BlockPool(12, 4)
    a = SeqPages(pool, 10, OWNER)
    plan_forward("prefill", [a], [6], OWNER)
    a.accept(4)
    plan = plan_forward("verify", [a], [3], OWNER)
    b = SeqPages(pool, 5, OWNER)
    other = SeqPages(pool, 4, OTHER)
    freed = SeqPages(pool, 4, OWNER)
    assert freed.free()
    ctx = ContextState(pool, 8, OWNER)
    ctx.apply_append(ctx.plan_append([0, 1]))
    return World(pool, a, b, other, freed, ctx, plan)


@dataclass(frozen=True)
class Case:
    name: str
    exc: type[BaseException]
    words: tuple[str, ...]
    call: Callable[[World], object]


def C(name: str, exc: type[BaseException], words: str | tuple[str, ...], call: Callable[[World], object]) -> Case:
    return Case(name, exc, (words,) if isinstance(words, str) else words, call)


FREED = "the state was freed"
FOREIGN = ("another owner", f"owner {OTHER}, expected {OWNER}")

CASES: list[Case] = [
    # construction
    C("capacity zero", ValueError, "capacity", lambda w: SeqPages(w.pool, 0)),
    C("capacity negative", ValueError, "capacity", lambda w: SeqPages(w.pool, -3)),
    C("capacity beyond 64 bits", ValueError, "capacity", lambda w: SeqPages(w.pool, 2**70)),
    C("capacity float", TypeError, "capacity", lambda w: SeqPages(w.pool, 4.0)),  # type: ignore[arg-type]
    C("capacity str", TypeError, "capacity", lambda w: SeqPages(w.pool, "4")),  # type: ignore[arg-type]
    C("capacity None", TypeError, "capacity", lambda w: SeqPages(w.pool, None)),  # type: ignore[arg-type]
    C("owner negative", ValueError, "owner", lambda w: SeqPages(w.pool, 4, -1)),
    C("pool is a sequence", TypeError, "pool", lambda w: SeqPages(w.a, 4)),  # type: ignore[arg-type]
    C("pool None", TypeError, "pool", lambda w: SeqPages(None, 4)),  # type: ignore[arg-type]
    C("capacity past the free pages", PoolExhaustedError, ("exhausted", "7 pages requested", "6 free"),
      lambda w: SeqPages(w.pool, 25)),
    C("capacity past the whole pool", PoolExhaustedError, "exhausted", lambda w: SeqPages(w.pool, 10**6)),
    # one sequence's methods
    C("slot at the capacity", ValueError, ("^slot: ", "capacity of 10"), lambda w: w.a.slot(10)),
    C("slot negative", ValueError, "pos", lambda w: w.a.slot(-1)),
    C("slot float", TypeError, "pos", lambda w: w.a.slot(1.0)),  # type: ignore[arg-type]
    C("accept more than pending", ValueError, ("^accept: ", "4 exceeds the 3 pending"), lambda w: w.a.accept(4)),
    C("accept on nothing pending", ValueError, ("^accept: ", "exceeds the 0 pending"), lambda w: w.b.accept(1)),
    C("accept negative", ValueError, r"\bk\b", lambda w: w.a.accept(-1)),
    C("accept float", TypeError, r"\bk\b", lambda w: w.a.accept(1.0)),  # type: ignore[arg-type]
    C("free for another owner", InvalidStateError, ("^free: ", *FOREIGN), lambda w: w.other.free(OWNER)),
    C("free freed for another owner", InvalidStateError, ("^free: ", "another owner"), lambda w: w.freed.free(OTHER)),
    C("free owner negative", ValueError, "owner", lambda w: w.a.free(-1)),
    C("freed accept", InvalidStateError, f"^accept: {FREED}", lambda w: w.freed.accept(0)),
    C("freed slot", InvalidStateError, f"^slot: {FREED}", lambda w: w.freed.slot(0)),
    # plan_forward
    C("rows zero", ValueError, ("^forward: sequence 1: ", "rows", ">= 1, got 0"),
      lambda w: plan_forward("forward", [w.b, w.a], [1, 0], OWNER)),
    C("rows negative", ValueError, ("^forward: sequence 0: ", "rows", ">= 1, got -2"),
      lambda w: plan_forward("forward", [w.b], [-2], OWNER)),
    C("rows past the capacity", ValueError, ("^forward: sequence 1: ", "7 rows after 4", "capacity of 10"),
      lambda w: plan_forward("forward", [w.b, w.a], [1, 7], OWNER)),
    C("rows past the capacity of a fresh sequence", ValueError, ("sequence 0", "capacity of 5"),
      lambda w: plan_forward("forward", [w.b], [6], OWNER)),
    C("rows beyond 64 bits", ValueError, ("sequence 0", "rows", "64-bit"),
      lambda w: plan_forward("forward", [w.b], [2**64], OWNER)),
    C("rows bool", TypeError, ("^forward: sequence 1: rows", "bool"),
      lambda w: plan_forward("forward", [w.b, w.a], [1, True], OWNER)),
    C("rows float", TypeError, ("sequence 0: rows", "int"),
      lambda w: plan_forward("forward", [w.b], [1.0], OWNER)),  # type: ignore[list-item]
    C("rows str", TypeError, ("^forward: rows", "list of ints"),
      lambda w: plan_forward("forward", [w.b], "1", OWNER)),  # type: ignore[arg-type]
    C("rows None", TypeError, ("^forward: rows", "list of ints"),
      lambda w: plan_forward("forward", [w.b], None, OWNER)),  # type: ignore[arg-type]
    C("rows shorter than the sequences", ValueError, ("^forward: ", "2 sequences but 1 row counts"),
      lambda w: plan_forward("forward", [w.b, w.a], [1], OWNER)),
    C("forward twice the same", ValueError, ("^forward: sequence 2: ", "twice"),
      lambda w: plan_forward("forward", [w.b, w.a, w.b], [1, 1, 1], OWNER)),
    C("forward a ContextState", InvalidStateError, ("^forward: sequence 1: ", "ContextState", "not a SeqPages"),
      lambda w: plan_forward("forward", [w.b, w.ctx], [1, 1], OWNER)),  # type: ignore[list-item]
    C("forward a str", InvalidStateError, ("sequence 0", "not a SeqPages"),
      lambda w: plan_forward("forward", ["b"], [1], OWNER)),  # type: ignore[list-item]
    C("forward seqs not a list", TypeError, "int",
      lambda w: plan_forward("forward", 3, [1], OWNER)),  # type: ignore[arg-type]
    C("forward another owner's", InvalidStateError, ("^forward: sequence 1: ", *FOREIGN),
      lambda w: plan_forward("forward", [w.b, w.other], [1, 1], OWNER)),
    C("forward for another owner", InvalidStateError, ("sequence 0", "another owner"),
      lambda w: plan_forward("forward", [w.b], [1], OTHER)),
    C("forward freed", InvalidStateError, f"^forward: sequence 1: {FREED}",
      lambda w: plan_forward("forward", [w.b, w.freed], [1, 1], OWNER)),
    C("forward freed with a bad count", InvalidStateError, f"sequence 0: {FREED}",
      lambda w: plan_forward("forward", [w.freed], [-1], OWNER)),
    C("forward owner negative", ValueError, "owner", lambda w: plan_forward("forward", [w.b], [1], -1)),
    C("accept owner float", TypeError, "owner", lambda w: accept_rows("accept", [w.a], [0], 1.0)),  # type: ignore[arg-type]
    # accept_rows
    C("counts above pending", ValueError, ("^accept: sequence 1: ", "counts", "exceeds the 0 pending"),
      lambda w: accept_rows("accept", [w.a, w.b], [1, 1], OWNER)),
    C("counts negative", ValueError, ("^accept: sequence 0: ", "counts", ">= 0, got -1"),
      lambda w: accept_rows("accept", [w.a], [-1], OWNER)),
    C("counts bool", TypeError, ("sequence 0: counts", "bool"),
      lambda w: accept_rows("accept", [w.a], [False], OWNER)),
    C("counts longer than the sequences", ValueError, ("^accept: ", "1 sequences but 2 accept counts"),
      lambda w: accept_rows("accept", [w.a], [1, 1], OWNER)),
    C("accept twice the same", ValueError, ("^accept: sequence 1: ", "twice"),
      lambda w: accept_rows("accept", [w.a, w.a], [1, 1], OWNER)),
    C("accept a ContextState", InvalidStateError, ("^accept: sequence 0: ", "not a SeqPages"),
      lambda w: accept_rows("accept", [w.ctx], [0], OWNER)),  # type: ignore[list-item]
    C("accept another owner's", InvalidStateError, ("^accept: sequence 1: ", *FOREIGN),
      lambda w: accept_rows("accept", [w.a, w.other], [1, 0], OWNER)),
    C("accept freed", InvalidStateError, f"^accept: sequence 1: {FREED}",
      lambda w: accept_rows("accept", [w.a, w.freed], [1, 0], OWNER)),
    # free_all
    C("free_all another owner's", InvalidStateError, ("^free: sequence 2: ", *FOREIGN),
      lambda w: free_all("free", [w.a, w.b, w.other], OWNER)),
    C("free_all twice the same", ValueError, ("^free: sequence 1: ", "twice"),
      lambda w: free_all("free", [w.b, w.b], OWNER)),
    C("free_all a ContextState", InvalidStateError, ("^free: sequence 1: ", "not a SeqPages"),
      lambda w: free_all("free", [w.b, w.ctx], OWNER)),  # type: ignore[list-item]
    # the plan
    C("page_table narrower than the pages", ValueError, ("^page_table: ", "width", "2 pages"),
      lambda w: w.plan.page_table(1)),
    C("page_table width negative", ValueError, "width", lambda w: w.plan.page_table(-1)),
    C("page_table width str", TypeError, "width", lambda w: w.plan.page_table("3")),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_clear_typed_error_and_changes_nothing(case: Case) -> None:
    world = make_world()
    before = world.snapshot()
    with expect_clear_error(case.exc, *case.words):
        case.call(world)
    assert world.snapshot() == before, f"{case.name} changed the world"
    world.pool.check_invariants()
    for seq in (world.a, world.b, world.other, world.freed):
        seq.check_invariants()


def test_catalogue_names_are_unique() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


def test_the_world_is_what_the_cases_assume() -> None:
    w = make_world()
    assert (w.a.length, w.a.pending, w.a.num_pages, w.a.capacity) == (4, 3, 3, 10)
    assert (w.b.length, w.b.pending, w.b.num_pages) == (0, 0, 2)
    assert w.freed.freed and w.other.owner == OTHER
    assert w.pool.num_free == 12 - 3 - 2 - 1
    # `a` holds 3 pages; the plan's forward reads its first 7 tokens: 2 pages
    assert w.plan.max_pages == 2 and w.plan.positions == [4, 5, 6]
