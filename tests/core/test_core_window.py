"""Context window policy (rows a sequence keeps) against a Python reference, and the cap variable."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import blockdraft
from blockdraft import ConfigError, ctx_ceiling, ctx_window
from blockdraft.core import read_ctx_cap

from support.scorecard import expect_clear_error, score

ENV = "BLOCKDRAFT_DFLASH_CTX_CAP"
U63 = 2**63 - 1


def ref_ceiling(max_seq_len: int, cap: int) -> int:
    return max_seq_len if cap == 0 else min(max_seq_len, cap)


def ref_window(max_seq_len: int, block_size: int, budget: int | None, cap: int) -> int:
    ceiling = ref_ceiling(max_seq_len, cap)
    if budget is None:
        return ceiling
    # Python ints do not overflow, so this is the saturating sum the core must emulate.
    return min(ceiling, budget + block_size + 1)


def test_constants() -> None:
    assert blockdraft.core.ENV_CTX_CAP == ENV
    assert blockdraft.core.DEFAULT_CTX_CAP == 16384
    assert blockdraft.core.PAD_SLOT == -1


_sizes = st.one_of(st.integers(1, 40_000), st.integers(1, U63))
_caps = st.one_of(st.just(0), st.integers(1, 40_000), st.integers(0, U63))
_budgets = st.one_of(st.none(), st.integers(0, 40_000), st.integers(0, U63))


@given(max_seq_len=_sizes, block_size=st.integers(1, 64), budget=_budgets, cap=_caps)
def test_window_matches_reference(max_seq_len: int, block_size: int, budget: int | None, cap: int) -> None:
    score.operations += 2
    got = ctx_window(max_seq_len, block_size, budget_tokens=budget, cap=cap)
    assert got == ref_window(max_seq_len, block_size, budget, cap)
    assert got >= 1
    assert ctx_ceiling(max_seq_len, cap=cap) == ref_ceiling(max_seq_len, cap)


@given(max_seq_len=_sizes, block_size=st.integers(1, 64), budget=_budgets, env_cap=_caps)
def test_window_reads_cap_from_env(max_seq_len: int, block_size: int, budget: int | None, env_cap: int) -> None:
    score.operations += 3
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(env_cap))
        assert read_ctx_cap() == env_cap
        assert ctx_window(max_seq_len, block_size, budget) == ref_window(max_seq_len, block_size, budget, env_cap)
        assert ctx_ceiling(max_seq_len) == ref_ceiling(max_seq_len, env_cap)


def test_default_cap_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert read_ctx_cap() == 16384
    assert ctx_ceiling(100_000) == 16384
    assert ctx_ceiling(1000) == 1000
    assert ctx_window(100_000, 16) == 16384
    assert ctx_window(100_000, 16, budget_tokens=100) == 117


def test_zero_cap_is_uncapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    assert read_ctx_cap() == 0
    assert ctx_ceiling(131_072) == 131_072
    assert ctx_window(131_072, 8) == 131_072
    assert ctx_window(131_072, 8, budget_tokens=0) == 9


def test_explicit_cap_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "not-a-number")
    assert ctx_window(5000, 4, cap=1000) == 1000
    assert ctx_window(5000, 4, cap=0) == 5000
    assert ctx_ceiling(5000, cap=64) == 64


def test_env_change_is_seen_by_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "100")
    assert ctx_ceiling(1000) == 100
    monkeypatch.setenv(ENV, "200")
    assert ctx_ceiling(1000) == 200


def test_budget_saturates_instead_of_wrapping() -> None:
    assert ctx_window(4096, 64, budget_tokens=U63, cap=0) == 4096
    assert ctx_window(U63, 64, budget_tokens=U63, cap=0) == U63
    assert ctx_window(U63, 1, budget_tokens=U63 - 1, cap=0) == U63


def test_budget_zero_keeps_room_for_one_block() -> None:
    # The smallest window still holds the anchor plus one drafter block of block_size rows.
    assert ctx_window(4096, 16, budget_tokens=0, cap=0) == 17


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "16k", "0x10", "1e4"])
def test_garbage_env_is_a_config_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV, value)
    for call in (read_ctx_cap, lambda: ctx_ceiling(1000), lambda: ctx_window(1000, 4)):
        with expect_clear_error(ConfigError, ENV):
            call()
    # ConfigError is a ValueError, so generic callers that catch ValueError still work.
    with pytest.raises(ValueError):
        read_ctx_cap()
