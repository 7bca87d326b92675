"""DFlashProposer: every behaviour of the proposer contract (docs/design/dflash.md; torch backend,
tiny random pair, CPU)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import pytest
import torch

import blockdraft.proposer.proposer as proposer_mod
from blockdraft import BlockPool, ConfigError, InvalidStateError, PoolExhaustedError
from blockdraft.levers import Levers
from blockdraft.proposer import DFlashProposer, DFlashState

from support.scorecard import expect_clear_error, score
from support.tinypair import K_H, drafter_config, make_proposer, tiny_drafter, tiny_target


def make(drafter: Any, target: Any, **kw: Any) -> DFlashProposer:
    prop: DFlashProposer = make_proposer(drafter, target, **kw)
    return prop


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, K_H, generator=torch.Generator().manual_seed(seed))


def snapshot(prop: DFlashProposer, states: list[DFlashState]) -> Any:
    return (
        prop.pool.num_free,
        [
            (
                s.ctx_len,
                s.ctx_committed,
                s.ctx_positions,
                s.page_table,
                s.last_num_drafted,
                s.seq_len,
                s.prefill_done,
                None if s.acc is None else s.acc.clone(),
            )
            for s in states
        ],
    )


def same(a: Any, b: Any) -> bool:
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    for x, y in zip(a[1], b[1]):
        if x[:-1] != y[:-1]:
            return False
        if (x[-1] is None) != (y[-1] is None) or (x[-1] is not None and not torch.equal(x[-1], y[-1])):
            return False
    return True


def filled(prop: DFlashProposer, n_rows: int, seed: int, budget: int | None = None) -> DFlashState:
    st = prop.alloc_state() if budget is None else prop.alloc_state_for(budget)
    prop.commit_ctx(st, rows(n_rows, seed), range(n_rows))
    return st


def test_window_cap_env_and_budget(drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_CTX_CAP", "100")
    prop = make(drafter, target, max_seq_len=200)
    assert prop.alloc_state().window == 100
    assert prop.alloc_state_for(10).window == 10 + prop.block_gamma + 1
    assert prop.alloc_state_for(10_000).window == 100
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_CTX_CAP", "0")
    assert make(drafter, target, max_seq_len=200).alloc_state().window == 200
    monkeypatch.delenv("BLOCKDRAFT_DFLASH_CTX_CAP")
    assert make(drafter, target, max_seq_len=20_000).alloc_state().window == 16384
    with expect_clear_error(ValueError, "budget"):
        prop.alloc_state_for(-1)


def test_cap_logged_once_per_process_with_mb(
    drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(proposer_mod, "_cap_logged", False)
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_CTX_CAP", "64")
    caplog.set_level(logging.INFO, logger="blockdraft.proposer")
    for _ in range(2):
        prop = make(drafter, target, max_seq_len=100_000)
        prop.alloc_state()
        prop.alloc_state_for(5)
    lines = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert len(lines) == 1
    slot = prop.ctx_slot_bytes
    assert slot == K_H * 4  # fp32 accumulator in these tests
    assert f"({64 * slot // 2**20} MB/seq instead of {100_000 * slot // 2**20} MB)" in lines[0]
    # Uncapped serve: nothing to say.
    monkeypatch.setattr(proposer_mod, "_cap_logged", False)
    caplog.clear()
    make(drafter, target, max_seq_len=50).alloc_state()
    assert not [r for r in caplog.records if "capped" in r.getMessage()]


def test_accumulator_zeroed_and_sized(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    st = filled(prop, 9, 0)
    prop.free_state(st)
    again = prop.alloc_state_for(30)
    assert again.acc is not None
    assert again.acc.shape == (30 + prop.block_gamma + 1, K_H)
    assert bool((again.acc == 0).all())


@pytest.mark.parametrize(("slide", "room"), [(None, 1), ("0", 0), ("0.5", 4)])
def test_commit_slides_keeping_newest_rows(
    drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch, slide: str | None, room: int
) -> None:
    """A slide keeps the newest rows and leaves ``floor(window * BLOCKDRAFT_DFLASH_SLIDE)``
    rows free beyond the commit's (default 1/8)."""
    if slide is not None:
        monkeypatch.setenv("BLOCKDRAFT_DFLASH_SLIDE", slide)
    prop = make(drafter, target)
    st = prop.alloc_state_for(3)  # window = 3 + B + 1 = 8 rows
    assert (st.window, st.ctx.slide_room) == (8, room)
    data = rows(20, 1)
    prop.commit_ctx(st, data[:6], range(6))
    prop.propose(st, 3, 6, 2)
    assert st.ctx_committed == 6 and st.page_table
    prop.commit_ctx(st, data[6:11], range(6, 11))  # 11 rows > 8: slide
    assert st.ctx_committed == 0
    assert st.page_table == []  # pages back; K/V is recomputed by the next propose
    # The newest rows that leave `room` free, but never fewer than the commit's own 5.
    first = 11 - max(8 - room, 5)
    assert st.ctx_positions == list(range(first, 11))
    assert st.acc is not None and torch.equal(st.acc[: 11 - first], data[first:11])
    # The free rows take that many more commits before the next slide.
    end = 11 + 8 - (11 - first)
    for p in range(11, end):
        prop.commit_ctx(st, data[p : p + 1], [p])
        assert st.ctx_positions[0] == first
    prop.commit_ctx(st, data[end : end + 1], [end])
    assert st.ctx_positions[0] > first and st.ctx_committed == 0
    score.invariant_checks += 3


