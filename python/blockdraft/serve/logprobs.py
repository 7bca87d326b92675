"""Log-probabilities in OpenAI's two shapes: chat's ``logprobs.content`` and the legacy
completions object (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).

A token's ``bytes`` are its own bytes: a byte-level BPE token (GPT-2's byte-to-character map)
or a ``<0xNN>`` byte-fallback token may hold part of a multi-byte character, which its
decoding alone would show as a replacement character; joined in order, the tokens' bytes are
the text's bytes. Its ``token`` is those bytes as text, or ``bytes:\\xNN...`` when they are
not whole UTF-8 (OpenAI's form). Special tokens (the end token) have their own name as text
and take no room in the completion text (``text_offset`` does not advance).
"""

from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Sequence
from typing import Any

from blockdraft.results import TokenLogprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenTexts:
    """The ``token`` text and ``bytes`` of token ids for one tokenizer (cached per id).

    Args:
        tokenizer: ``convert_ids_to_tokens`` and ``decode``; ``all_special_ids`` when it has
            special tokens.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
        self._bytes = functools.lru_cache(maxsize=1 << 16)(self._raw_bytes)

    def bytes_of(self, token: int) -> bytes:
        return self._bytes(token)

    def text_of(self, token: int) -> str:
        raw = self.bytes_of(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _raw_bytes(self, token: int) -> bytes:
        decoded = str(self.tokenizer.decode([token], skip_special_tokens=False))
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str) and token not in self.special:
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
            table = _byte_level_map()
            if piece and all(c in table for c in piece):
                raw = bytes(table[c] for c in piece)
                # Only when the tokenizer decodes through that map (a byte-level BPE).
                if raw.decode("utf-8", errors="replace") == decoded:
                    return raw
        return decoded.encode("utf-8")

    def chat(self, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat's ``logprobs.content`` entries, one per token."""
        return [{**self._entry(lp.token, lp.logprob),
                 "top_logprobs": [self._entry(i, v) for i, v in lp.top]} for lp in lps]

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text_of(token), "logprob": logprob, "bytes": list(self.bytes_of(token))}


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object of one choice, piece by piece: each piece's
    ``text_offset`` goes on from the previous one's (character offsets in the choice's text).
    ``top_logprobs[i]`` holds the ``k`` likeliest tokens and the chosen one."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def piece(self, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        t = self.texts
        offsets = []
        for lp in lps:
            offsets.append(self.offset)
            if lp.token not in t.special:
                # A token that ends inside a character adds no character until one completes.
                self.offset += len(self._utf8.decode(t.bytes_of(lp.token)))
        return {
            "tokens": [t.text_of(lp.token) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{**{t.text_of(i): v for i, v in lp.top}, t.text_of(lp.token): lp.logprob}
                             for lp in lps],
            "text_offset": offsets,
        }


__all__ = ["CompletionLogprobs", "TokenTexts"]
