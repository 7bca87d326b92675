"""blockdraft's own runtime for Hugging Face decoder-only targets (Llama, Mistral, Qwen2, Qwen3).

| module | concept |
| --- | --- |
| ``spec`` | which architectures run, and what is read from a loaded model |
| ``weights`` | fused q/k/v and gate/up weights that are the model's own storage |
| ``shard`` | a target split over tensor-parallel ranks: each rank's weights and shapes |
| ``forward`` | one forward over the new rows of many sequences |
| ``runtime`` | :class:`TargetRuntime`: sequences, forwards, accept, free |
| ``decode`` | :func:`decode`: target-only decoding on the runtime |

Design and memory: ``docs/runtime.md``; tensor parallelism: its last section and
``docs/design/tensor-parallel.md``.
"""

from __future__ import annotations

from blockdraft.target.runtime.decode import check_prompts, decode
from blockdraft.target.runtime.runtime import ForwardOutput, TargetRuntime
from blockdraft.target.runtime.shard import model_shard
from blockdraft.target.runtime.spec import FAMILIES, TargetSpec

__all__ = ["FAMILIES", "ForwardOutput", "TargetRuntime", "TargetSpec", "check_prompts", "decode", "model_shard"]