def test_drafts_after_slide_equal_fresh_state(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    data = rows(20, 2)
    slid = prop.alloc_state_for(3)
    prop.commit_ctx(slid, data[:7], range(7))
    prop.propose(slid, 5, 7, 3)
    prop.commit_ctx(slid, data[7:12], range(7, 12))
    first = slid.ctx_positions[0]
    assert first > 4  # the default slide room dropped more than the commit needed
    fresh = prop.alloc_state_for(3)
    prop.commit_ctx(fresh, data[first:12], range(first, 12))
    assert slid.ctx_positions == fresh.ctx_positions
    assert prop.propose(slid, 9, 12, 3) == prop.propose(fresh, 9, 12, 3)
    assert slid.ctx_committed == slid.ctx_len == 12 - first


def test_commit_more_rows_than_window_keeps_newest(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    st = prop.alloc_state_for(1)  # 6 rows
    data = rows(10, 3)
    prop.commit_ctx(st, data, range(10))
    assert st.ctx_positions == list(range(4, 10))
    assert st.acc is not None and torch.equal(st.acc, data[4:])


def test_commit_bad_inputs_change_nothing(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    st = filled(prop, 4, 4)
    before = snapshot(prop, [st])
    with expect_clear_error(ValueError, "k*H"):
        prop.commit_ctx(st, torch.zeros(2, K_H + 1), [4, 5])
    with expect_clear_error(TypeError, "floating"):
        prop.commit_ctx(st, torch.zeros(2, K_H, dtype=torch.int64), [4, 5])
    with expect_clear_error(ValueError, "positions"):
        prop.commit_ctx(st, torch.zeros(2, K_H), [4])
    with expect_clear_error(ValueError, "position"):
        prop.commit_ctx(st, torch.zeros(2, K_H), [3, 5])  # not after the last one
    with expect_clear_error(TypeError, "Tensor"):
        prop.commit_ctx(st, [[0.0] * K_H], [4])  # type: ignore[arg-type]
    assert same(before, snapshot(prop, [st]))


def test_propose_computes_kv_for_uncommitted_rows_only(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    st = filled(prop, 6, 5)
    drafts = prop.propose(st, 1, 6, prop.block_gamma - 1)
    assert len(drafts) == prop.block_gamma - 1
    assert all(0 <= t < prop.vocab_size for t in drafts)
    assert st.ctx_committed == 6 and st.last_num_drafted == len(drafts) and st.seq_len == 7
    assert len(st.page_table) == math.ceil(6 / prop.page_size)
    k_before = prop.cache.k.clone()
    prop.commit_ctx(st, rows(2, 6), [6, 7])
    prop.propose(st, 1, 8, 1)
    changed = (prop.cache.k != k_before).any(dim=(0, 3, 4)).nonzero().tolist()
    # Exactly the two new rows' slots (rows 6 and 7 of the page table) were written.
    slots = {b * prop.page_size + o for b, o in changed}
    table = st.page_table
    assert slots == {table[r // 4] * 4 + r % 4 for r in (6, 7)}


def test_propose_bad_inputs(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    st = filled(prop, 3, 7)
    before = snapshot(prop, [st])
    for bad in (0, prop.block_gamma, -1):
        with expect_clear_error(ValueError, "num_drafts"):
            prop.propose(st, 1, 3, bad)
    with expect_clear_error(ValueError, "position"):
        prop.propose(st, 1, 2, 1)
    with expect_clear_error(ValueError, "last_token"):
        prop.propose(st, 10_000, 3, 1)
    with expect_clear_error(ValueError, "grammar_bitmask"):
        prop.propose(st, 1, 3, 1, grammar_bitmask=torch.zeros(5, dtype=torch.int32))
    other = make(drafter, target)
    with expect_clear_error(InvalidStateError, "another proposer"):
        other.propose(st, 1, 3, 1)
    assert same(before, snapshot(prop, [st]))


def test_propose_pool_exhausted_changes_nothing(drafter: Any, target: Any) -> None:
    prop = make(drafter, target, num_pages=2)
    st = filled(prop, 12, 8)  # needs 3 pages of 4
    before = snapshot(prop, [st])
    with pytest.raises(PoolExhaustedError):
        prop.propose(st, 1, 12, 1)
    assert same(before, snapshot(prop, [st]))
    score.fault_points += 1


def test_forward_failure_in_propose_gives_pages_back(
    drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prop = make(drafter, target)
    st = filled(prop, 6, 9)
    before = snapshot(prop, [st])

    def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("simulated device OOM")

    monkeypatch.setattr(prop.drafter, "forward_block", boom)
    with pytest.raises(RuntimeError, match="OOM"):
        prop.propose(st, 1, 6, 1)
    assert same(before, snapshot(prop, [st]))
    score.fault_points += 1


def test_grammar_bitmask_never_violated(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    st = filled(prop, 5, 10)
    free_drafts = prop.propose(st, 2, 5, 3)
    words = (prop.vocab_size + 31) // 32
    for allowed in ({7}, {3, 40, 41}, set(range(0, 64, 2)) - set(free_drafts)):
        bits = [0] * words
        for t in allowed:
            bits[t // 32] |= 1 << (t % 32)
        mask = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)
        drafts = prop.propose(st, 2, 5, 3, grammar_bitmask=mask)
        assert len(drafts) == 3 and set(drafts) <= allowed
        score.invariant_checks += 1
    # Per-draft masks: row j allows only token j + 10.
    per_row = torch.zeros(3, words, dtype=torch.int32)
    for j in range(3):
        per_row[j, (10 + j) // 32] = 1 << ((10 + j) % 32)
    assert prop.propose(st, 2, 5, 3, grammar_bitmask=per_row) == [10, 11, 12]


def test_draft_cap_lever(drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_DRAFT_CAP", "2")
    prop = make(drafter, target)
    a, b = filled(prop, 5, 11), filled(prop, 7, 12)
    assert len(prop.propose(a, 1, 5, 3)) == 2
    prop.after_verify(a, 0)
    out = prop.propose_batch([a, b], [1, 2], [5, 7], 3)
    assert out is not None and [len(d) for d in out] == [2, 2]
    assert a.last_num_drafted == 2 and b.last_num_drafted == 2


def test_propose_batch_max(drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert make(drafter, target, max_batch=4).propose_batch_max() == 4
    assert make(drafter, target, max_batch=32).propose_batch_max() == 16
    assert make(drafter, target, batched_path=False).propose_batch_max() == 1
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_BATCH_PROPOSE", "1")
    assert make(drafter, target).propose_batch_max() == 1
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_BATCH_PROPOSE", "3")
    assert make(drafter, target, max_batch=8).propose_batch_max() == 3


@pytest.mark.parametrize("batched_precompute", ["1", "0"])
def test_propose_batch_equals_single_proposals(
    drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch, batched_precompute: str
) -> None:
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_BATCHED_PRECOMPUTE", batched_precompute)
    prop = make(drafter, target)
    lens = [3, 9, 5, 1]
    tokens = [4, 17, 33, 60]
    batch = [filled(prop, n, 20 + i) for i, n in enumerate(lens)]
    single = [filled(prop, n, 20 + i) for i, n in enumerate(lens)]
    for step in range(3):
        nd = 1 + step
        got = prop.propose_batch(batch, tokens, lens, nd)
        want = [prop.propose(s, t, p, nd) for s, t, p in zip(single, tokens, lens)]
        assert got == want
        for s in batch + single:
            assert s.last_num_drafted == nd
            prop.after_verify(s, 1)
            assert s.last_num_drafted == 0
        for i, s in enumerate(batch + single):
            prop.commit_ctx(s, rows(2, 100 * step + i % 4), [lens[i % 4], lens[i % 4] + 1])
        lens = [n + 2 for n in lens]
        score.operations += 2 * len(lens)


def test_propose_batch_declines_leave_everything_unchanged(
    drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prop = make(drafter, target, max_batch=3, num_pages=8)
    a, b, c, d = (filled(prop, 5, 30 + i) for i in range(4))
    states = [a, b, c, d]
    freed = filled(prop, 2, 39)
    prop.free_state(freed)
    foreign = filled(make(drafter, target), 2, 40)
    nobatch = make(drafter, target, batched_path=False)
    nb_states = [filled(nobatch, 3, 41), filled(nobatch, 3, 42)]
    cases: list[tuple[DFlashProposer, list[Any], list[int], list[int], int]] = [
        (prop, [a], [1], [5], 1),  # fewer than 2
        (prop, [a, b, c, d], [1] * 4, [5] * 4, 1),  # more than max_batch
        (prop, [a, b], [1, 2, 3], [5, 5, 5], 1),  # states vs tokens
        (prop, [a, b], [1, 2], [5], 1),  # positions vs tokens
        (nobatch, nb_states, [1, 2], [3, 3], 1),  # no batched path
        (prop, [a, freed], [1, 2], [5, 2], 1),  # failed prep: freed state
        (prop, [a, foreign], [1, 2], [5, 2], 1),  # failed prep: foreign state
        (prop, [a, a], [1, 2], [5, 5], 1),  # the same state twice
        (prop, [a, b], [1, 2], [5, 4], 1),  # failed prep: position not after ctx
        (prop, [a, b], [1, 2], [5, 5], 0),  # num_drafts out of range
        (prop, [a, b], [1, 2], [5, 5], prop.block_gamma),
        (prop, [a, b, c], [1, 2, 3], [5, 5, 5], 1),  # precompute: pool exhausted (6 > 8-...)
    ]
    # Leave too few blocks for three fresh contexts of 5 rows (2 blocks each).
    hog = prop.pool.alloc(prop.pool.num_free - 4)
    for p, sts, toks, pos, nd in cases:
        everyone = states if p is prop else nb_states
        before = snapshot(p, everyone)
        assert p.propose_batch(sts, toks, pos, nd) is None
        assert same(before, snapshot(p, everyone))
        score.invariant_checks += 1
    prop.pool.free(hog)

    def boom(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("simulated forward failure")

    before = snapshot(prop, states)
    monkeypatch.setattr(prop.drafter, "forward_block", boom)
    assert prop.propose_batch([a, b], [1, 2], [5, 5], 1) is None
    assert same(before, snapshot(prop, states))
    monkeypatch.undo()
    monkeypatch.setattr(prop.forward, "ops", dataclasses.replace(prop.forward.ops, ctx_kv_store=boom))
    assert prop.propose_batch([a, b], [1, 2], [5, 5], 1) is None
    assert same(before, snapshot(prop, states))
    score.fault_points += 2


def test_short_forward_declines(drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    prop = make(drafter, target)
    a, b = filled(prop, 4, 50), filled(prop, 4, 51)
    before = snapshot(prop, [a, b])
    monkeypatch.setattr(proposer_mod._core, "split_bands", lambda *args, **kw: None)
    assert prop.propose_batch([a, b], [1, 2], [4, 4], 2) is None
    assert same(before, snapshot(prop, [a, b]))


def test_after_verify_rejects_foreign_and_resets(drafter: Any, target: Any) -> None:
    prop, other = make(drafter, target), make(drafter, target)
    st = filled(prop, 3, 60)
    prop.propose(st, 1, 3, 2)
    with expect_clear_error(InvalidStateError, "another proposer"):
        other.after_verify(st, 1)
    with expect_clear_error(InvalidStateError, "not a DFlash proposer state"):
        prop.after_verify(object(), 0)  # type: ignore[arg-type]
    with expect_clear_error(ValueError, "accepted"):
        prop.after_verify(st, 3)
    assert st.last_num_drafted == 2
    prop.after_verify(st, 2)
    assert st.last_num_drafted == 0 and st.last_num_accepted == 2


def test_free_state_idempotent_and_resets(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    fresh = prop.alloc_state()
    st = filled(prop, 10, 70)
    prop.propose(st, 1, 10, 2)
    assert prop.pool.num_used > 0
    prop.free_state(st)
    assert prop.pool.num_free == prop.pool.num_pages
    assert st.acc is None and st.page_table_dev is None and st.freed
    for name in ("ctx_len", "ctx_committed", "seq_len", "last_num_drafted", "last_num_accepted"):
        assert getattr(st, name) == getattr(fresh, name) == 0
    assert st.ctx_positions == [] and st.page_table == [] and not st.prefill_done
    prop.free_state(st)  # second call: nothing
    assert prop.pool.num_free == prop.pool.num_pages
    prop.free_state(object())  # another kind: ignored
    with expect_clear_error(InvalidStateError, "freed"):
        prop.propose(st, 1, 10, 1)
    with expect_clear_error(InvalidStateError, "freed"):
        prop.commit_ctx(st, rows(1, 0), [11])
    prop.free_state(fresh)


def test_shared_pool_between_proposers(drafter: Any, target: Any) -> None:
    pool = BlockPool(16, 4)
    p1, p2 = make(drafter, target, pool=pool), make(drafter, target, pool=pool)
    s1, s2 = filled(p1, 6, 80), filled(p2, 6, 80)
    assert p1.propose(s1, 1, 6, 2) == p2.propose(s2, 1, 6, 2)
    assert pool.num_used == 4
    p1.free_state(s1)
    p2.free_state(s2)
    assert pool.num_free == 16


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("BLOCKDRAFT_DFLASH_CTX_CAP", "lots"),
        ("BLOCKDRAFT_DFLASH_SLIDE", "1"),
        ("BLOCKDRAFT_DFLASH_SLIDE", "-0.1"),
        ("BLOCKDRAFT_DFLASH_SLIDE", "an eighth"),
        ("BLOCKDRAFT_DFLASH_BATCH_PROPOSE", "x"),
        ("BLOCKDRAFT_DFLASH_BATCH_PROPOSE", "-1"),
        ("BLOCKDRAFT_DFLASH_BATCHED_PRECOMPUTE", "maybe"),
        ("BLOCKDRAFT_DFLASH_DRAFT_CAP", "0"),
        ("BLOCKDRAFT_DFLASH_DRAFT_CAP", "two"),
    ],
)
def test_invalid_levers_fail_at_construction(
    drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with expect_clear_error(ConfigError, var):
        make(drafter, target)


def test_levers_accept_documented_values(drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_BATCHED_PRECOMPUTE", "off")
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_DRAFT_CAP", "3")
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_BATCH_PROPOSE", "0")
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_SLIDE", " 0.25 ")
    lv = make(drafter, target).levers
    assert (lv.batched_precompute, lv.draft_cap, lv.batch_propose) == (False, 3, 0)
    assert lv.slide == 0.25


def test_mismatched_pair_and_backend(drafter: Any, target: Any) -> None:
    with expect_clear_error(ConfigError, "hidden size"):
        make(drafter, tiny_target(layers=3, vocab=64, seed=3).__class__(_config_with_hidden(16)))
    with expect_clear_error(ConfigError, "target_layer_ids"):
        make(tiny_drafter(drafter_config(target_layers=6)), target)
    with expect_clear_error(ConfigError, "backend"):
        make(drafter, target, backend="cuda-magic")  # type: ignore[arg-type]
    assert make(drafter, target, backend="auto").backend == "torch"  # CPU device


def _config_with_hidden(hidden: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=64,
    )


def test_triton_backend_gives_the_same_drafts(drafter: Any, target: Any) -> None:
    """Both backends on the same inputs (Triton on the CPU interpreter in CI, on CUDA on GPUs)."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1 (set by .ci/dev test)")
    props = [make(drafter, target, backend=b) for b in ("torch", "triton")]
    assert props[1].backend == "triton"
    outs = []
    for p in props:
        a, b = filled(p, 7, 90), filled(p, 3, 91)
        single = p.propose(a, 4, 7, 3)
        p.after_verify(a, 0)
        p.commit_ctx(a, rows(2, 92), [7, 8])
        outs.append((single, p.propose_batch([a, b], [5, 6], [9, 3], 2)))
    assert outs[0] == outs[1]


def test_draft_batched_equals_per_sequence(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    lens = [3, 9, 5, 1, 4]
    tokens = [4, 17, 33, 60, 8]
    want = [3, 1, 2, 0, 3]
    batch = [filled(prop, n, 20 + i) for i, n in enumerate(lens)]
    single = [filled(prop, n, 20 + i) for i, n in enumerate(lens)]
    got = prop.draft(batch, tokens, lens, want)
    expected = [prop.propose(s, t, p, w) if w > 0 else [] for s, t, p, w in zip(single, tokens, lens, want)]
    assert got.tokens == expected
    assert got.errors == [None] * 5 and got.q == [None] * 5
    assert got.batched == 1 and got.single == 0


def test_draft_chunks_of_propose_batch_max(drafter: Any, target: Any) -> None:
    prop = make(drafter, target, max_batch=2)
    lens = [3, 9, 5, 2, 4]
    states = [filled(prop, n, 50 + i) for i, n in enumerate(lens)]
    single = [filled(prop, n, 50 + i) for i, n in enumerate(lens)]
    got = prop.draft(states, [1] * 5, lens, [2] * 5)
    assert got.tokens == [prop.propose(s, 1, p, 2) for s, p in zip(single, lens)]
    assert (got.batched, got.single) == (2, 1)  # chunks of 2, 2 and a lone 1


def test_draft_falls_back_when_propose_batch_declines(
    drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prop = make(drafter, target)
    lens = [3, 9, 5]
    states = [filled(prop, n, 60 + i) for i, n in enumerate(lens)]
    expected = prop.draft(states, [4, 5, 6], lens, [2, 3, 1]).tokens
    for s in states:
        prop.after_verify(s, 0)
    monkeypatch.setattr(prop, "propose_batch", lambda *a, **k: None)
    got = prop.draft(states, [4, 5, 6], lens, [2, 3, 1])
    assert got.tokens == expected
    assert (got.batched, got.single) == (0, 3)
    nobatch = make(drafter, target, batched_path=False)
    nb = [filled(nobatch, n, 60 + i) for i, n in enumerate(lens)]
    got = nobatch.draft(nb, [4, 5, 6], lens, [2, 3, 1])
    assert got.tokens == expected and (got.batched, got.single) == (0, 3)


def test_draft_masks_and_per_sequence_errors(drafter: Any, target: Any) -> None:
    prop = make(drafter, target)
    words = (prop.vocab_size + 31) // 32
    only7 = torch.zeros(words, dtype=torch.int32)
    only7[0] = 1 << 7

    def broken() -> torch.Tensor | None:
        raise RuntimeError("mask failed")

    states = [filled(prop, 5, 70 + i) for i in range(4)]
    plain = filled(prop, 5, 73)
    got = prop.draft(states, [2] * 4, [5] * 4, [3] * 4, masks=[only7, lambda: only7, broken, None])
    assert got.tokens[:3] == [[7, 7, 7], [7, 7, 7], []]
    assert got.tokens[3] == prop.propose(plain, 2, 5, 3)
    assert got.errors[:2] == [None, None] and got.errors[3] is None
    assert isinstance(got.errors[2], RuntimeError)
    assert got.single == 3  # the masked ones; the lone plain one too (no batch of one)
    with expect_clear_error(ValueError, "masks"):
        prop.draft(states[:2], [2, 2], [5, 5], [1, 1], masks=[None])


def test_draft_sampled_equals_propose_sampled(drafter: Any, target: Any) -> None:
    from blockdraft.sampling import SamplingParams

    prop = make(drafter, target)
    params = SamplingParams(temperature=0.8, top_k=20)
    states = [filled(prop, n, 80 + i) for i, n in enumerate([4, 6, 3])]
    single = [filled(prop, n, 80 + i) for i, n in enumerate([4, 6, 3])]
    sampling = [(params, torch.Generator().manual_seed(1)), None, (SamplingParams(), None)]
    got = prop.draft(states, [3, 4, 5], [4, 6, 3], [3, 2, 2], sampling=sampling)
    drafts, q = prop.propose_sampled([single[0]], [3], [4], 3, params, torch.Generator().manual_seed(1))
    assert got.tokens[0] == drafts[0]
    q0 = got.q[0]
    assert q0 is not None and q0.device.type == "cpu" and torch.equal(q0, q[0, :3].cpu())
    # greedy settings and no settings draft greedily (batched together)
    assert got.q[1] is None and got.q[2] is None
    assert got.tokens[1:] == [prop.propose(single[1], 4, 6, 2), prop.propose(single[2], 5, 3, 2)]
    assert (got.batched, got.single) == (1, 1)


def test_levers_refuse_a_slide_outside_the_unit_interval() -> None:
    assert Levers(ctx_cap=0).slide == 0.125
    for bad in (1.0, -0.01, float("nan")):
        with expect_clear_error(ValueError, "slide"):
            Levers(ctx_cap=0, slide=bad)
    with pytest.raises(TypeError):
        Levers(ctx_cap=0, slide="0.1")  # type: ignore[arg-type]
