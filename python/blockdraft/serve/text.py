"""Generated tokens to text, released piece by piece, with OpenAI's stop strings.

The text is the decoding of every token so far (special tokens skipped), so what is released
adds up to exactly ``tokenizer.decode(tokens)``. Two kinds of tail are held back until the
next tokens decide them: replacement characters (a multi-byte character whose bytes have not
all arrived) and a tail that begins a stop string (it may still become one, and a stop
string never reaches the client). When a stop string appears, the text ends just before it,
and the tokens that count are those up to the one that completed it (a speculative step may
have produced more; target-only decoding would have stopped there).

With ``min_tokens``, a stop string counts only where it ends after the text of the first
``min_tokens`` tokens (vLLM's rule: no stop before ``min_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PARTIAL = "\ufffd"


class TextStream:
    """The text of one request's tokens.

    Args:
        tokenizer: ``decode(ids, skip_special_tokens=True)``.
        stops: stop strings (non-empty).
        min_tokens: stop strings that end within the first ``min_tokens`` tokens' text do
            not count.

    Attributes:
        used: the tokens that count: every one pushed, or, once a stop string ended the
            text, those up to the one that completed it.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.sent = ""  # text released so far
        self.stopped = False  # a stop string ended the text
        self.used = 0
        self._floor: int | None = 0 if min_tokens == 0 else None  # length of min_tokens' text

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self.sent

    def push(self, tokens: Sequence[int]) -> str:
        """Take new tokens; return the text they release (possibly empty)."""
        if self.stopped or not tokens:
            return ""
        before = len(self.ids)
        self.ids.extend(tokens)
        full = self._decode()
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            self.used = self._completing(before)
            return self._release(full[:cut])
        self.used = len(self.ids)
        end = len(full.rstrip(_PARTIAL))
        end -= self._stop_prefix(full[:end])
        return self._release(full[:end])

    def finish(self) -> str:
        """The held-back tail, once no token will follow."""
        if self.stopped:
            return ""
        return self._release(self._decode())

    def _decode(self, upto: int | None = None) -> str:
        return str(self.tokenizer.decode(self.ids[:upto], skip_special_tokens=True))

    def _completing(self, before: int) -> int:
        """How many tokens it took to complete the stop string (more than ``before``)."""
        for k in range(max(before + 1, self.min_tokens), len(self.ids)):
            if self._stop_at(self._decode(k)) is not None:
                return k
        return len(self.ids)

    def _release(self, upto: str) -> str:
        # Decoding more tokens does not rewrite earlier text for byte-level tokenizers; if
        # one ever did, the rewritten part is not sent again.
        if not upto.startswith(self.sent):
            return ""
        new = upto[len(self.sent):]
        self.sent = upto
        return new

    def _stop_at(self, full: str) -> int | None:
        if self._floor is None:
            if len(self.ids) < self.min_tokens or not self.stops:
                return None
            self._floor = len(self._decode(self.min_tokens))
        floor = self._floor
        found = [i for i in (full.find(s, max(0, floor - len(s) + 1)) for s in self.stops) if i >= 0]
        return max(min(found), len(self.sent)) if found else None

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins a stop string."""
        longest = max((len(s) for s in self.stops), default=0)
        for k in range(min(longest - 1, len(text) - len(self.sent)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


__all__ = ["TextStream"]
