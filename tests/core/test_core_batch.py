"""Batch policy: propose_batch_max, batch_decline_reason and split_bands vs Python references."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockdraft.core import batch_decline_reason, propose_batch_max, split_bands

from support.scorecard import score


def ref_batch_max(batched_path: bool, width: int, max_batch: int) -> int:
    if not batched_path or width < 2:
        return 1
    return min(width, max(max_batch, 1))


def ref_declines(n: int, max_batch: int, batched_path: bool, num_positions: int, num_states: int) -> bool:
    return (
        n < 2 or n > max_batch or num_positions != n or num_states != n or not batched_path
    )


def ref_bands(
    tokens: list[int], n: int, block: int, has_mask_token: bool, draft_cap: int | None
) -> list[list[int]] | None:
    if len(tokens) < n * block:
        return None
    bands = []
    for i in range(n):
        band = tokens[i * block : (i + 1) * block]
        if has_mask_token:
            band = band[1:]
        bands.append(band if draft_cap is None else band[:draft_cap])
    return bands


@given(batched_path=st.booleans(), width=st.integers(0, 1024), max_batch=st.integers(0, 1024))
def test_propose_batch_max_matches_reference(batched_path: bool, width: int, max_batch: int) -> None:
    score.operations += 1
    assert propose_batch_max(batched_path, width, max_batch) == ref_batch_max(
        batched_path, width, max_batch
    )


def test_propose_batch_max_examples() -> None:
    assert propose_batch_max(False, 8, 32) == 1
    assert propose_batch_max(True, 1, 32) == 1
    assert propose_batch_max(True, 8, 32) == 8
    assert propose_batch_max(True, 64, 32) == 32
    assert propose_batch_max(True, 8, 0) == 1


@pytest.mark.parametrize(("width", "max_batch"), [(-1, 8), (8, -5), (-3, -3)])
def test_propose_batch_max_negative_inputs_follow_the_formula(width: int, max_batch: int) -> None:
    # A negative width (e.g. from a mistyped environment lever) means "no batching", not a crash.
    assert propose_batch_max(True, width, max_batch) == ref_batch_max(True, width, max_batch)


@given(
    n=st.integers(0, 40),
    max_batch=st.integers(0, 40),
    batched_path=st.booleans(),
    num_positions=st.integers(0, 40),
    num_states=st.integers(0, 40),
)
def test_batch_decline_reason_matches_reference(
    n: int, max_batch: int, batched_path: bool, num_positions: int, num_states: int
) -> None:
    score.operations += 1
    reason = batch_decline_reason(n, max_batch, batched_path, num_positions, num_states)
    if ref_declines(n, max_batch, batched_path, num_positions, num_states):
        assert isinstance(reason, str) and reason.strip(), "a decline must say why"
    else:
        assert reason is None


def test_batch_decline_reason_matched_batch_proceeds() -> None:
    assert batch_decline_reason(4, 8, True, 4, 4) is None
    assert batch_decline_reason(8, 8, True, 8, 8) is None
    for args in [(1, 8, True, 1, 1), (9, 8, True, 9, 9), (4, 8, False, 4, 4), (4, 8, True, 3, 4), (4, 8, True, 4, 5)]:
        assert batch_decline_reason(*args) is not None, args


@given(
    n=st.integers(1, 6),
    block=st.integers(1, 9),
    has_mask_token=st.booleans(),
    draft_cap=st.one_of(st.none(), st.integers(1, 12)),
    extra=st.integers(-10, 5),
    data=st.data(),
)
def test_split_bands_matches_reference(
    n: int, block: int, has_mask_token: bool, draft_cap: int | None, extra: int, data: st.DataObject
) -> None:
    length = max(0, n * block + extra)
    tokens = data.draw(st.lists(st.integers(0, 200_000), min_size=length, max_size=length))
    score.operations += 1
    assert split_bands(tokens, n, block, has_mask_token, draft_cap) == ref_bands(
        tokens, n, block, has_mask_token, draft_cap
    )


def test_split_bands_examples() -> None:
    toks = list(range(12))
    assert split_bands(toks, 3, 4, False) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert split_bands(toks, 3, 4, True) == [[1, 2, 3], [5, 6, 7], [9, 10, 11]]
    assert split_bands(toks, 3, 4, True, draft_cap=2) == [[1, 2], [5, 6], [9, 10]]
    assert split_bands(toks, 3, 4, False, draft_cap=10) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert split_bands(toks[:11], 3, 4, False) is None
    assert split_bands([7], 1, 1, True) == [[]]
