"""The target model's side: what the engine needs from a target, and the two ways to run one.

| module | concept |
| --- | --- |
| ``head`` | :class:`TargetHead`: what a drafter reads (embeddings, output head), checked against the drafter |
| ``backend`` | :class:`TargetBackend`, the interface the engine steps; :class:`RuntimeTarget` on the runtime |
| ``select`` | :func:`choose_runtime` and :func:`open_target`: which backend runs a target, and building it |
| ``layers`` | :func:`find_layers`: where a causal LM's decoder layers are; :func:`text_config` and its sizes |
| ``adapter`` | :class:`TargetAdapter`: an HF causal LM's embeddings, head, and capture of the drafter's layers |
| ``hf`` | :class:`HFTarget`: the model's own HF forward, one sequence at a time, under chosen attention backends |
| ``runtime/`` | :class:`TargetRuntime` and :func:`decode`: spec, fused weights, shards, paged K/V, forward, graphs |
"""

from __future__ import annotations

from blockdraft.target.adapter import TargetAdapter, TargetOutput
from blockdraft.target.backend import RUNTIMES, ChunkFn, RuntimeTarget, TargetBackend, resolve_runtime
from blockdraft.target.head import TargetHead
from blockdraft.target.hf import DEFAULT_SDPA_BACKENDS, HFTarget, validate_sdpa_backends
from blockdraft.target.layers import DecoderLayers, config_int, find_layers, text_config
from blockdraft.target.runtime import (
    FAMILIES,
    ForwardOutput,
    TargetRuntime,
    TargetSpec,
    check_prompts,
    decode,
    model_shard,
)

__all__ = [
    "DEFAULT_SDPA_BACKENDS",
    "FAMILIES",
    "RUNTIMES",
    "ChunkFn",
    "DecoderLayers",
    "ForwardOutput",
    "HFTarget",
    "RuntimeTarget",
    "TargetAdapter",
    "TargetBackend",
    "TargetHead",
    "TargetOutput",
    "TargetRuntime",
    "TargetSpec",
    "check_prompts",
    "config_int",
    "decode",
    "find_layers",
    "model_shard",
    "resolve_runtime",
    "text_config",
    "validate_sdpa_backends",
]
