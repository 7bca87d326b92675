"""The engine's draft-length decision: the policy's choices from batch size and acceptance,
the lever that fixes it, and greedy output that does not depend on it (verify blocks of
every row class, padded to the runtime's graph rows on the static graph path)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from blockdraft import pair as bd_pair
from blockdraft._core import ConfigError
from blockdraft.engine import SpeculativeEngine
from blockdraft.engine.draft_length import (
    DRAFT_LENGTHS,
    ENV_DRAFT_LENGTH,
    DraftLengthPolicy,
    read_draft_length,
    row_classes,
)

TARGET, DRAFTER = bd_pair.random_pair(bd_pair.SHAPES["tiny"], "cpu", torch.float32, seed=3)
B = DRAFTER.config.block_size
PROMPTS = [[5, 17, 300, 2], [9], [(7 * i + 11) % 500 for i in range(23)], [44, 45, 46, 47, 48, 49, 50]]
NEW = 20


def test_the_lever_reads_adaptive_or_a_count() -> None:
    assert read_draft_length(None, {}) == "adaptive"
    assert read_draft_length(None, {ENV_DRAFT_LENGTH: "adaptive"}) == "adaptive"
    assert read_draft_length(None, {ENV_DRAFT_LENGTH: " 7 "}) == 7
    assert read_draft_length(3, {ENV_DRAFT_LENGTH: "7"}) == 3  # the argument wins
    with pytest.raises(ConfigError, match=ENV_DRAFT_LENGTH):
        read_draft_length(None, {ENV_DRAFT_LENGTH: "many"})
    with pytest.raises(ConfigError, match="draft_length"):
        read_draft_length(-1)
    with pytest.raises(ConfigError, match="draft_length"):
        read_draft_length("fast")  # type: ignore[arg-type]


def test_row_classes_follow_the_draft_lengths() -> None:
    assert row_classes(16, "adaptive") == (2, 4, 8, 16)
    assert row_classes(8, "adaptive") == (2, 4, 8)
    assert row_classes(16, 3) == (4, 16)
    assert row_classes(16, 0) == (16,)
    assert row_classes(4, 15) == (4,)


def test_fixed_counts_are_clipped_to_the_block() -> None:
    assert DraftLengthPolicy(16, fixed=7).choose([1, 2, 3]) == [7, 7, 7]
    assert DraftLengthPolicy(8, fixed=15).choose([1]) == [7]
    assert DraftLengthPolicy(16, fixed=0).choose([1]) == [0]


def test_few_rows_draft_the_whole_block_and_many_rows_keep_the_likely_drafts() -> None:
    policy = DraftLengthPolicy(16, free_rows=64, min_value=0.3)
    assert policy.choose([1, 2, 3, 4]) == [15] * 4  # 4 x 16 rows fit: drafts cost nothing
    p = policy.acceptance(1)  # the prior: 0.8
    assert p == pytest.approx(0.8)
    want = max(k for k in DRAFT_LENGTHS if k <= 15 and p ** k >= 0.3)
    assert policy.choose(list(range(5))) == [want] * 5  # 5 x 16 rows do not
    for _ in range(10):  # request 0 accepts everything: it keeps more drafts than the rest
        policy.observe(0, 7, 7)
    got = policy.choose(list(range(5)))
    assert got[0] > got[1] and got[0] == 15


def test_low_acceptance_decodes_then_probes_again() -> None:
    policy = DraftLengthPolicy(16, min_accept=0.25)
    for _ in range(8):
        if policy.choose([1])[0] == 0:
            policy.observe(1, 0, 0)
        else:
            policy.observe(1, 15, 0)
    assert policy.acceptance(1) < 0.25
    assert policy.choose([1, 2]) == [0, 15]
    steps = 0
    while policy.choose([1])[0] == 0:  # no drafts: a pause
        policy.observe(1, 0, 0)
        steps += 1
        assert steps < 50
    assert steps >= 1
    policy.observe(1, 15, 3)  # the probe is accepted: the pause is over
    assert policy.choose([1]) == [15]
    policy.forget(1)
    assert policy.acceptance(1) == pytest.approx(0.8)


def test_probes_that_fail_double_the_pause_up_to_max_wait() -> None:
    """tau about 1 (nothing accepted, ever): the drafting steps thin out to one in max_wait."""
    policy = DraftLengthPolicy(16, max_wait=16)
    drafting = []
    for _ in range(200):
        k = policy.choose([1])[0]
        drafting.append(k > 0)
        policy.observe(1, k, 0)
    gaps = [i for i, d in enumerate(drafting) if d]
    pauses = [b - a - 1 for a, b in zip(gaps, gaps[1:])]
    first = next(i for i, g in enumerate(pauses) if g > 0)
    assert pauses[first:first + 5] == [1, 2, 4, 8, 16]
    assert set(pauses[first + 4:]) == {16}
    assert sum(drafting[-100:]) <= 100 // 16 + 1


@dataclass
class Cycling(DraftLengthPolicy):
    """Every count from 0 to B - 1 in turn, different per request: every verify row class
    and ragged mixes of them."""

    step: int = 0

    def choose(self, request_ids: Sequence[int]) -> list[int]:
        self.step += 1
        return [(self.step * 5 + 3 * i) % self.block for i, _ in enumerate(request_ids)]


def engine(**kw: Any) -> SpeculativeEngine:
    kw = {"runtime": "blockdraft", "max_seq_len": 64, "max_active": 4, "page_size": 4,
          "num_pages": 64, "max_batch": 4, **kw}
    return SpeculativeEngine(TARGET, DRAFTER, **kw)


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_greedy_output_does_not_depend_on_the_draft_length(graphs: str) -> None:
    with engine(speculate=False) as off:
        ref = [list(t) for t in off.generate(PROMPTS, max_new_tokens=NEW).tokens]
    for choice in (0, 3, "adaptive", Cycling(B)):
        with engine(graphs=graphs, draft_length=choice) as eng:
            got = eng.generate(PROMPTS, max_new_tokens=NEW)
            assert [list(t) for t in got.tokens] == ref, choice
            assert eng.pages_used() == {"target": 0, "drafter": 0}
    with engine(graphs=graphs, draft_length=0) as eng:
        assert eng.generate(PROMPTS, max_new_tokens=NEW).stats.mean_tau == pytest.approx(1.0)
        assert eng.batched_proposals == eng.single_proposals == 0  # K = 0 never drafts


def test_the_runtime_has_a_graph_shape_per_row_class() -> None:
    with engine(graphs="static") as eng:
        assert eng.runtime is not None and eng.runtime.graphs is not None
        assert sorted(eng.runtime.graphs.rows) == [1, *row_classes(B, "adaptive")]
    with engine(graphs="static", draft_length=B - 1) as eng:
        assert eng.runtime is not None and eng.runtime.graphs is not None
        assert sorted(eng.runtime.graphs.rows) == [1, B]


def test_the_environment_fixes_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DRAFT_LENGTH, "1")
    with engine() as eng:
        assert eng.draft_length == 1
        got = eng.generate(PROMPTS[:1], max_new_tokens=NEW)
        assert max(got.stats.acceptance_lengths[0]) <= 2  # a draft and the target's own token
