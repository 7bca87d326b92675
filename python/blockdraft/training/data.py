"""Corpora for training: loading text, collecting Python source offline, BPE, token windows.

A corpus is a list of documents (strings). :func:`load_texts` reads a directory of text files or
a JSONL file of ``{"text": ...}`` objects; :func:`collect_python_sources` finds the ``.py`` files
of the running interpreter (standard library, then site-packages) without any download. Training
draws fixed-length windows from one token stream (documents joined by an end-of-text token);
the window offsets of step ``s`` come from a generator seeded by ``(seed, s)``, so a run that is
stopped and resumed sees exactly the windows of an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
MIN_FILE_CHARS = 200
"""Shorter source files are left out of a Python corpus."""
MAX_FILE_CHARS = 100_000
"""Longer source files (generated tables) are left out of a Python corpus."""
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".c", ".h", ".rs", ".js", ".ts", ".java", ".go", ".json")


@dataclass(frozen=True)
class SourceFile:
    """One collected document: where it came from, its text, and the SHA-256 of its text."""

    path: str
    text: str
    digest: str


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_texts(path: str | Path, *, suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[str]:
    """Documents from a directory (every file with one of ``suffixes``, recursively, in sorted
    path order) or a JSONL file (one object per line with a string field ``text``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a JSONL line that is not UTF-8, not JSON, or not an object with a string
            ``text`` (the message starts with ``path:line:``), or no documents at all.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"corpus not found: {root}")
    texts: list[str] = []
    if root.is_dir():
        for file in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes):
            try:
                texts.append(file.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError) as exc:
                log.debug("skipping %s: %s", file, exc)
    else:
        texts = _jsonl_texts(root)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"corpus {root} holds no non-empty documents")
    return texts


def _jsonl_texts(path: Path) -> list[str]:
    texts: list[str] = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[exc.start]:02x} at "
                                 f"column {exc.start + 1})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'text' field, "
                                 f"found {_json_kind(obj)}")
            if "text" not in obj:
                raise ValueError(f"{path}:{lineno}: the object has no 'text' field "
                                 f"(keys: {', '.join(map(repr, list(obj)[:5])) or 'none'})")
            text = obj["text"]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: 'text' must be a string, found {_json_kind(text)}")
            texts.append(text)
    return texts


def _json_kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def python_source_roots() -> list[Path]:
    """The interpreter's standard library, then its site-packages (purelib, platlib), deduplicated."""
    paths = sysconfig.get_paths()
    roots: list[Path] = []
    for key in ("stdlib", "purelib", "platlib"):
        value = paths.get(key)
        if value and Path(value).is_dir() and Path(value).resolve() not in {r.resolve() for r in roots}:
            roots.append(Path(value))
    return roots


def may_fit(size_bytes: int, min_chars: int = MIN_FILE_CHARS, max_chars: int = MAX_FILE_CHARS) -> bool:
    """Whether a UTF-8 file of ``size_bytes`` can hold between ``min_chars`` and ``max_chars``
    characters (a character takes one to four bytes), so that it is worth reading."""
    return min_chars <= size_bytes <= 4 * max_chars


def collect_python_sources(
    roots: Sequence[Path] | None = None,
    *,
    max_chars: int,
    min_file_chars: int = MIN_FILE_CHARS,
    max_file_chars: int = MAX_FILE_CHARS,
    keep: Callable[[Path], bool] | None = None,
) -> list[SourceFile]:
    """``.py`` files under ``roots`` (default :func:`python_source_roots`), deduplicated by content.

    Files are visited root by root in sorted path order (so the standard library comes first)
    and taken until ``max_chars`` characters are collected. Files that are not UTF-8, shorter
    than ``min_file_chars`` or longer than ``max_file_chars`` (generated tables) are skipped;
    ``site-packages`` inside the standard library root is left to its own root. ``keep``, when
    given, must accept a file for it to be read (e.g. a
    :class:`~blockdraft.training.builtin.licences.PermissiveFilter`).
    """
    chosen = list(roots) if roots is not None else python_source_roots()
    seen: set[str] = set()
    out: list[SourceFile] = []
    total = 0
    skip_dirs = {"__pycache__", "site-packages", "dist-packages"}
    for root in chosen:
        files: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
            files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
        for file in files:
            if keep is not None and not keep(file):
                continue
            try:
                if not may_fit(file.stat().st_size, min_file_chars, max_file_chars):
                    continue
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not min_file_chars <= len(text) <= max_file_chars:
                continue
            digest = _digest(text)
            if digest in seen:
                continue
            seen.add(digest)
            out.append(SourceFile(str(file), text, digest))
            total += len(text)
            if total >= max_chars:
                log.info("collected %d files, %d chars (budget reached)", len(out), total)
                return out
    log.info("collected %d files, %d chars", len(out), total)
    return out


def split_heldout(files: Sequence[SourceFile], every: int) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held out): a whole file is held out when its digest, read as a number, is 0
    modulo ``every``; the choice depends only on the file's content."""
    if every < 2:
        raise ValueError(f"every must be >= 2, not {every}")
    train: list[SourceFile] = []
    held: list[SourceFile] = []
    for f in files:
        (held if int(f.digest[:12], 16) % every == 0 else train).append(f)
    return train, held


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` with ``<|endoftext|>`` (eos, pad) and
    ``<|mask|>`` (mask) special tokens, as a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, mask_token=MASK_TOKEN
    )


def encode_stream(texts: Sequence[str], tokenizer: Any, eos_id: int | None) -> Tensor:
    """All documents tokenized and joined (``eos_id`` after each when given): [N] int64."""
    ids: list[int] = []
    batch = 256
    for i in range(0, len(texts), batch):
        enc = tokenizer(list(texts[i : i + batch]), add_special_tokens=False)["input_ids"]
        for row in enc:
            ids.extend(row)
            if eos_id is not None:
                ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator of one training step, a pure function of ``(seed, step)``."""
    mixed = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little"))


def sample_windows(stream: Tensor, n: int, length: int, gen: torch.Generator) -> Tensor:
    """``n`` windows of ``length`` consecutive tokens at random offsets of ``stream``: [n, length]."""
    if stream.numel() <= length:
        raise ValueError(f"corpus has {stream.numel()} tokens; windows need more than {length}")
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])
