"""The test-only entry points of the extension (the ``test-hooks`` cargo feature) and what
:mod:`blockdraft.faults` does without them. The suite runs on a build with the hooks
(``bash .ci/dev`` builds it so); release wheels (``maturin build --release``) are built without.
"""

from __future__ import annotations

import pytest

from blockdraft import _core, faults
from blockdraft._core import BlockPool, ContextState, PoolExhaustedError


def test_the_suite_runs_on_a_build_with_test_hooks() -> None:
    assert _core.TEST_HOOKS is True, (
        "blockdraft._core was built without test hooks: `maturin develop --features test-hooks`"
    )
    assert callable(_core._panic_for_tests)


def test_plan_proposals_takes_fail_at_only_as_a_fault_point() -> None:
    pool = BlockPool(8, 4)
    states = [ContextState(pool, 8, 1) for _ in range(2)]
    for st in states:
        st.apply_append(st.plan_append([0, 1]))
    # fail_at=None is the plain call
    plans = _core.plan_proposals("propose_batch", states, [1, 1], [2, 2], 8, 1, fail_at=None)
    assert len(plans) == 2
    _core.abort_plans(plans)
    with pytest.raises(PoolExhaustedError, match="fault injection: pool_pages at sequence 1 of 2"):
        _core.plan_proposals("propose_batch", states, [1, 1], [2, 2], 8, 1, fail_at=1)
    assert pool.num_free == 8


def test_faults_refuse_to_arm_without_test_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_core, "TEST_HOOKS", False)
    for arm in (lambda: faults.inject("pool_pages", 1), faults.record):
        with pytest.raises(RuntimeError, match="no test hooks.*--features test-hooks"):
            with arm():
                pass  # pragma: no cover - never armed
        assert not faults.active()
    monkeypatch.setattr(_core, "TEST_HOOKS", True)
    with faults.record() as plan:
        faults.hit("forward")
    assert plan.hits["forward"] == 1 and not faults.active()
