"""The reference section: the public reference's drafter forward (``dflash`` 0.1.0) at batch 1,
same weights and inputs, under each SDPA backend setting."""

from __future__ import annotations

import contextlib
import logging
from functools import partial
from typing import Any

import torch

from blockdraft.bench.config import BenchConfig
from blockdraft.bench.figures import fmt
from blockdraft.bench.timing import cell_times
from blockdraft.pair import Shape, default_dtype

log = logging.getLogger(__name__)


def build_reference_drafter(drafter: Any, shape: Shape) -> Any:
    """The public reference's ``DFlashDraftModel`` (``DFlash2DraftModel`` for a DFlash2 shape)
    holding ``drafter``'s weights (same device and dtype). Raises ImportError without
    ``dflash``."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel  # type: ignore[import-untyped]
    from transformers import Qwen3Config

    raw = shape.drafter.config_dict()
    raw.pop("architectures")
    cfg = Qwen3Config(**raw)
    weight = drafter.fc.weight
    with torch.device(weight.device), default_dtype(weight.dtype):
        ref = (DFlash2DraftModel if shape.dflash2 else DFlashDraftModel)(cfg)
    wanted = ref.state_dict()
    # DFlash2's codebooks are plain parameters here and embeddings (``.weight``) there
    state = {k + ".weight" if k not in wanted and k + ".weight" in wanted else k: v
             for k, v in drafter.state_dict().items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise RuntimeError(f"reference drafter weights differ: missing {missing}, unexpected {unexpected}")
    return ref.to(device=weight.device, dtype=weight.dtype).eval()


def sdpa_context(backend: str) -> Any:
    """``"flash"``: flash attention, with memory-efficient attention only for calls that pass
    a mask (flash takes none; the HF target's cached forwards pass one, and flash alone then
    fails with "No available kernel"); cuDNN is off. ``"default"``: torch's own choice."""
    if backend == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    return contextlib.nullcontext()


def bench_reference(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """The reference drafter forward at batch 1: one new ctx row + a block of B over a cache
    holding ``ctx`` rows, then ``lm_head`` and argmax (what its generate loop does per step)."""
    from dflash.model import _crop_to, _make_cache

    ref = build_reference_drafter(drafter, shape)
    embed = target.get_input_embeddings().weight
    head = target.lm_head
    backends = ["flash", "default"] if device.type == "cuda" else ["default"]
    out: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 99)
    b = shape.block_size
    for ctx in cfg.contexts:
        hidden = torch.empty((1, ctx + 1, shape.ctx_row_width), dtype=ref.fc.weight.dtype, device=device)
        hidden.normal_(generator=gen)
        ids = torch.full((1, b), shape.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = 5
        for backend in backends:
            rec: dict[str, Any] = {"context": ctx, "backend": backend}
            try:
                with torch.inference_mode(), sdpa_context(backend):
                    cache = _make_cache(ref.config)
                    pos = torch.arange(ctx + 1 + b, device=device)[None]
                    ref(
                        position_ids=pos[:, : ctx + b],
                        noise_embedding=torch.nn.functional.embedding(ids, embed),
                        target_hidden=hidden[:, :ctx],
                        past_key_values=cache,
                        use_cache=True,
                    )
                    _crop_to(cache, ctx)

                    # The loop's tensors are passed in, not closed over, and the partial that
                    # holds them is dropped once timed, so each cache is freed when replaced.
                    def step(
                        ctx: int, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, cache: Any
                    ) -> None:
                        noise = torch.nn.functional.embedding(ids, embed)
                        # ref is deleted below, after every call of step
                        h = ref(  # noqa: F821
                            position_ids=pos[:, ctx : ctx + 1 + b],
                            noise_embedding=noise,
                            target_hidden=hidden[:, ctx : ctx + 1],
                            past_key_values=cache,
                            use_cache=True,
                        )[:, 1:]
                        _crop_to(cache, ctx)
                        torch.argmax(ref.compute_logits(h, head), dim=-1).tolist()  # noqa: F821

                    rec["forward_ms"] = cell_times(
                        partial(step, ctx, ids, hidden, pos, cache), lambda: None, cfg.reps, cfg.warmup, device
                    )
                log.info(
                    "reference ctx %d %s: %s ms", ctx, backend, fmt(rec["forward_ms"]["median"])
                )
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                rec["error"] = f"{type(exc).__name__}: {exc}"
            out.append(rec)
        del hidden
    del ref
    return out
