"""Generated tokens to released text (:mod:`blockdraft.serve.text`): partial characters and
the beginnings of stop strings are held back, a stop string ends the text just before it, and
what is released adds up to the decoding of the tokens."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blockdraft.pretrained
from blockdraft.serve.text import TextStream


class _ByteTokenizer:
    """Token ids are UTF-8 bytes: a multi-byte character arrives one byte at a time."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("stops, want", [
    ((), "héllo STOP wörld ✓"),
    (("STOP",), "héllo "),
    (("STOP", "wör"), "héllo "),
    (("wörld",), "héllo STOP "),
    (("✓",), "héllo STOP wörld "),
    (("S!",), "héllo STOP wörld ✓"),  # begins like a stop string, never becomes one
])
def test_text_stream_holds_back_partial_characters_and_stop_prefixes(stops: tuple[str, ...], want: str) -> None:
    raw = "héllo STOP wörld ✓".encode()
    for step in (1, 2, 3, len(raw)):
        stream = TextStream(_ByteTokenizer(), stops)
        pieces = []
        for i in range(0, len(raw), step):
            piece = stream.push(list(raw[i:i + step]))
            assert "\ufffd" not in piece
            assert not any(s in stream.text for s in stops)
            pieces.append(piece)
        pieces.append(stream.finish())
        assert "".join(pieces) == stream.text == want, step
        assert stream.stopped == (want != raw.decode())


def _reference(raw: bytes, bounds: list[int], stops: tuple[str, ...]) -> tuple[str, bool]:
    """The text a client is owed and whether a stop string ended it: generation stops at the
    first push after which the decoded text contains a stop string, and the text ends before
    the earliest one."""
    for end in bounds:
        text = raw[:end].decode("utf-8", errors="replace")
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[:min(found)], True
    return raw.decode(), False


ALPHABET = "ab é✓\n"


@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3).map(tuple),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=10),
)
@settings(max_examples=300, deadline=None)
def test_released_text_equals_a_plain_reference(text: str, stops: tuple[str, ...], sizes: list[int]) -> None:
    raw = text.encode()
    bounds: list[int] = []
    while not bounds or bounds[-1] < len(raw):
        bounds.append(min(len(raw), (bounds[-1] if bounds else 0) + sizes[len(bounds) % len(sizes)]))
    want, stopped = _reference(raw, bounds, stops)
    stream = TextStream(_ByteTokenizer(), stops)
    pieces, start = [], 0
    for end in bounds:
        piece = stream.push(list(raw[start:end]))
        start = end
        assert "\ufffd" not in piece
        assert want.startswith(stream.text)
        assert not any(s in stream.text for s in stops)
        pieces.append(piece)
    pieces.append(stream.finish())
    assert "".join(pieces) == stream.text == want
    assert stream.stopped == stopped


def _counting_stop(text: str, stops: tuple[str, ...], floor: int) -> int | None:
    """Where the earliest stop string that ends after ``floor`` characters begins."""
    starts = [i for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > floor]
    return min(starts) if starts else None


@given(
    text=st.text(ALPHABET, max_size=30),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=3).map(tuple),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=10),
    min_tokens=st.integers(0, 12),
)
@settings(max_examples=300, deadline=None)
def test_min_tokens_and_the_tokens_that_count(text: str, stops: tuple[str, ...], sizes: list[int],
                                              min_tokens: int) -> None:
    """A stop string counts only where it ends after the first ``min_tokens`` tokens' text;
    once one ends the text, the tokens that count are those up to the one completing it."""
    raw = text.encode()
    bounds: list[int] = []
    while not bounds or bounds[-1] < len(raw):
        bounds.append(min(len(raw), (bounds[-1] if bounds else 0) + sizes[len(bounds) % len(sizes)]))
    floor = len(raw[:min_tokens].decode("utf-8", errors="replace"))
    want, used, stopped = raw.decode(), len(raw), False
    previous = 0
    for end in bounds:
        seen = raw[:end].decode("utf-8", errors="replace")
        cut = _counting_stop(seen, stops, floor) if end >= min_tokens else None
        if cut is not None:
            want, stopped = seen[:cut], True
            used = next(k for k in range(previous + 1, end + 1) if k >= min_tokens and _counting_stop(
                raw[:k].decode("utf-8", errors="replace"), stops, floor) is not None)
            break
        previous = end
    stream = TextStream(_ByteTokenizer(), stops, min_tokens)
    start = 0
    pieces = []
    for end in bounds:
        pieces.append(stream.push(list(raw[start:end])))
        start = end
    pieces.append(stream.finish())
    assert "".join(pieces) == stream.text == want
    assert (stream.stopped, stream.used) == (stopped, used)


def test_after_a_stop_nothing_more_is_released() -> None:
    stream = TextStream(_ByteTokenizer(), ("\n",))
    assert stream.push(list(b"ab\ncd")) == "ab"
    assert stream.stopped
    assert stream.push(list(b"ef")) == "" and stream.finish() == ""
    assert stream.text == "ab"


def test_no_tokens_release_nothing() -> None:
    stream = TextStream(_ByteTokenizer())
    assert stream.push([]) == "" and stream.finish() == "" and stream.text == ""
    assert not stream.stopped


def test_a_held_back_stop_prefix_is_released_at_the_finish() -> None:
    stream = TextStream(_ByteTokenizer(), ("</s>",))
    assert stream.push(list(b"x </")) == "x "
    assert stream.finish() == "</"
    assert stream.text == "x </" and not stream.stopped


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return blockdraft.pretrained.load_tokenizer()


def test_the_builtin_tokenizer_one_token_at_a_time(tokenizer: Any) -> None:
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # ✓ é\n"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer)
    pieces = [stream.push([i]) for i in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in p for p in pieces)

    stream = TextStream(tokenizer, ("else",))
    out = "".join(stream.push([i]) for i in ids) + stream.finish()
    assert out == text[:text.index("else")] and stream.stopped


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    stream = TextStream(tokenizer)
    ids = tokenizer.encode("x = 1")
    assert stream.push(ids + [tokenizer.eos_token_id]) + stream.finish() == "x = 1"
