r"""The suite's scorecard: real counts of the work the tests did, printed as one line at the end.

Every test that runs operation sequences, checks invariants, injects faults or tries bad inputs
adds to these counters *where the work happens* (never a constant), and ``conftest.py`` prints::

    blockdraft scorecard: 312 operation sequences, 18,240 operations, 21,000 invariant checks,
    0 fault points / 0 leaked pages, 45 bad inputs -> 45 clear errors,
    1,100 requests served / 130 disconnects / 0 wrong answers

Only what this pytest run itself did is counted: figures of other tools (the cargo-fuzz run of
the core, GPU runs) are tables in ``docs/RELIABILITY.md``, each with the command that makes it.

API (any test module imports it; ``tests/`` is on ``sys.path`` through the root conftest)::

    from support.scorecard import score, expect_clear_error

    score.sequences += 1          # one operation sequence (a state-machine run, a thread's life)
    score.operations += n         # public API operations performed
    score.invariant_checks += n   # invariant assertions evaluated
    score.fault_points += 1       # one injected failure (allocation site x position)
    score.leaked_pages += n      # pages found leaked after a fault (the test must also fail)
    score.requests_served += 1    # a server request answered to its end (its answer checked)
    score.disconnects += 1        # a client that left mid-stream or before its first byte
    score.wrong_answers += 1      # an answer that differs from its reference (the test must also fail)

    with expect_clear_error(InvalidStateError, "position"):   # counts one bad input
        st.plan_append([-1])

``expect_clear_error`` counts the bad input as tried on entry and as a clear error only when an
instance of the expected type was raised and its message matches every given pattern
(``re.search``, case-insensitive; ``"budget_tokens"``, ``r"\bn\b"``, ``"twice|duplicate"``);
otherwise the test fails. A Rust panic (pyo3 ``PanicException``, a
``BaseException``) is not caught and fails the test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import pytest


@dataclass
class Score:
    """Counters of one pytest run (single process; no xdist aggregation)."""

    sequences: int = 0
    operations: int = 0
    invariant_checks: int = 0
    fault_points: int = 0
    leaked_pages: int = 0
    bad_inputs: int = 0
    clear_errors: int = 0
    requests_served: int = 0
    disconnects: int = 0
    wrong_answers: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def line(self) -> str:
        return (
            f"blockdraft scorecard: {self.sequences:,} operation sequences, "
            f"{self.operations:,} operations, {self.invariant_checks:,} invariant checks, "
            f"{self.fault_points:,} fault points / {self.leaked_pages:,} leaked pages, "
            f"{self.bad_inputs:,} bad inputs -> {self.clear_errors:,} clear errors, "
            f"{self.requests_served:,} requests served / {self.disconnects:,} disconnects / "
            f"{self.wrong_answers:,} wrong answers"
        )


score = Score()


@contextmanager
def expect_clear_error(exc_type: type[BaseException], *words: str) -> Iterator[None]:
    """Assert the block raises an ``exc_type`` whose message matches every regex in ``words``.

    Pass the most specific type the contract promises (``ConfigError``, not ``ValueError``).
    Counts one bad input tried, and one clear error when the check passes.
    """
    score.bad_inputs += 1
    with pytest.raises(Exception) as info:
        yield
    exc = info.value
    if not isinstance(exc, exc_type):
        raise AssertionError(
            f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}"
        ) from exc
    message = str(exc)
    missing = [w for w in words if not re.search(w, message, re.IGNORECASE)]
    if missing:
        raise AssertionError(
            f"{type(exc).__name__} message {message!r} does not name {missing}"
        ) from exc
    score.clear_errors += 1
