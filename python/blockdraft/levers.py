"""Environment levers of the proposer (``BLOCKDRAFT_DFLASH_*``).

Each lever is read once, when a :class:`~blockdraft.DFlashProposer` is built, so a bad value
fails loudly at construction (a :class:`~blockdraft.ConfigError` naming the variable) instead of
in the middle of a serve.

| variable | default | meaning |
| --- | --- | --- |
| ``BLOCKDRAFT_DFLASH_CTX_CAP`` | 16384 | context-window cap in rows; ``0`` = uncapped |
| ``BLOCKDRAFT_DFLASH_BATCH_PROPOSE`` | 16 | ``propose_batch`` width; below 2 turns batching off |
| ``BLOCKDRAFT_DFLASH_BATCHED_PRECOMPUTE`` | on | one ctx K/V precompute for a whole batch |
| ``BLOCKDRAFT_DFLASH_DRAFT_CAP`` | unset (all B-1) | at most this many drafts per sequence |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from blockdraft._core import ConfigError, read_ctx_cap

ENV_BATCH_PROPOSE = "BLOCKDRAFT_DFLASH_BATCH_PROPOSE"
ENV_BATCHED_PRECOMPUTE = "BLOCKDRAFT_DFLASH_BATCHED_PRECOMPUTE"
ENV_DRAFT_CAP = "BLOCKDRAFT_DFLASH_DRAFT_CAP"

DEFAULT_BATCH_PROPOSE = 16

_TRUE = frozenset({"1", "true", "on", "yes"})
_FALSE = frozenset({"0", "false", "off", "no"})


@dataclass(frozen=True)
class Levers:
    """The proposer's environment levers, validated.

    Attributes:
        ctx_cap: context-window cap in rows (0 = uncapped).
        batch_propose: requested ``propose_batch`` width (< 2 = batching off).
        batched_precompute: whether ``propose_batch`` computes every sequence's ctx K/V in one
            GEMM.
        draft_cap: at most this many drafts per sequence (``None`` = all ``B - 1``).
    """

    ctx_cap: int
    batch_propose: int = DEFAULT_BATCH_PROPOSE
    batched_precompute: bool = True
    draft_cap: int | None = None


def _int_var(env: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum}")
    return value


def _bool_var(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, on/off, yes/no)")


def read_levers() -> Levers:
    """Read and validate every lever from the process environment.

    Raises:
        ConfigError: a value is not usable; the message names the variable.
    """
    width = _int_var(os.environ, ENV_BATCH_PROPOSE, minimum=0)
    return Levers(
        ctx_cap=read_ctx_cap(),
        batch_propose=DEFAULT_BATCH_PROPOSE if width is None else width,
        batched_precompute=_bool_var(os.environ, ENV_BATCHED_PRECOMPUTE, True),
        draft_cap=_int_var(os.environ, ENV_DRAFT_CAP, minimum=1),
    )
