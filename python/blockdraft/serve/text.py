"""Generated tokens to text, released piece by piece, with OpenAI's stop strings.

The text is the decoding of every token so far (special tokens skipped), so what is released
adds up to exactly ``tokenizer.decode(tokens)``. Two kinds of tail are held back until the
next tokens decide them: replacement characters (a multi-byte character whose bytes have not
all arrived) and a tail that begins a stop string (it may still become one, and a stop
string never reaches the client). When a stop string appears, the text ends just before it.
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
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.sent = ""  # text released so far
        self.stopped = False  # a stop string ended the text

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self.sent

    def push(self, tokens: Sequence[int]) -> str:
        """Take new tokens; return the text they release (possibly empty)."""
        if self.stopped or not tokens:
            return ""
        self.ids.extend(tokens)
        full = self._decode()
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        end = len(full.rstrip(_PARTIAL))
        end -= self._stop_prefix(full[:end])
        return self._release(full[:end])

    def finish(self) -> str:
        """The held-back tail, once no token will follow."""
        if self.stopped:
            return ""
        return self._release(self._decode())

    def _decode(self) -> str:
        return str(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _release(self, upto: str) -> str:
        # Decoding more tokens does not rewrite earlier text for byte-level tokenizers; if
        # one ever did, the rewritten part is not sent again.
        if not upto.startswith(self.sent):
            return ""
        new = upto[len(self.sent):]
        self.sent = upto
        return new

    def _stop_at(self, full: str) -> int | None:
        found = [i for i in (full.find(s) for s in self.stops) if i >= 0]
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
