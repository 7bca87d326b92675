"""A request's new tokens: :meth:`Request.push` keeps them up to the first stop token or the
length limit (against a plain token-by-token reference), as :meth:`Request.ends` says without
pushing; the event a step reports for it is a frozen value."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockdraft.engine import Request, StepEvent
from blockdraft.sampling import SamplingParams


def _reference(out: list[int], tokens: list[int], stops: set[int], max_new: int) -> tuple[list[int], str | None]:
    out = list(out)
    for tok in tokens:
        out.append(tok)
        if tok in stops:
            return out, "stop"
        if len(out) >= max_new:
            return out, "length"
    return out, None


@given(
    max_new=st.integers(1, 12),
    done=st.integers(0, 11),
    tokens=st.lists(st.integers(0, 6), max_size=10),
    stops=st.sets(st.integers(0, 6), max_size=2),
)
def test_ends_is_what_push_does(max_new: int, done: int, tokens: list[int], stops: set[int]) -> None:
    done = min(done, max_new - 1)  # a running request has room for one more token
    r = Request(id=1, prompt=[1, 2], max_new_tokens=max_new, params=SamplingParams(),
                stops=frozenset(stops), mask_fn=None, generator=None, submitted_at=0.0)
    r.out = [9] * done
    logprobs = [object() for _ in tokens]
    kept, reason = r.ends(tokens)
    assert r.out == [9] * done and r.finish_reason is None  # ends changes nothing
    want, want_reason = _reference(r.out, tokens, stops, max_new)
    assert r.push(tokens, logprobs) == kept == len(want) - done  # type: ignore[arg-type]
    assert r.out == want
    assert r.finish_reason == reason == want_reason
    assert r.out_logprobs == logprobs[:kept]


def test_step_event_is_a_frozen_value() -> None:
    """Events compare, hash, print and copy by their fields, and cannot be changed."""
    ev = StepEvent(3, (1, 2), "stop")
    assert ev == StepEvent(3, (1, 2), finish_reason="stop") and ev != StepEvent(3, (1, 2))
    assert hash(ev) == hash(StepEvent(3, (1, 2), "stop")) and ev.finished
    assert (ev.request_id, ev.tokens, ev.finish_reason, ev.error, ev.logprobs) == (3, (1, 2), "stop", None, ())
    assert dataclasses.replace(ev, tokens=(4,)) == StepEvent(3, (4,), "stop")
    assert dataclasses.asdict(ev)["tokens"] == (1, 2)
    assert repr(ev) == "StepEvent(request_id=3, tokens=(1, 2), finish_reason='stop', error=None, logprobs=())"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.tokens = ()  # type: ignore[misc]
    assert not StepEvent(1, ()).finished
