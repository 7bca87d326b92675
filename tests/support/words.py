"""A word-level tokenizer for pairs with random weights: one word per id (``w0`` .. ``w<V-1>``).

Random pairs have no tokenizer of their own; the tests that write them as Hugging Face
checkpoints, and the server soak on a random pair, need one that round-trips ids."""

from __future__ import annotations

import random
from typing import Any


def word_tokenizer(vocab: int, *, eos: bool = False) -> Any:
    """A fast tokenizer of ``vocab`` words, ``w0`` the unknown word; with ``eos`` the last id,
    ``w<vocab-1>``, is its end-of-sequence token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = {"eos_token": f"w{vocab - 1}"} if eos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", **extra)  # type: ignore[no-untyped-call]


def random_words(rng: random.Random, vocab: int, count: int) -> str:
    """``count`` words of a :func:`word_tokenizer` vocabulary, neither the unknown word nor
    the last (the end-of-sequence token)."""
    return " ".join(f"w{rng.randrange(1, vocab - 1)}" for _ in range(count))
