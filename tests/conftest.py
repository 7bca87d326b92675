"""Suite-wide set-up: hypothesis profiles, the ``gpu`` marker, and the scorecard line.

Hypothesis profiles (``HYPOTHESIS_PROFILE``, default ``ci``):

- ``ci``: 300 examples per property, state machines of at most 100 steps, derandomized (a fixed
  seed, so CI is reproducible), no deadline (shared 2-core CI machines stall at random).
- ``thorough``: 10,000 examples, 100 steps, random seeds; run by hand or nightly.

Tests marked ``@pytest.mark.gpu`` run on a CUDA machine. The CPU suite (``bash .ci/dev test``)
deselects them with ``-m "not gpu"``; collected anyway where ``torch.cuda.is_available()`` is
false, they are skipped with that reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from support.scorecard import score
from support.tinypair import tiny_drafter, tiny_target

# Generation speed on a loaded 2-core runner is not what these tests are about.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci",
    max_examples=300,
    stateful_step_count=100,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "thorough",
    max_examples=10_000,
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_sessionstart(session: pytest.Session) -> None:
    score.reset()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(score.line())


# shared fixtures (a module may define its own of the same name; it then wins)


@pytest.fixture(scope="module")
def target() -> Any:
    """The default tiny target (``tinypair``), once per test module."""
    return tiny_target()


@pytest.fixture(scope="module")
def drafter() -> Any:
    """The default tiny drafter (``tinypair``), once per test module."""
    return tiny_drafter()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny
    models only gain contention from more on the 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
