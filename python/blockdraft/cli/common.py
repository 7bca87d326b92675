"""What every ``blockdraft`` subcommand shares: the parser, the one-line error, the device
choice, checks of user input made before any model loads, and the facts `--tp` is checked
against.

Checks run on cheap facts (``config.json``, the tokenized prompt) so that a wrong flag fails in
a second with a line that names the flag, instead of after loading weights with an error from
deep inside transformers. Reading and loading model directories is
:mod:`blockdraft.pair.load`'s; its errors name the flag too and print as the same one line.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import traceback
from typing import Any, NoReturn

from blockdraft.errors import error_line


class CliError(Exception):
    """A user-facing problem reported as one line (exit code 2)."""


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` that shows each flag's default, unless its help text already states one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = not any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))
        if action.option_strings and shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """The parser of ``blockdraft`` and of every subcommand (``add_subparsers`` makes its
    subcommands of the same class): a usage error is one ``blockdraft: error:`` line naming
    the flag and what it accepts, exit code 2, as every other error; ``--help`` shows defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"blockdraft: error: {message} (see {self.prog} --help)\n")


_bar_lock = threading.RLock()


def progress_bar(**kwargs: Any) -> Any:
    """A ``tqdm`` bar (``kwargs`` as tqdm's) that locks with a thread lock only. tqdm's default
    lock holds a multiprocessing semaphore; a tensor-parallel rank killed with one leaves it to
    the resource tracker, whose warning would then follow the command's one error line."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    tqdm.set_lock(_bar_lock)
    return tqdm(**kwargs)


def report_failure(exc: BaseException, *, debug: bool) -> int:
    """Print ``blockdraft: error: <one line>`` (after the traceback with ``debug``, and the
    failed rank's own traceback for a tensor-parallel rank failure); return 2."""
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        remote = getattr(exc, "remote_traceback", None)
        if remote:
            print(remote, file=sys.stderr, end="")
    print(f"blockdraft: error: {error_line(exc)}", file=sys.stderr)
    return 2


def require_min(flag: str, value: int, minimum: int = 1) -> None:
    """Raise :class:`CliError` naming ``flag`` when ``value < minimum``."""
    if value < minimum:
        raise CliError(f"{flag} must be >= {minimum}, not {value}")


def require_temperature(flag: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise CliError(f"{flag} must be a finite number >= 0 (0 = greedy), not {value}")


def check_text(what: str, text: str) -> None:
    """Refuse text that cannot be encoded as UTF-8.

    Python hands undecodable command-line bytes over as lone surrogates (``surrogateescape``);
    tokenizers reject those with a type error that names neither the text nor the byte.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what_char = (f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF
                     else f"character U+{code:04X}")
        raise CliError(f"{what} is not valid UTF-8 ({what_char} at character {exc.start})") from None


def pick_device(name: str | None) -> Any:
    """``torch.device`` for ``--device`` (``None``/``auto``: CUDA when present, else CPU)."""
    import torch

    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CliError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"unsupported device {name!r} (use cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"device {name!r} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CliError(f"device {name!r} does not exist ({torch.cuda.device_count()} GPUs)")
    return device


def model_dtype(device: Any) -> Any:
    """The dtype a ``--target``/``--drafter`` pair runs in: :func:`blockdraft.devices.default_dtype`."""
    from blockdraft.devices import default_dtype

    return default_dtype(device)


def check_lengths(prompt_tokens: int, max_new_tokens: int, limit: int | None,
                  *, what: str = "the prompt") -> None:
    """Prompt plus new tokens must fit the target's ``max_position_embeddings`` (``limit``):
    past it the target's positions are ones it was never trained on and acceptance collapses."""
    from blockdraft.pair.checks import context_problem

    problem = context_problem(prompt_tokens, max_new_tokens, limit, prompt=what,
                              limit_name="the target's max_position_embeddings",
                              new_name="--max-new-tokens")
    if problem is not None:
        raise CliError(problem)


def tp_sizes(raw: dict[str, Any]) -> tuple[str, dict[str, int]]:
    """The target's architecture and the counts ``--tp`` must divide, from its config."""
    text = raw.get("text_config")
    cfg: dict[str, Any] = text if isinstance(text, dict) else raw
    archs = raw.get("architectures") or ["the target"]
    heads = cfg.get("num_attention_heads")
    sizes = {"num_attention_heads": heads,
             "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
             "intermediate_size": cfg.get("intermediate_size")}
    return str(archs[0]), {k: v for k, v in sizes.items() if isinstance(v, int) and not isinstance(v, bool)}


def tp_device(name: str | None) -> str:
    """``cpu`` or ``cuda`` for the ranks (each rank of a CUDA group takes its own GPU)."""
    import torch

    if name is None or name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise CliError(f"--device {name} with --tp: give cpu or cuda (rank r runs on cuda:r)")
    if name == "cuda" and not torch.cuda.is_available():
        raise CliError("device 'cuda' requested but CUDA is not available")
    return name
