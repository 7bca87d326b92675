"""Environment levers of the proposer (``BLOCKDRAFT_DFLASH_*``) and of the target runtime.

Each lever is read once, when a :class:`~blockdraft.DFlashProposer` (or a target runtime's
forward) is built, so a bad value fails loudly at construction (a
:class:`~blockdraft.ConfigError` naming the variable) instead of in the middle of a serve.

| variable | default | meaning |
| --- | --- | --- |
| ``BLOCKDRAFT_DFLASH_CTX_CAP`` | 16384 | context-window cap in rows; ``0`` = uncapped |
| ``BLOCKDRAFT_DFLASH_SLIDE`` | 0.125 | share of a full window a slide leaves free, in ``[0, 1)`` |
| ``BLOCKDRAFT_DFLASH_BATCH_PROPOSE`` | 16 | ``propose_batch`` width; below 2 turns batching off |
| ``BLOCKDRAFT_DFLASH_BATCHED_PRECOMPUTE`` | on | one ctx K/V precompute for a whole batch |
| ``BLOCKDRAFT_DFLASH_DRAFT_CAP`` | unset (all B-1) | at most this many drafts per sequence |
| ``BLOCKDRAFT_SKINNY_GEMM`` | on (CUDA) | target and drafter: weight-streaming GEMMs for forwards of <= 16 rows |
| ``BLOCKDRAFT_DEVICE_DRAFTS`` | on | engine: greedy drafts stay on the device into the verify |
| ``BLOCKDRAFT_DRAFT_AHEAD`` | on | engine: the next step's drafts launched before a step's bookkeeping |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from blockdraft._core import DEFAULT_SLIDE, ConfigError, read_ctx_cap, read_slide

ENV_BATCH_PROPOSE = "BLOCKDRAFT_DFLASH_BATCH_PROPOSE"
ENV_BATCHED_PRECOMPUTE = "BLOCKDRAFT_DFLASH_BATCHED_PRECOMPUTE"
ENV_DRAFT_CAP = "BLOCKDRAFT_DFLASH_DRAFT_CAP"
ENV_SKINNY_GEMM = "BLOCKDRAFT_SKINNY_GEMM"
ENV_DEVICE_DRAFTS = "BLOCKDRAFT_DEVICE_DRAFTS"
ENV_DRAFT_AHEAD = "BLOCKDRAFT_DRAFT_AHEAD"

DEFAULT_BATCH_PROPOSE = 16

_TRUE = frozenset({"1", "true", "on", "yes"})
_FALSE = frozenset({"0", "false", "off", "no"})


@dataclass(frozen=True)
class Levers:
    """The proposer's environment levers, validated.

    Attributes:
        ctx_cap: context-window cap in rows (0 = uncapped).
        slide: the share of a full window a slide leaves free beyond the commit's rows, in
            ``[0, 1)``: one recompute of the kept rows then serves the next ``slide * window``
            committed rows (0 slides by exactly the rows a commit needs, recomputing the
            window on every commit once it is full).
        batch_propose: requested ``propose_batch`` width (< 2 = batching off).
        batched_precompute: whether ``propose_batch`` computes every sequence's ctx K/V in one
            GEMM.
        draft_cap: at most this many drafts per sequence (``None`` = all ``B - 1``).
    """

    ctx_cap: int
    slide: float = DEFAULT_SLIDE
    batch_propose: int = DEFAULT_BATCH_PROPOSE
    batched_precompute: bool = True
    draft_cap: int | None = None

    def __post_init__(self) -> None:
        # Checked here, not at the first slide: a bad share would otherwise fail mid-serve.
        if isinstance(self.slide, bool) or not isinstance(self.slide, (int, float)):
            raise TypeError(f"slide must be a float, not {type(self.slide).__name__}")
        if not 0.0 <= self.slide < 1.0:
            raise ValueError(f"slide must be in [0, 1), got {self.slide}")


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
        slide=read_slide(),
        batch_propose=DEFAULT_BATCH_PROPOSE if width is None else width,
        batched_precompute=_bool_var(os.environ, ENV_BATCHED_PRECOMPUTE, True),
        draft_cap=_int_var(os.environ, ENV_DRAFT_CAP, minimum=1),
    )


def read_skinny_gemm(env: Mapping[str, str] | None = None) -> bool | None:
    """:data:`ENV_SKINNY_GEMM`: whether the target runtime's forward (and the drafter's fused
    view) runs its projections of at most 16 rows (fp16/bf16, Triton backend) on the
    weight-streaming kernels of :mod:`blockdraft.kernels.skinny_gemm` instead of
    ``torch.nn.functional.linear``.

    Returns:
        ``True`` or ``False`` as set; ``None`` when unset, which the runtime reads as on where
        Triton compiles its kernels (CUDA) and off under Triton's CPU interpreter, where they
        would be interpreted row by row.

    Raises:
        ConfigError: a value that is not a boolean word; the message names the variable.
    """
    source = os.environ if env is None else env
    raw = source.get(ENV_SKINNY_GEMM)
    if raw is None or raw.strip() == "":
        return None
    return _bool_var(source, ENV_SKINNY_GEMM, True)


def read_device_drafts(env: Mapping[str, str] | None = None) -> bool:
    """:data:`ENV_DEVICE_DRAFTS` (default on): whether the engine leaves a step's greedy drafts
    on the device, for its target runtime's verify graph to take them there (one read from the
    device per step, after the verify, instead of one after the drafter and one after the
    verify). Off is the A/B baseline; the tokens are the same either way.

    Raises:
        ConfigError: a value that is not a boolean word; the message names the variable.
    """
    return _bool_var(os.environ if env is None else env, ENV_DEVICE_DRAFTS, True)


def read_draft_ahead(env: Mapping[str, str] | None = None) -> bool:
    """:data:`ENV_DRAFT_AHEAD` (default on): whether the engine, where a step's drafts stay on
    the device (:func:`read_device_drafts`), launches the next step's drafts as soon as a
    step's context rows are committed, before the rest of its bookkeeping (the target's
    records, the requests' events, the caller's work between steps, the next admission), so
    the device runs the drafter while the host does that work. Off is the A/B baseline; the
    tokens are the same either way.

    Raises:
        ConfigError: a value that is not a boolean word; the message names the variable.
    """
    return _bool_var(os.environ if env is None else env, ENV_DRAFT_AHEAD, True)
