"""Speculative generation: the continuous-batching engine and the one-call ``generate``.

| module | concept |
| --- | --- |
| ``engine`` | :class:`SpeculativeEngine`: submit / step / stream / cancel / generate |
| ``request`` | one request (checked as it is made), and the events a step reports |
| ``admission`` | how many waiting requests may start: pages and ``max_active`` |
| ``draft_length`` | how many drafts each request verifies per step (adaptive or fixed) |
| ``drafting`` | a step's drafts: what each running request asks the proposer for |
| ``accept`` | the target's choices: first tokens and accepted drafts |
| ``logprobs`` | the target's log-probabilities of the emitted tokens, when asked for |
| ``target_only`` | the step with speculation off: one target-only token per request |
| ``collect`` | many prompts in one call: submit, step until all end, gather the results |
| ``warmup`` | the start-up warm-up: every kernel variant and graph a request can reach |
| ``compiles`` | counting kernel compiles and graph captures, to find those after warm-up |
| ``generate`` | :func:`generate` |
"""

from __future__ import annotations

from blockdraft.engine.engine import SpeculativeEngine
from blockdraft.engine.generate import generate
from blockdraft.engine.request import Request, Status, StepEvent
from blockdraft.target import DEFAULT_SDPA_BACKENDS, RUNTIMES, resolve_runtime

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
