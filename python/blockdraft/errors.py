"""One-line error messages: the CLI, the pair loader and the tensor-parallel launcher each
report an underlying error by its first line."""

from __future__ import annotations


def error_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type name when the message is empty)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


__all__ = ["error_line"]
