"""The ``target`` section: one target forward at each context, Hugging Face eager against
blockdraft's runtime (eager, and replayed from its CUDA graphs on CUDA), side by side in one
run.

Per context length C (a random prompt of C tokens, prefilled once per engine):

* ``decode``: the forward of one new token (logits of that row), the step of target-only
  decoding;
* ``verify``: the forward of a block of B new tokens (logits of every row, the drafter's rows
  captured), the target's part of a speculative step.

The Hugging Face side runs the model's forward with a ``DynamicCache`` (cropped back to C
after each call); the runtime side runs :meth:`TargetRuntime.forward` (its rows are left
pending, so the next call overwrites them), once with its graphs off and once with them
(``graphs="auto"``: captured on CUDA; off elsewhere, when the two columns measure the same
path). Both keep C fixed across the repetitions.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from blockdraft.bench.config import BenchConfig
from blockdraft.bench.figures import fmt
from blockdraft.bench.timing import cell_times
from blockdraft.devices import sync
from blockdraft.pair import Shape

log = logging.getLogger(__name__)


def bench_target(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """One record per context: ms per decode and per B-row verify on each engine."""
    from transformers import DynamicCache

    from blockdraft.core import SeqPages
    from blockdraft.target.runtime import TargetRuntime

    gen = torch.Generator().manual_seed(cfg.seed + 7)
    block = shape.block_size
    longest = max(cfg.contexts) + block
    runtimes = {
        mode: TargetRuntime(target, max_seq_len=min(longest, target.config.max_position_embeddings),
                            num_pages=-(-longest // 16), page_size=16, max_batch=1,
                            capture_layers=list(shape.target_layer_ids), graphs=mode,
                            graph_rows=(1, block))
        for mode in ("off", "auto")
    }
    out = []
    for ctx in cfg.contexts:
        prompt = torch.randint(0, shape.vocab - 1, (ctx,), generator=gen).tolist()
        new = torch.randint(0, shape.vocab - 1, (block,), generator=gen).tolist()
        rec: dict[str, Any] = {"context": ctx, "block": block}

        cache = DynamicCache(config=target.config)
        target(input_ids=torch.tensor([prompt], device=device), past_key_values=cache,
               use_cache=True, logits_to_keep=1)

        def hf(rows: int, new: list[int] = new, cache: DynamicCache = cache, ctx: int = ctx) -> None:
            target(input_ids=torch.tensor([new[:rows]], device=device), past_key_values=cache,
                   use_cache=True, logits_to_keep=0 if rows > 1 else 1)
            cache.crop(ctx)

        rec["hf_decode_ms"] = cell_times(lambda: hf(1), lambda: None, cfg.reps, cfg.warmup, device)
        rec["hf_verify_ms"] = cell_times(lambda: hf(block), lambda: None, cfg.reps, cfg.warmup, device)
        cache.crop(0)  # its K/V freed before the runtime side runs

        for mode, runtime in runtimes.items():
            seq = runtime.new_sequence(ctx + block)
            runtime.prefill([seq], [prompt])

            def rt(rows: int, runtime: TargetRuntime = runtime, seq: SeqPages = seq, new: list[int] = new) -> None:
                runtime.forward([seq], [new[:rows]], logits="all" if rows > 1 else "last",
                                capture=rows > 1)

            name = "runtime" if mode == "off" else "graphed"
            rec[f"{name}_decode_ms"] = cell_times(lambda: rt(1), lambda: None, cfg.reps,
                                                  cfg.warmup, device)
            rec[f"{name}_verify_ms"] = cell_times(lambda: rt(block), lambda: None, cfg.reps,
                                                  cfg.warmup, device)
            runtime.free([seq])
        sync(device)
        log.info(
            "target at %d: decode HF %s / runtime %s / graphed %s ms, %d-row verify HF %s / "
            "runtime %s / graphed %s ms", ctx, fmt(rec["hf_decode_ms"]["median"]),
            fmt(rec["runtime_decode_ms"]["median"]), fmt(rec["graphed_decode_ms"]["median"]),
            block, fmt(rec["hf_verify_ms"]["median"]), fmt(rec["runtime_verify_ms"]["median"]),
            fmt(rec["graphed_verify_ms"]["median"]),
        )
        out.append(rec)
    return out


def target_markdown(recs: list[dict[str, Any]]) -> list[str]:
    """The section's table (medians)."""
    lines = [
        "## Target forward: Hugging Face eager vs blockdraft's runtime",
        "",
        "| context | HF decode ms | runtime decode ms | graphed decode ms | HF verify ms | "
        "runtime verify ms | graphed verify ms | block |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in recs:
        lines.append(
            f"| {r['context']} | {fmt(r['hf_decode_ms']['median'])} | "
            f"{fmt(r['runtime_decode_ms']['median'])} | {fmt(r['graphed_decode_ms']['median'])} | "
            f"{fmt(r['hf_verify_ms']['median'])} | {fmt(r['runtime_verify_ms']['median'])} | "
            f"{fmt(r['graphed_verify_ms']['median'])} | {r['block']} |"
        )
    return [*lines, ""]


__all__ = ["bench_target", "target_markdown"]
