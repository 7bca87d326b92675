"""Log-probabilities in OpenAI's shapes (:mod:`blockdraft.serve.logprobs`): each token's own
bytes (a byte-level token may hold part of a character), its text, chat's entries and the
legacy completions object with its character offsets."""

from __future__ import annotations

from typing import Any

import pytest

import blockdraft.pretrained
from blockdraft.results import TokenLogprob
from blockdraft.serve.logprobs import CompletionLogprobs, TokenTexts

TEXT = 'def f(x):\n    return "é€✓" + x  # ünïcode\n'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return blockdraft.pretrained.load_tokenizer()


def test_token_bytes_join_into_the_text(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(TEXT)
    assert b"".join(texts.bytes_of(i) for i in ids) == TEXT.encode()
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert partial  # the premise: some tokens hold part of a character
    for i in partial:
        raw = texts.bytes_of(i)
        assert texts.text_of(i) == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    whole = [i for i in ids if i not in partial]
    assert all(texts.text_of(i) == tokenizer.decode([i]) for i in whole)
    eos = tokenizer.eos_token_id
    assert texts.text_of(eos) == tokenizer.eos_token and texts.bytes_of(eos) == tokenizer.eos_token.encode()


class _SentencePieceLike:
    """Tokens ``▁word`` (a leading space) and ``<0xNN>`` byte fallbacks."""

    pieces = {0: "</s>", 1: "▁hello", 2: "<0xE2>", 3: "<0x9C>", 4: "<0x93>", 5: "world"}
    all_special_ids = [0]

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.pieces[i]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        raw = b""
        for i in ids:
            piece = self.pieces[i]
            if piece.startswith("<0x"):
                raw += bytes([int(piece[3:5], 16)])
            elif i not in self.all_special_ids or not skip_special_tokens:
                raw += piece.replace("▁", " ").encode()
        text = raw.decode("utf-8", errors="replace")
        return text.lstrip(" ") if len(ids) == 1 else text  # one piece alone loses its space


def test_byte_fallback_tokens_are_their_byte() -> None:
    texts = TokenTexts(_SentencePieceLike())
    assert [texts.bytes_of(i) for i in (2, 3, 4)] == [b"\xe2", b"\x9c", b"\x93"]
    assert texts.text_of(2) == "bytes:\\xe2"
    assert texts.bytes_of(5) == b"world" and texts.text_of(0) == "</s>"


def test_chat_entries(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    a, b = tokenizer.encode("def")[0], tokenizer.encode(" return")[0]
    got = texts.chat([TokenLogprob(a, -0.25, ((a, -0.25), (b, -2.0))), TokenLogprob(b, -1.5)])
    assert got == [
        {"token": "def", "logprob": -0.25, "bytes": list(b"def"), "top_logprobs": [
            {"token": "def", "logprob": -0.25, "bytes": list(b"def")},
            {"token": " return", "logprob": -2.0, "bytes": list(b" return")}]},
        {"token": " return", "logprob": -1.5, "bytes": list(b" return"), "top_logprobs": []},
    ]


def test_completion_offsets_count_characters_of_the_text(tokenizer: Any) -> None:
    ids = [*tokenizer.encode(TEXT), tokenizer.eos_token_id]
    lps = [TokenLogprob(i, -1.0, ((ids[0], -0.5),)) for i in ids]
    legacy = CompletionLogprobs(TokenTexts(tokenizer))
    pieces = [legacy.piece(lps[:5]), legacy.piece(lps[5:9]), legacy.piece(lps[9:])]
    offsets = [o for p in pieces for o in p["text_offset"]]
    for k, off in enumerate(offsets):
        before = tokenizer.decode(ids[:k], skip_special_tokens=True)
        # A token inside a character starts where that character does.
        assert off == len(before.rstrip("\ufffd")), k
    tokens = [t for p in pieces for t in p["tokens"]]
    assert tokens[-1] == tokenizer.eos_token and len(tokens) == len(ids)
    first = pieces[0]
    assert first["token_logprobs"] == [-1.0] * 5
    # The k likeliest and the chosen token.
    assert first["top_logprobs"][0] == {"def": -1.0} and first["top_logprobs"][1] == {"def": -0.5, " f": -1.0}
