"""A run of the speculative engine where requests arrive, finish and are cancelled between
steps, for the tests of drafts launched a step ahead (on the CPU's static graph path and on
captured CUDA graphs): per request its tokens and the tokens of each of its steps."""

from __future__ import annotations

from collections.abc import Sequence

from blockdraft.engine import SpeculativeEngine
from blockdraft.sampling import SamplingParams

LONG = 120
"""Tokens of the requests that run throughout: past a dozen steps at the built-in pair's
acceptance on the held-out prompts."""
NEW = 24
SHORT = 6
STOP = 1305
"""First at the 24th token of the first prompt under the built-in pair's greedy decoding,
inside an accepted block."""


def arrivals(eng: SpeculativeEngine, prompts: Sequence[Sequence[int]]) -> dict[str, tuple[list[int], list[int]]]:
    """Requests ``a`` to ``f`` on five prompts, stepped by hand: ``b`` is admitted next to
    ``a``'s drafts launched ahead and drafted fresh into the same graph bucket (one row); ``c``
    is cancelled between ``b``'s and ``d``'s rows; ``f`` stops at :data:`STOP` inside an
    accepted block; ``e`` samples, so its steps read every request's drafts. Checks that every
    page came back."""
    ids = {"a": eng.submit(prompts[0], max_new_tokens=LONG)}
    eng.step()
    eng.step()
    ids["b"] = eng.submit(prompts[1], max_new_tokens=NEW)
    eng.step()
    eng.step()
    ids["c"] = eng.submit(prompts[2], max_new_tokens=LONG)
    ids["d"] = eng.submit(prompts[3], max_new_tokens=NEW)
    ids["f"] = eng.submit(prompts[0], max_new_tokens=LONG, stop_token_ids=[STOP])
    eng.step()
    eng.cancel(ids["c"])
    eng.step()
    ids["e"] = eng.submit(prompts[4], max_new_tokens=SHORT, sampling=SamplingParams(temperature=0.8), seed=3)
    list(eng.stream())
    out = {k: (list(eng.request(i).out), list(eng.request(i).steps)) for k, i in ids.items()}
    assert eng.pages_used() == {"target": 0, "drafter": 0}
    return out


def expected(decoded: Sequence[Sequence[int]]) -> dict[str, list[int]]:
    """The tokens of the greedy requests that run to their end, from target-only decoding of
    the five prompts with :data:`LONG` new tokens each."""
    toks = [list(t) for t in decoded]
    stop = toks[0].index(STOP)
    return {"a": toks[0], "b": toks[1][:NEW], "d": toks[3][:NEW], "f": toks[0][: stop + 1]}


__all__ = ["LONG", "NEW", "SHORT", "STOP", "arrivals", "expected"]
