"""blockdraft: DFlash speculative decoding with a Rust core.

A small block-diffusion drafter reads hidden states from several layers of a large target model
and drafts a whole block of tokens in one forward pass; the target verifies them. blockdraft
keeps the drafter's context K/V in a paged cache drawn from one shared pool, slides
per-sequence context windows instead of running out of memory, enforces a strict state
lifecycle, and runs the target on its own paged runtime.

What is here:

* generation: :func:`generate`, :class:`SpeculativeEngine`, :func:`decode` (target only),
  each taking a :class:`SamplingParams` (greedy when none);
* the proposer contract: :class:`DFlashProposer`, :class:`DFlashState`, :class:`Levers`;
* the target runtime: :class:`TargetRuntime`; the hooked HF adapter :class:`TargetAdapter`;
* loading: :func:`load_drafter`, :class:`DrafterConfig`, the drafter modules;
* the pool and the window: :class:`BlockPool`, :func:`ctx_window`, :func:`ctx_ceiling`;
* errors: :class:`BlockdraftError` and its subclasses.

The Rust core's plan types and policy functions are in :mod:`blockdraft.core`.
"""

from __future__ import annotations

import logging

from blockdraft import core as core
from blockdraft._core import (
    BlockdraftError,
    BlockPool,
    CheckpointError,
    ConfigError,
    InvalidStateError,
    PoolExhaustedError,
    ctx_ceiling,
    ctx_window,
)
from blockdraft._core import __version__ as __version__
from blockdraft.checkpoint import load_drafter
from blockdraft.config import DrafterConfig, RopeConfig
from blockdraft.engine import SpeculativeEngine, generate
from blockdraft.levers import Levers, read_levers
from blockdraft.models import DFlash2Drafter, DFlashDrafter
from blockdraft.proposer import DFlashProposer, DFlashState
from blockdraft.results import GenerationResult, GenerationStats, TokenLogprob
from blockdraft.sampling import SamplingParams
from blockdraft.target import TargetAdapter, TargetOutput, TargetRuntime, decode

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "BlockPool",
    "BlockdraftError",
    "CheckpointError",
    "ConfigError",
    "DFlash2Drafter",
    "DFlashDrafter",
    "DFlashProposer",
    "DFlashState",
    "DrafterConfig",
    "GenerationResult",
    "GenerationStats",
    "InvalidStateError",
    "Levers",
    "PoolExhaustedError",
    "RopeConfig",
    "SamplingParams",
    "SpeculativeEngine",
    "TargetAdapter",
    "TargetOutput",
    "TargetRuntime",
    "TokenLogprob",
    "core",
    "ctx_ceiling",
    "ctx_window",
    "decode",
    "generate",
    "load_drafter",
    "read_levers",
]
