"""Speculative generation: the continuous-batching engine and the one-call ``generate``.

| module | concept |
| --- | --- |
| ``engine`` | :class:`SpeculativeEngine`: submit / step / stream / cancel / generate |
| ``request`` | one request, and the events a step reports |
| ``accept`` | the target's choices: first tokens and accepted drafts |
| ``generate`` | :func:`generate` |
"""

from __future__ import annotations

from blockdraft.engine.engine import RUNTIMES, SpeculativeEngine, resolve_runtime
from blockdraft.engine.generate import generate
from blockdraft.engine.request import Request, Status, StepEvent
from blockdraft.target import DEFAULT_SDPA_BACKENDS

__all__ = [
    "DEFAULT_SDPA_BACKENDS",
    "RUNTIMES",
    "Request",
    "SpeculativeEngine",
    "Status",
    "StepEvent",
    "generate",
    "resolve_runtime",
]
