"""What every ``blockdraft`` subcommand shares: the one-line error, the device choice, checks of
user input made before any model loads, loading a Hugging Face target named by a flag, and
the facts `--tp` is checked against.

Checks run on cheap facts (``config.json``, the tokenized prompt) so that a wrong flag fails in
a second with a line that names the flag, instead of after loading weights with an error from
deep inside transformers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from blockdraft.config import SUPPORTED_ARCHITECTURES


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


def error_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type name when the message is empty)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


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


def quiet_transformers() -> None:
    """No transformers loading bars: the CLI has its own, and theirs bury error lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def read_model_config(flag: str, path: str | Path) -> dict[str, Any]:
    """The ``config.json`` object of the model directory given as ``flag``."""
    root = Path(path)
    if not root.is_dir():
        raise CliError(f"{flag} {path}: not a directory")
    file = root / "config.json"
    if not file.is_file():
        raise CliError(f"{flag} {path}: no config.json (expected a model directory)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CliError(f"{flag} {path}: cannot read config.json: {error_line(exc)}") from exc
    if not isinstance(raw, dict):
        raise CliError(f"{flag} {path}: config.json holds {type(raw).__name__}, not an object")
    return raw


def drafter_signs(raw: dict[str, Any]) -> str | None:
    """What in a ``config.json`` marks a DFlash drafter (its architecture or a
    ``dflash_config``), or ``None`` for any other model."""
    archs = raw.get("architectures")
    names = [archs] if isinstance(archs, str) else archs if isinstance(archs, list) else []
    found = [a for a in names if a in SUPPORTED_ARCHITECTURES]
    if found:
        return f"architectures {found}"
    if isinstance(raw.get("dflash_config"), dict):
        return "a dflash_config"
    return None


def _architectures(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    return f"architectures {archs}" if archs else "no architectures field"


def check_target_dir(path: str) -> dict[str, Any]:
    """The target's ``config.json``; refused when it is a DFlash drafter's."""
    raw = read_model_config("--target", path)
    signs = drafter_signs(raw)
    if signs is not None:
        raise CliError(f"--target {path} is a DFlash drafter ({signs}), not a target model; "
                       "pass it as --drafter")
    return raw


def check_pair_dirs(target: str, drafter: str) -> dict[str, Any]:
    """Check ``--target``/``--drafter`` from their ``config.json`` files (swapped flags
    included); returns the target's config."""
    target_raw = read_model_config("--target", target)
    drafter_raw = read_model_config("--drafter", drafter)
    target_signs, drafter_signs_ = drafter_signs(target_raw), drafter_signs(drafter_raw)
    if target_signs is not None and drafter_signs_ is None:
        raise CliError(f"--target and --drafter are swapped: --target {target} is a DFlash "
                       f"drafter ({target_signs}) and --drafter {drafter} is not "
                       f"({_architectures(drafter_raw)})")
    if target_signs is not None:
        raise CliError(f"--target {target} is a DFlash drafter ({target_signs}), not a target model")
    if drafter_signs_ is None:
        raise CliError(f"--drafter {drafter} is not a DFlash drafter ({_architectures(drafter_raw)}; "
                       f"expected one of {list(SUPPORTED_ARCHITECTURES)} or a dflash_config)")
    return target_raw


def max_positions(raw: dict[str, Any]) -> int | None:
    """``max_position_embeddings`` of a target ``config.json`` (top level or ``text_config``)."""
    for cfg in (raw, raw.get("text_config")):
        if isinstance(cfg, dict):
            value = cfg.get("max_position_embeddings")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


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


def load_tokenizer(flag: str, path: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - reported as one line naming the flag
        raise CliError(f"{flag} {path}: cannot load the tokenizer: {error_line(exc)}") from exc


def load_target_model(flag: str, path: str | Path, device: Any, dtype: Any) -> Any:
    """A Hugging Face causal LM in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - reported as one line naming the flag
        raise CliError(f"{flag} {path}: cannot load the model: {error_line(exc)}") from exc
    return model.to(device).eval()


def load_drafter_dir(path: str | Path, device: Any, dtype: Any) -> Any:
    """:func:`blockdraft.load_drafter` with its errors naming ``--drafter``."""
    from blockdraft._core import CheckpointError
    from blockdraft.checkpoint import load_drafter

    try:
        return load_drafter(path, device=device, dtype=dtype)
    except (CheckpointError, ValueError) as exc:
        raise CliError(f"--drafter {path}: {error_line(exc)}") from exc


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
