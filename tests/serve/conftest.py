"""Fixtures of the server tests: the built-in pair, a live server on it for a module, and the
check after each test that used the server that it went idle with every page back.

A module sets ``SERVER_KW`` (options of :func:`support.serve_support.live_server`) to start its
server otherwise, or defines a ``server`` fixture of its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.serve_support import LiveServer, Pair, builtin_pair, live_server


@pytest.fixture(scope="module")
def pair() -> Pair:
    return builtin_pair()


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, pair: Pair) -> Iterator[LiveServer]:
    with live_server(pair, **getattr(request.module, "SERVER_KW", {})) as srv:
        yield srv


@pytest.fixture(autouse=True)
def pages_back(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle()
