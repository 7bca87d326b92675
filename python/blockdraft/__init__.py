"""blockdraft: the proposer side of DFlash speculative decoding.

A small block-diffusion drafter reads hidden states from several layers of a large target model
and drafts a block of tokens in one forward pass; the target verifies them. blockdraft keeps the
drafter's context K/V in a paged cache drawn from one shared pool, slides per-sequence context
windows instead of running out of memory, and enforces a strict state lifecycle.
"""

from __future__ import annotations

import logging

from blockdraft._core import (
    DEFAULT_CTX_CAP,
    ENV_CTX_CAP,
    PAD_SLOT,
    AppendPlan,
    BlockdraftError,
    BlockPool,
    CheckpointError,
    ConfigError,
    ContextState,
    InvalidStateError,
    PoolExhaustedError,
    PrecomputePlan,
    SlidePlan,
    batch_decline_reason,
    ctx_ceiling,
    ctx_window,
    propose_batch_max,
    read_ctx_cap,
    split_bands,
)
from blockdraft._core import __version__ as __version__
from blockdraft.checkpoint import load_drafter
from blockdraft.config import DrafterConfig, RopeConfig
from blockdraft.models import DFlash2Drafter, DFlashDrafter, Draft, ReferenceAttend
from blockdraft.target import TargetAdapter, TargetOutput
from blockdraft.engine import GenerationResult, GenerationStats, SpeculativeEngine, generate
from blockdraft.levers import Levers, read_levers
from blockdraft.proposer import DFlashProposer, DFlashState

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "DEFAULT_CTX_CAP",
    "ENV_CTX_CAP",
    "PAD_SLOT",
    "AppendPlan",
    "BlockPool",
    "BlockdraftError",
    "CheckpointError",
    "ConfigError",
    "ContextState",
    "DFlashProposer",
    "DFlashState",
    "GenerationResult",
    "GenerationStats",
    "Levers",
    "SpeculativeEngine",
    "InvalidStateError",
    "PoolExhaustedError",
    "PrecomputePlan",
    "SlidePlan",
    "batch_decline_reason",
    "ctx_ceiling",
    "ctx_window",
    "generate",
    "propose_batch_max",
    "read_ctx_cap",
    "read_levers",
    "split_bands",
    "DFlash2Drafter",
    "DFlashDrafter",
    "Draft",
    "DrafterConfig",
    "ReferenceAttend",
    "RopeConfig",
    "TargetAdapter",
    "TargetOutput",
    "load_drafter",
]
