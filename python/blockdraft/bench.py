"""``blockdraft bench``: proposer latency, batching, memory, host overhead and end-to-end cost.

Everything runs on random weights built in memory at named shapes (no downloads):

| shape | target | drafter |
| --- | --- | --- |
| ``qwen3-8b`` | 36 layers, H 4096, 32/8 heads x 128, MLP 12288, vocab 151936 | 5 layers, ids [1,9,17,25,33], B 16 |
| ``qwen3-4b`` | 36 layers, H 2560, 32/8 heads x 128, MLP 9728, vocab 151936 | 5 layers, ids [1,9,17,25,33], B 16 |
| ``tiny`` | 4 layers, H 64, 4/2 heads x 16, MLP 128, vocab 512 | 2 layers, ids [1, 2], B 8 |

Sections of one run (each recorded in the JSON even when another fails):

* ``propose``: per context length and batch size, the latency of ``propose`` (n = 1) or
  ``propose_batch`` (median, p90; CUDA events around the call, which ends in a host sync),
  the same ``n`` sequences through ``n`` ``propose`` calls, the plain (no CUDA graph) path,
  the ctx K/V precompute of 1 and B new rows per sequence, and drafter memory per sequence
  (accumulator + paged K/V) measured from the tensors and from the formula.
* ``reference``: the public reference's drafter forward (``dflash`` 0.1.0, same weights and
  inputs, batch 1) with the flash SDPA backend and with torch's default choice.
* ``host``: a cProfile of ``propose`` split into blockdraft Python, the Rust core, kernel
  launches, and waiting for the device; plus the core's bookkeeping alone, timed without the
  profiler.
* ``kernels``: device time per kernel of one plain-path proposal (torch.profiler).
* ``e2e``: batch-1 speculative decoding, blockdraft's engine against ``dflash_generate``, ms
  per step and the drafter's share.

Each step of the propose section commits one new ctx row per sequence (a random pair accepts
nothing, so a step adds ``accepted + 1 = 1`` row), so every timed call includes the K/V
precompute of that row, as in steady state.
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import json
import logging
import math
import os
import platform
import pstats
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Shape:
    """A target + drafter pair shape (Qwen3 layout)."""

    name: str
    target_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    drafter_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int

    @property
    def ctx_row_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden


SHAPES: dict[str, Shape] = {
    "qwen3-8b": Shape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, 5, (1, 9, 17, 25, 33), 16, 151669),
    "qwen3-4b": Shape("qwen3-4b", 36, 2560, 32, 8, 128, 9728, 151936, 5, (1, 9, 17, 25, 33), 16, 151669),
    "tiny": Shape("tiny", 4, 64, 4, 2, 16, 128, 512, 2, (1, 2), 8, 511),
}


@dataclass
class BenchConfig:
    """What one ``blockdraft bench`` run measures.

    Attributes:
        shape: a key of :data:`SHAPES`.
        contexts: context lengths (ctx rows per sequence).
        batches: batch sizes (sequences per proposal).
        reps / warmup: timed and untimed calls per cell.
        loop_reps: repetitions of the per-sequence loop (n ``propose`` calls each).
        e2e_steps: speculative steps per end-to-end run.
        e2e_repeats: end-to-end runs per engine and cell, alternating the engines; the median
            run is reported.
        e2e_backends: the SDPA settings of the end-to-end section on CUDA, in run order
            ("flash", "default").
        device / dtype: where and in what precision (``dtype`` "auto": bf16 on CUDA, fp32 else).
        sections: which sections to run (see the module docstring).
        seed: weights and inputs.
        profile_context / profile_batches: the host profile's cell(s).
    """

    shape: str = "tiny"
    contexts: list[int] = field(default_factory=lambda: [512, 4096, 16384])
    batches: list[int] = field(default_factory=lambda: [1, 4, 16, 32, 64])
    reps: int = 20
    warmup: int = 3
    loop_reps: int = 5
    e2e_steps: int = 24
    e2e_repeats: int = 1
    e2e_backends: list[str] = field(default_factory=lambda: ["flash", "default"])
    device: str = "auto"
    dtype: str = "auto"
    sections: list[str] = field(
        default_factory=lambda: ["propose", "reference", "e2e", "host", "kernels"]
    )
    seed: int = 0
    profile_context: int | None = None
    profile_batches: list[int] = field(default_factory=lambda: [1, 32])


# ---------------------------------------------------------------------------- builders


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _fill_random(module: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Norm weights 1, every other parameter N(0, std), drawn on the parameter's device."""
    gen: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
                continue
            g = gen.get(p.device)
            if g is None:
                g = torch.Generator(device=p.device).manual_seed(seed)
                gen[p.device] = g
            p.normal_(0.0, std, generator=g)
    module.requires_grad_(False)


def build_target(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random-weight Qwen3 causal LM at ``shape``, allocated and filled on ``device``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kwargs: dict[str, Any] = dict(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.target_layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.mlp,
        vocab_size=shape.vocab,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    cfg = Qwen3Config(**kwargs)
    # Built on the device directly: an 8B model initialised on the CPU would take minutes.
    with torch.device(device), _default_dtype(dtype):
        model = Qwen3ForCausalLM(cfg)  # type: ignore[no-untyped-call]
    _fill_random(model, seed)
    return model.eval()  # type: ignore[no-untyped-call]


def drafter_config_dict(shape: Shape) -> dict[str, Any]:
    """The drafter's ``config.json`` object (z-lab format)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.drafter_layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.mlp,
        "vocab_size": shape.vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "num_target_layers": shape.target_layers,
        "block_size": shape.block_size,
        "dflash_config": {
            "target_layer_ids": list(shape.target_layer_ids),
            "mask_token_id": shape.mask_token_id,
        },
    }


def build_drafter(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 1) -> Any:
    """A random-weight DFlash drafter at ``shape`` on ``device``."""
    from blockdraft.config import DrafterConfig
    from blockdraft.models import DFlashDrafter

    cfg = DrafterConfig.from_dict(drafter_config_dict(shape))
    drafter = DFlashDrafter(cfg, device=device, dtype=dtype)
    _fill_random(drafter, seed)
    return drafter.eval()


def build_reference_drafter(drafter: Any, shape: Shape) -> Any:
    """The public reference's ``DFlashDraftModel`` holding ``drafter``'s weights (same device
    and dtype). Raises ImportError without ``dflash``."""
    from dflash.model import DFlashDraftModel  # type: ignore[import-untyped]
    from transformers import Qwen3Config

    raw = drafter_config_dict(shape)
    raw.pop("architectures")
    cfg = Qwen3Config(**raw)
    weight = drafter.fc.weight
    with torch.device(weight.device), _default_dtype(weight.dtype):
        ref = DFlashDraftModel(cfg)
    missing, unexpected = ref.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise RuntimeError(f"reference drafter weights differ: missing {missing}, unexpected {unexpected}")
    return ref.to(device=weight.device, dtype=weight.dtype).eval()


# ---------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """One call, in ms: CUDA events on CUDA (the call is synchronised at its end), else wall."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _stats(samples: Sequence[float]) -> dict[str, float]:
    xs = sorted(samples)
    if not xs:
        return {"median": float("nan"), "p90": float("nan"), "n": 0}
    p90 = xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
    return {"median": statistics.median(xs), "p90": p90, "min": xs[0], "n": len(xs)}


# ---------------------------------------------------------------------------- memory


def state_memory(prop: Any, st: Any) -> dict[str, Any]:
    """A state's drafter memory: measured from its tensors vs the DESIGN §2 formula.

    accumulator = window x ctx_slot_bytes (ctx_slot_bytes = k x H x elem); paged K/V =
    blocks x block_size x (L x 2 x Hkv x D x elem), with blocks <= ceil(ctx rows / block_size).
    """
    elem = torch.empty((), dtype=prop.dtype).element_size()
    acc_measured = int(st.acc.numel() * st.acc.element_size())
    block_bytes = int(prop._k_all[:, 0].numel() * elem + prop._v_all[:, 0].numel() * elem)
    kv_measured = int(st.ctx.num_blocks * block_bytes)
    rows = int(st.ctx_len)
    bs = int(prop.kv_block_size)
    acc_formula = int(st.window) * len(prop.target_layer_ids) * prop.hidden_size * elem
    need_blocks = math.ceil(rows / bs)
    per_row = prop.num_layers * 2 * prop.num_kv_heads * prop.head_dim * elem
    kv_formula = need_blocks * bs * per_row
    return {
        "window": int(st.window),
        "ctx_rows": rows,
        "blocks": int(st.ctx.num_blocks),
        "blocks_bound": need_blocks,
        "acc_bytes": acc_measured,
        "acc_bytes_formula": acc_formula,
        "kv_bytes": kv_measured,
        "kv_bytes_formula": kv_formula,
        "kv_bytes_per_row": per_row,
        "total_bytes": acc_measured + kv_measured,
        "equal_to_formula": acc_measured == acc_formula and kv_measured == kv_formula,
        "blocks_within_bound": int(st.ctx.num_blocks) <= need_blocks,
    }


# ---------------------------------------------------------------------------- propose section


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class _Seqs:
    """Live states at one context length, each advanced one ctx row per step."""

    def __init__(self, prop: Any, shape: Shape, ctx: int, count: int, gen: torch.Generator) -> None:
        self.prop = prop
        self.shape = shape
        self.gen = gen
        device = prop.device
        self.rows = torch.empty((count, shape.ctx_row_width), dtype=prop.dtype, device=device)
        self.states: list[Any] = []
        self.next_pos: list[int] = []
        self.tokens: list[int] = []
        self.alloc_bytes: list[int] = []
        rows = torch.empty((ctx, shape.ctx_row_width), dtype=prop.dtype, device=device)
        for i in range(count):
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            st = prop.alloc_state()
            if device.type == "cuda":
                self.alloc_bytes.append(int(torch.cuda.memory_allocated(device) - before))
            rows.normal_(generator=gen)
            prop.commit_ctx(st, rows, range(ctx))
            tok = (17 * i + 3) % shape.vocab
            # The first proposal computes the K/V of all ctx rows (one sequence at a time, so
            # the batched precompute never concatenates every context at once).
            prop.propose(st, tok, ctx, shape.block_size - 1)
            prop.after_verify(st, 0)
            self.states.append(st)
            self.next_pos.append(ctx)
            self.tokens.append(tok)
        del rows

    def advance(self, idx: Sequence[int], fresh: bool = True) -> None:
        """Commit one new ctx row (the last anchor's hidden state) to each of ``idx``, as a
        serving step does: ``commit_ctx`` for one sequence, ``commit_ctx_batch`` for more.
        Random rows unless ``fresh=False`` (the last rows again: no launch of the bench's own)."""
        rows = self.rows[: len(idx)]
        if fresh:
            rows.normal_(generator=self.gen)
        if len(idx) == 1:
            self.prop.commit_ctx(self.states[idx[0]], rows, [self.next_pos[idx[0]]])
        else:
            self.prop.commit_ctx_batch(
                [self.states[i] for i in idx], rows, [[self.next_pos[i]] for i in idx]
            )
        for i in idx:
            self.next_pos[i] += 1
            self.tokens[i] = (self.tokens[i] * 31 + 7) % self.shape.vocab

    def warm(self, idx: Sequence[int], steps: int) -> None:
        """``steps`` untimed steady-state steps (commit one row, propose, verify)."""
        for _ in range(steps):
            self.advance(idx)
            self.propose_batch(idx)

    def propose_batch(self, idx: Sequence[int], verify: bool = True) -> list[list[int]]:
        """One ``propose`` (n = 1) or ``propose_batch`` call; ``verify`` then records a verify
        of 0 accepted drafts for each sequence."""
        b = self.shape.block_size - 1
        if len(idx) == 1:
            i = idx[0]
            out = [self.prop.propose(self.states[i], self.tokens[i], self.next_pos[i], b)]
        else:
            got = self.prop.propose_batch(
                [self.states[i] for i in idx],
                [self.tokens[i] for i in idx],
                [self.next_pos[i] for i in idx],
                b,
            )
            if got is None:
                raise RuntimeError(f"propose_batch declined {len(idx)} sequences")
            out = got
        if verify:
            self.verify(idx)
        return out

    def verify(self, idx: Sequence[int]) -> None:
        """Record a verify of 0 accepted drafts for each of ``idx`` (a random pair's step):
        ``after_verify`` for one sequence, ``after_verify_batch`` for more."""
        if len(idx) == 1:
            self.prop.after_verify(self.states[idx[0]], 0)
        else:
            self.prop.after_verify_batch([self.states[i] for i in idx], [0] * len(idx))

    def propose_loop(self, idx: Sequence[int]) -> None:
        b = self.shape.block_size - 1
        for i in idx:
            self.prop.propose(self.states[i], self.tokens[i], self.next_pos[i], b)
            self.prop.after_verify(self.states[i], 0)

    def free(self) -> None:
        for st in self.states:
            self.prop.free_state(st)


def _make_proposer(
    drafter: Any, target: Any, shape: Shape, ctx: int, max_batch: int, graphs: str, grow: int
) -> Any:
    from blockdraft import ENV_CTX_CAP, DFlashProposer

    max_seq_len = ctx + grow
    bs = 16
    # Uncapped window: the bench grows every context past its nominal length and must not
    # slide (a slide would recompute the whole context inside a timed call).
    with _env(ENV_CTX_CAP, "0"):
        return DFlashProposer(
            drafter,
            target,
            max_seq_len=max_seq_len,
            num_blocks=max_batch * math.ceil(max_seq_len / bs) + 1,
            kv_block_size=bs,
            max_batch=max_batch,
            graphs=graphs,  # type: ignore[arg-type]
        )


def _release(prop: Any) -> None:
    """Drop a proposer's graphs (they reference it back) and give its memory to the device."""
    prop._graphs = None
    gc.collect()
    if prop.device.type == "cuda":
        torch.cuda.empty_cache()


def _cell_times(
    fn: Callable[[], Any], before: Callable[[], None], reps: int, warmup: int, device: torch.device
) -> dict[str, float]:
    for _ in range(warmup):
        before()
        fn()
    samples = []
    for _ in range(reps):
        before()
        _sync(device)
        samples.append(_time_ms(fn, device))
    return _stats(samples)


def bench_propose(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """The propose section: one record per (context, batch)."""
    out: list[dict[str, Any]] = []
    max_batch = max(cfg.batches)
    graphs = "auto"
    per_cell = 2 * (cfg.warmup + cfg.reps) + cfg.warmup + cfg.loop_reps + 4
    grow = len(cfg.batches) * per_cell + 2 * shape.block_size + 64
    for ctx in cfg.contexts:
        gen = torch.Generator(device=device).manual_seed(cfg.seed + ctx)
        prop = _make_proposer(drafter, target, shape, ctx, max_batch, graphs, grow)
        seqs = _Seqs(prop, shape, ctx, max_batch, gen)
        try:
            for n in cfg.batches:
                idx = list(range(n))
                rec: dict[str, Any] = {"context": ctx, "batch": n}
                runner = prop._graphs
                rec["graph_mode"] = None if runner is None else runner.mode
                rec["latency_ms"] = _cell_times(
                    partial(seqs.propose_batch, idx), partial(seqs.advance, idx), cfg.reps, cfg.warmup, device
                )
                if runner is not None:
                    prop._graphs = None
                    try:
                        rec["latency_plain_ms"] = _cell_times(
                            partial(seqs.propose_batch, idx),
                            partial(seqs.advance, idx),
                            cfg.reps,
                            cfg.warmup,
                            device,
                        )
                    finally:
                        prop._graphs = runner
                    rec["graph_disabled"] = runner.disabled
                loop = _cell_times(
                    partial(seqs.propose_loop, idx), partial(seqs.advance, idx), cfg.loop_reps, 1, device
                )
                rec["loop_ms"] = loop
                rec["speedup_vs_loop"] = loop["median"] / rec["latency_ms"]["median"]
                rec["precompute_ms"] = {
                    "rows_1": _precompute_times(prop, seqs, idx, 1, cfg, device),
                    f"rows_{shape.block_size}": _precompute_times(
                        prop, seqs, idx, shape.block_size, cfg, device
                    ),
                }
                mem = state_memory(prop, seqs.states[0])
                if seqs.alloc_bytes:
                    mem["acc_alloc_delta_bytes"] = seqs.alloc_bytes[0]
                rec["memory_per_seq"] = mem
                rec["pool_check"] = all(
                    state_memory(prop, seqs.states[i])["blocks_within_bound"] for i in idx
                )
                log.info(
                    "propose ctx %d n %d: %.3f ms (p90 %.3f), loop %.3f ms, plain %s",
                    ctx,
                    n,
                    rec["latency_ms"]["median"],
                    rec["latency_ms"]["p90"],
                    loop["median"],
                    rec.get("latency_plain_ms", {}).get("median"),
                )
                out.append(rec)
        finally:
            seqs.free()
            _release(prop)
            del seqs, prop
    return out


QUICK_CELLS: tuple[tuple[int, int], ...] = ((4096, 1), (16384, 1), (4096, 32))
"""(context, batch) cells of :func:`bench_quick`: the issue-6 latency targets."""


def bench_quick(
    shape: Shape,
    drafter: Any,
    target: Any,
    device: torch.device,
    *,
    cells: Sequence[tuple[int, int]] = QUICK_CELLS,
    reps: int = 20,
    warmup: int = 3,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Propose latency (graphs on, then the plain path) for a few cells only, each with its
    own proposer; one record per cell, as in the propose section (no loop or precompute)."""
    out: list[dict[str, Any]] = []
    grow = 2 * (reps + warmup) + 2 * shape.block_size + 64
    for ctx, n in cells:
        gen = torch.Generator(device=device).manual_seed(seed + ctx)
        prop = _make_proposer(drafter, target, shape, ctx, n, "auto", grow)
        seqs = _Seqs(prop, shape, ctx, n, gen)
        idx = list(range(n))
        try:
            runner = prop._graphs
            rec: dict[str, Any] = {"context": ctx, "batch": n}
            rec["graph_mode"] = None if runner is None else runner.mode
            rec["fused_drafter"] = runner is not None and runner.fast is not None
            rec["latency_ms"] = _cell_times(
                partial(seqs.propose_batch, idx), partial(seqs.advance, idx), reps, warmup, device
            )
            if runner is not None:
                rec["graph_disabled"] = runner.disabled
                rec["graph_replays"] = runner.replays
                prop._graphs = None
                try:
                    rec["latency_plain_ms"] = _cell_times(
                        partial(seqs.propose_batch, idx), partial(seqs.advance, idx), reps, warmup,
                        device,
                    )
                finally:
                    prop._graphs = runner
            log.info("quick ctx %d n %d: %.3f ms (plain %s)", ctx, n, rec["latency_ms"]["median"],
                     rec.get("latency_plain_ms", {}).get("median"))
            out.append(rec)
        finally:
            seqs.free()
            _release(prop)
            del seqs, prop
    return out


def quick_markdown(records: Sequence[dict[str, Any]]) -> str:
    """One table of :func:`bench_quick` records against the issue-6 targets."""
    targets = {(4096, 1): 1.2, (16384, 1): 1.4, (4096, 32): 3.0}
    lines = [
        "| ctx | n | median ms | p90 ms | plain path ms | target ms | graph | fused drafter |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        lat, plain = r["latency_ms"], r.get("latency_plain_ms", {})
        graph = r.get("graph_mode") or "off"
        if r.get("graph_disabled"):
            graph = f"disabled: {r['graph_disabled']}"
        lines.append(
            f"| {r['context']} | {r['batch']} | {_f(lat['median'])} | {_f(lat['p90'])} | "
            f"{_f(plain.get('median'))} | {_f(targets.get((r['context'], r['batch'])))} | "
            f"{graph} | {'yes' if r.get('fused_drafter') else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def _precompute_times(
    prop: Any, seqs: _Seqs, idx: Sequence[int], rows: int, cfg: BenchConfig, device: torch.device
) -> dict[str, float]:
    """The proposer's ctx K/V precompute (``_store_ctx_kv``) of the last ``rows`` committed
    rows of each sequence, rewritten in place with the same values."""
    items = []
    for i in idx:
        st = seqs.states[i]
        c = st.ctx_committed
        plan = SimpleNamespace(
            row_start=c - rows,
            row_end=c,
            positions=st.ctx_positions[c - rows : c],
            slots=st.ctx.slot_mapping()[c - rows : c],
        )
        items.append((st, plan))
    return _cell_times(lambda: prop._store_ctx_kv(items), lambda: None, cfg.reps, cfg.warmup, device)


# ---------------------------------------------------------------------------- reference


def _sdpa_context(backend: str) -> Any:
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
                with torch.inference_mode(), _sdpa_context(backend):
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

                    def step() -> None:
                        noise = torch.nn.functional.embedding(ids, embed)
                        # ref and hidden are deleted below, after every call of step
                        h = ref(  # noqa: F821
                            position_ids=pos[:, ctx : ctx + 1 + b],
                            noise_embedding=noise,
                            target_hidden=hidden[:, ctx : ctx + 1],  # noqa: F821
                            past_key_values=cache,
                            use_cache=True,
                        )[:, 1:]
                        _crop_to(cache, ctx)
                        torch.argmax(ref.compute_logits(h, head), dim=-1).tolist()  # noqa: F821

                    rec["forward_ms"] = _cell_times(step, lambda: None, cfg.reps, cfg.warmup, device)
                log.info("reference ctx %d %s: %.3f ms", ctx, backend, rec["forward_ms"]["median"])
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                rec["error"] = f"{type(exc).__name__}: {exc}"
            out.append(rec)
        del hidden
    del ref
    return out


# ---------------------------------------------------------------------------- host profile


def _classify(func: tuple[str, int, str]) -> str:
    filename, _, name = func
    text = f"{filename}:{name}"
    if "ContextState" in text or "PrecomputePlan" in text or "BlockPool" in text or "_core" in text:
        return "rust_core"
    if "split_bands" in name or "batch_decline_reason" in name or "propose_batch_max" in name:
        return "rust_core"
    if "tolist" in name or "synchronize" in name or "'item'" in name:
        return "device_wait"
    if "/blockdraft/kernels/" in filename:
        return "kernel_launchers"
    if "/blockdraft/" in filename:
        return "blockdraft_python"
    if "triton" in filename:
        return "triton_launch"
    if "replay" in name:
        return "graph_replay"
    return "torch_and_other"


def bench_host(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """cProfile of steady-state ``propose``/``propose_batch`` calls, split by where the host time
    goes, plus the core's per-step bookkeeping without the profiler."""
    ctx = cfg.profile_context or (cfg.contexts[1] if len(cfg.contexts) > 1 else cfg.contexts[0])
    batches = sorted({min(n, max(cfg.batches)) for n in cfg.profile_batches})
    calls = max(10, cfg.reps)
    # Every sequence may take part in every cell: the profiled calls, then the glue's own.
    grow = (2 * calls + cfg.warmup + 8) * len(batches) + 64
    # Off CUDA the graph path's bookkeeping runs eagerly ("static"): the same host work.
    graphs = "auto" if device.type == "cuda" else "static"
    prop = _make_proposer(drafter, target, shape, ctx, max(batches), graphs, grow)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 7)
    seqs = _Seqs(prop, shape, ctx, max(batches), gen)
    out: list[dict[str, Any]] = []
    try:
        for n in batches:
            idx = list(range(n))
            seqs.warm(idx, cfg.warmup)
            prof = cProfile.Profile()
            wall = 0.0
            for _ in range(calls):
                seqs.advance(idx)
                _sync(device)
                t0 = time.perf_counter()
                prof.enable()
                seqs.propose_batch(idx)
                prof.disable()
                wall += time.perf_counter() - t0
            stats = pstats.Stats(prof)
            buckets: dict[str, float] = {}
            raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
            top: list[tuple[float, str]] = []
            for func, (_, _, tottime, _, _) in raw.items():
                kind = _classify(func)
                buckets[kind] = buckets.get(kind, 0.0) + tottime
                top.append((tottime, f"{Path(func[0]).name}:{func[2]}"))
            top.sort(reverse=True)
            per_call_us = {k: v / calls * 1e6 for k, v in sorted(buckets.items())}
            own = per_call_us.get("blockdraft_python", 0.0) + per_call_us.get("rust_core", 0.0)
            out.append(
                {
                    "context": ctx,
                    "batch": n,
                    "calls": calls,
                    "wall_us_per_call_profiled": wall / calls * 1e6,
                    "profile_us_per_call": per_call_us,
                    "blockdraft_own_us_per_call": own,
                    "blockdraft_own_us_per_seq": own / n,
                    "top_functions_us_per_call": [
                        {"function": name, "us": t / calls * 1e6} for t, name in top[:15]
                    ],
                }
            )
            out[-1].update(_host_glue(prop, seqs, idx, calls))
        out.append(bench_core_bookkeeping(prop.kv_block_size, shape, calls=2000))
    finally:
        seqs.free()
        _release(prop)
        del seqs, prop
    return out


def _host_glue(prop: Any, seqs: _Seqs, idx: list[int], calls: int) -> dict[str, Any]:
    """blockdraft's own host work per call without the profiler: the same steady-state calls
    with the device work (the graph replay) replaced by a ready answer, so what is timed is the
    Python glue, the Rust core and the few small copies it launches (staging rows, metadata).
    Only on the graph path (the steady state on CUDA); ``{}`` when the proposer has none."""
    runner = prop._graphs
    if runner is None:
        return {}
    n = len(idx)
    ready = torch.zeros((n, prop.gamma - 1), dtype=torch.int64, device=prop.device)
    real = runner._launch
    launched = [0]

    def stub(bucket: Any, m: int, cap: int) -> torch.Tensor:
        launched[0] += 1
        return ready[:m]

    runner._launch = stub
    try:
        seqs.warm(idx, 3)
        times = []
        commits = []
        verifies = []
        for _ in range(calls):
            _sync(prop.device)
            t0 = time.perf_counter()
            seqs.advance(idx, fresh=False)
            commits.append(time.perf_counter() - t0)
            _sync(prop.device)
            t0 = time.perf_counter()
            seqs.propose_batch(idx, verify=False)
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            seqs.verify(idx)
            verifies.append(time.perf_counter() - t0)
    finally:
        runner._launch = real
    if launched[0] < calls + 3:
        raise RuntimeError(
            f"host glue: {calls + 3 - launched[0]} calls left the graph path (a table wider "
            "than the graphs?); the measurement would time the plain path"
        )
    per_call = statistics.median(times) * 1e6
    # The step's commit of one new ctx row per sequence (`commit_ctx` at n = 1,
    # `commit_ctx_batch` above, their copy launches included) and its verify record
    # (`after_verify` / `after_verify_batch`).
    commit = statistics.median(commits) * 1e6 / n
    verify = statistics.median(verifies) * 1e6 / n
    return {"glue_us_per_call": per_call, "glue_us_per_seq": per_call / n,
            "commit_us_per_seq": commit, "verify_us_per_seq": verify,
            "step_us_per_seq": per_call / n + commit + verify}


def bench_core_bookkeeping(block_size: int, shape: Shape, calls: int) -> dict[str, Any]:
    """The Rust core's calls of one steady-state step (append 1 row, plan/confirm the K/V,
    note the proposal, record the verify) on a fresh state with blocks of ``block_size`` rows,
    without touching any tensor."""
    from blockdraft._core import BlockPool, ContextState

    pool = BlockPool(calls // block_size + 2, block_size)
    st = ContextState(pool, 1 << 20, 0)
    pos = 0
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            plan = st.plan_append([pos])
            st.apply_append(plan)
            pre = st.plan_precompute()
            st.confirm_precompute(pre)
            st.note_propose(pos + 1, shape.block_size - 1)
            st.after_verify(0)
            pos += 1
        per = (time.perf_counter() - t0) / calls * 1e6
    finally:
        st.free()
    return {"kind": "core_bookkeeping", "us_per_seq_step": per, "calls": calls}


# ---------------------------------------------------------------------------- kernel profile


def bench_kernels(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """Device time per kernel (torch.profiler), graph and plain paths: batch-1 proposals at
    every context, and ``propose_batch`` at the host profile's batch sizes and context.

    Also per cell: the wall time of one call (the same calls, unprofiled) against the device
    time, so the gap (host work the device waited for) is visible."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return []
    out: list[dict[str, Any]] = []
    calls = 5
    wide = cfg.profile_context or (cfg.contexts[1] if len(cfg.contexts) > 1 else cfg.contexts[0])
    cells = [(ctx, 1) for ctx in cfg.contexts]
    cells += [(wide, n) for n in sorted({min(n, max(cfg.batches)) for n in cfg.profile_batches})
              if n > 1]
    for ctx, n in cells:
        prop = _make_proposer(drafter, target, shape, ctx, n, "auto", 4 * (calls + 8) + 64)
        gen = torch.Generator(device=device).manual_seed(cfg.seed + 3)
        seqs = _Seqs(prop, shape, ctx, n, gen)
        idx = list(range(n))
        try:
            runner = prop._graphs
            for label in ("graph", "plain"):
                if label == "plain":
                    prop._graphs = None
                seqs.warm(idx, 2)
                wall = []
                for _ in range(calls):
                    seqs.advance(idx)
                    wall.append(_time_ms(partial(seqs.propose_batch, idx), device))
                with profile(activities=[ProfilerActivity.CUDA]) as p:
                    for _ in range(calls):
                        seqs.advance(idx)
                        seqs.propose_batch(idx)
                    _sync(device)
                rows = []
                total = 0.0
                for evt in p.key_averages():
                    dev_us = float(getattr(evt, "device_time_total", 0.0) or 0.0)
                    if dev_us <= 0:
                        continue
                    total += dev_us
                    rows.append({"kernel": evt.key[:90], "us_per_call": dev_us / calls,
                                 "launches_per_call": evt.count / calls})
                rows.sort(key=lambda r: -float(r["us_per_call"]))
                out.append({"context": ctx, "batch": n, "path": label,
                            "device_us_per_call": total / calls,
                            "wall_us_per_call": statistics.median(wall) * 1e3,
                            "kernels": rows[:25]})
            prop._graphs = runner
        finally:
            seqs.free()
            _release(prop)
            del seqs, prop
    return out


# ---------------------------------------------------------------------------- end to end


def bench_e2e(
    cfg: BenchConfig, shape: Shape, drafter: Any, target: Any, device: torch.device
) -> list[dict[str, Any]]:
    """Batch-1 speculative decoding: blockdraft's engine vs the reference ``dflash_generate``."""
    from blockdraft.engine import SpeculativeEngine

    out: list[dict[str, Any]] = []
    steps = cfg.e2e_steps
    gen = torch.Generator().manual_seed(cfg.seed + 11)
    try:
        from dflash.model import dflash_generate

        ref = build_reference_drafter(drafter, shape)
    except Exception as exc:  # noqa: BLE001
        ref = None
        ref_error = f"{type(exc).__name__}: {exc}"
    backends = list(cfg.e2e_backends) if device.type == "cuda" else ["default"]
    for ctx in cfg.contexts:
        prompt = torch.randint(0, shape.vocab, (ctx,), generator=gen).tolist()
        for backend in backends:
            rec: dict[str, Any] = {"context": ctx, "backend": backend, "steps": steps,
                                   "repeats": cfg.e2e_repeats}
            # The engine picks its attention backends itself (no cuDNN, see SpeculativeEngine's
            # sdpa_backends); under the "default" setting it is also timed on torch's own
            # choice, the one the reference runs with there.
            runners: dict[str, Callable[[], dict[str, Any]]] = {
                "blockdraft": lambda: _e2e_blockdraft(
                    SpeculativeEngine, drafter, target, prompt, steps, device),
            }
            if backend == "default" and device.type == "cuda":
                runners["blockdraft_torch_choice"] = lambda: _e2e_blockdraft(
                    SpeculativeEngine, drafter, target, prompt, steps, device, sdpa_backends=None)
            if ref is None:
                rec["reference_error"] = ref_error
            else:
                runners["reference"] = lambda: _e2e_reference(
                    dflash_generate, ref, target, prompt, steps, device)
            # Repeats alternate the engines, so drift of the machine hits all of them alike;
            # each figure is the run with the median ms per step.
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in runners}
            for _ in range(cfg.e2e_repeats):
                for key, fn in runners.items():
                    if f"{key}_error" in rec:
                        continue
                    try:
                        with _sdpa_context(backend):
                            runs[key].append(fn())
                    except Exception as exc:  # noqa: BLE001
                        rec[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
            for key, got in runs.items():
                if got:
                    got.sort(key=lambda x: float(x["ms_per_step"]))
                    rec[key] = dict(got[len(got) // 2])
                    rec[key]["runs_ms_per_step"] = [x["ms_per_step"] for x in got]
            b = rec.get("blockdraft", {}).get("ms_per_step")
            r = rec.get("reference", {}).get("ms_per_step")
            if b and r:
                rec["speedup"] = r / b
            log.info("e2e ctx %d %s: blockdraft %s ms/step, reference %s ms/step", ctx, backend, b, r)
            out.append(rec)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def _timed(fn: Callable[..., Any], ms: list[float], device: torch.device) -> Callable[..., Any]:
    """``fn`` wrapped to append the wall time of each call (synchronised before and after) to
    ``ms``: a drafter's share of an end-to-end step."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        _sync(device)
        t0 = time.perf_counter()
        r = fn(*args, **kwargs)
        _sync(device)
        ms.append((time.perf_counter() - t0) * 1e3)
        return r

    return timed


def _e2e_record(
    decode_ms: float, n_steps: int, tau: float | None, drafter_ms: list[float]
) -> dict[str, Any]:
    """One engine's end-to-end cell: ms per speculative step and the drafter's share of it."""
    ms = decode_ms / max(1, n_steps)
    drafter = statistics.median(drafter_ms) if drafter_ms else None
    return {
        "ms_per_step": ms,
        "steps": n_steps,
        "tau": tau,
        "drafter_ms_per_step": drafter,
        "drafter_share": drafter / ms if drafter is not None else None,
    }


def _e2e_blockdraft(
    engine_cls: Any, drafter: Any, target: Any, prompt: list[int], steps: int,
    device: torch.device, **engine_kwargs: Any,
) -> dict[str, Any]:
    from blockdraft import ENV_CTX_CAP

    max_seq_len = len(prompt) + steps + 64
    # Uncapped, like the reference: with the default 16K cap a 16K prompt fills the window and
    # every later step slides it (recomputing all of its K/V).
    with _env(ENV_CTX_CAP, "0"):
        engine = engine_cls(
            target, drafter, max_seq_len=max_seq_len, max_batch=1,
            num_blocks=math.ceil((max_seq_len + 64) / 16) + 1, kv_block_size=16, **engine_kwargs,
        )
    prop = engine.proposer
    drafter_ms: list[float] = []
    prop.propose = _timed(prop.propose, drafter_ms, device)
    # One short run first: Triton compiles and graph capture stay out of the timed run.
    engine.generate([prompt[:64]], max_new_tokens=4)
    drafter_ms.clear()
    _sync(device)
    res = engine.generate([prompt], max_new_tokens=steps + 1)
    _sync(device)
    _release(prop)
    st = res.stats
    n_steps = len(st.acceptance_lengths[0])
    decode_s = st.elapsed_s - st.ttft_s[0]
    return _e2e_record(decode_s * 1e3, n_steps, st.mean_tau, drafter_ms)


def _e2e_reference(
    generate: Any, ref: Any, target: Any, prompt: list[int], steps: int, device: torch.device
) -> dict[str, Any]:
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    drafter_ms: list[float] = []
    timed = _timed(ref.forward, drafter_ms, device)

    generate(ref, target, ids[:, :64], 4, None)  # warm-up
    if device.type != "cuda":
        # return_stats synchronises CUDA; on the CPU time a prefill-only call and subtract it.
        t0 = time.perf_counter()
        generate(ref, target, ids, 1, None)
        prefill_s = time.perf_counter() - t0
    ref.forward = timed
    try:
        if device.type == "cuda":
            res = generate(ref, target, ids, steps + 1, None, return_stats=True)
            decode_ms = res.time_per_output_token * res.num_output_tokens * 1e3
            lengths = list(res.acceptance_lengths)
        else:
            t0 = time.perf_counter()
            res = generate(ref, target, ids, steps + 1, None)
            decode_ms = (time.perf_counter() - t0 - prefill_s) * 1e3
            lengths = [1] * (int(res.shape[1]) - ids.shape[1] - 1)
    finally:
        del ref.forward
    n_steps = len(lengths)
    return _e2e_record(decode_ms, n_steps, statistics.mean(lengths) if lengths else None,
                       drafter_ms)


# ---------------------------------------------------------------------------- driver


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and the device, for the report."""
    import transformers

    from blockdraft import _core

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "blockdraft_core": _core.__version__,
        "device": str(device),
        "host": platform.machine(),
    }
    try:
        import triton  # type: ignore[import-untyped]

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import dflash  # type: ignore[import-untyped]

        env["dflash"] = getattr(dflash, "__version__", "installed")
    except ImportError:
        env["dflash"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


SECTIONS: dict[str, Callable[[BenchConfig, Shape, Any, Any, torch.device], list[dict[str, Any]]]] = {
    "propose": bench_propose,
    "reference": bench_reference,
    "host": bench_host,
    "kernels": bench_kernels,
    "e2e": bench_e2e,
}


def _resolve(cfg: BenchConfig) -> tuple[Shape, torch.device, torch.dtype]:
    if cfg.shape not in SHAPES:
        raise ValueError(f"unknown shape {cfg.shape!r}; choose one of {sorted(SHAPES)}")
    unknown = set(cfg.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    if not cfg.contexts or not cfg.batches or min(cfg.contexts) < 1 or min(cfg.batches) < 1:
        raise ValueError("contexts and batches must be non-empty lists of positive ints")
    if (cfg.reps < 1 or cfg.warmup < 0 or cfg.loop_reps < 1 or cfg.e2e_steps < 1
            or cfg.e2e_repeats < 1):
        raise ValueError("reps, loop_reps, e2e_steps and e2e_repeats must be >= 1 and warmup >= 0")
    bad = [b for b in cfg.e2e_backends if b not in ("flash", "default")]
    if bad or not cfg.e2e_backends:
        raise ValueError(f"e2e backends must be 'flash' and/or 'default', not {cfg.e2e_backends}")
    dev_name = cfg.device
    if dev_name == "auto":
        dev_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif cfg.dtype in dtypes:
        dtype = dtypes[cfg.dtype]
    else:
        raise ValueError(f"unknown dtype {cfg.dtype!r}; choose auto, bf16, fp16 or fp32")
    return SHAPES[cfg.shape], device, dtype


def run(
    cfg: BenchConfig,
    *,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the configured sections; returns the JSON-able result (see ``docs/BENCHMARKS.md``).

    ``checkpoint`` is called with the partial result after every section (so a long run that
    is cut short still leaves its finished sections on disk).
    """
    shape, device, dtype = _resolve(cfg)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "config": asdict(cfg),
        "shape": asdict(shape),
        "dtype": str(dtype).replace("torch.", ""),
        "environment": environment(device),
        "sections": {},
        "errors": {},
    }
    torch.manual_seed(cfg.seed)
    tb = time.perf_counter()
    target = build_target(shape, device, dtype, cfg.seed)
    drafter = build_drafter(shape, device, dtype, cfg.seed + 1)
    _sync(device)
    result["build_s"] = time.perf_counter() - tb
    with torch.inference_mode():
        for name in cfg.sections:
            ts = time.perf_counter()
            try:
                result["sections"][name] = SECTIONS[name](cfg, shape, drafter, target, device)
            except Exception as exc:  # noqa: BLE001 - one section's failure is recorded
                log.error("bench section %s failed: %s", name, exc)
                result["errors"][name] = traceback.format_exc(limit=8)
            result.setdefault("section_s", {})[name] = time.perf_counter() - ts
            if checkpoint is not None:
                checkpoint(result)
    result["total_s"] = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------------------- reports


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if math.isnan(x):
            return "—"
        return f"{x:.{digits}f}"
    return str(x)


def to_markdown(result: dict[str, Any]) -> str:
    """The result as markdown tables."""
    env = result["environment"]
    lines = [
        f"# blockdraft bench: shape `{result['shape']['name']}`, {result['dtype']}",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()),
        "",
    ]
    sec = result["sections"]
    if "propose" in sec:
        b = result["shape"]["block_size"]
        lines += [
            "## Propose latency (ms; CUDA events around the call, which ends in a host sync)",
            "",
            f"| ctx | n | median | p90 | plain path median | loop of n `propose` | batched speed-up | precompute 1 row/seq | precompute {b} rows/seq | MB/seq (acc + K/V) | = formula |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in sec["propose"]:
            mem = r["memory_per_seq"]
            pre = r["precompute_ms"]
            lines.append(
                f"| {r['context']} | {r['batch']} | {_f(r['latency_ms']['median'])} | "
                f"{_f(r['latency_ms']['p90'])} | {_f(r.get('latency_plain_ms', {}).get('median'))} | "
                f"{_f(r['loop_ms']['median'])} | {_f(r['speedup_vs_loop'], 2)}x | "
                f"{_f(pre['rows_1']['median'])} | {_f(pre[f'rows_{b}']['median'])} | "
                f"{mem['total_bytes'] / 2**20:.1f} | {'yes' if mem['equal_to_formula'] and r['pool_check'] else 'NO'} |"
            )
        lines.append("")
        mem0 = sec["propose"][0]["memory_per_seq"] if sec["propose"] else None
        if mem0 is not None:
            lines += [
                "Memory per sequence (first cell): "
                + ", ".join(f"{k} {v}" for k, v in mem0.items()),
                "",
            ]
    if "reference" in sec:
        ours = {
            r["context"]: r["latency_ms"]["median"]
            for r in sec.get("propose", [])
            if r["batch"] == 1
        }
        lines += [
            "## Reference drafter forward, batch 1 (ms; dflash 0.1.0, same weights and inputs)",
            "",
            "| ctx | SDPA backend | median | p90 | blockdraft propose n=1 | blockdraft speed-up |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in sec["reference"]:
            fm = r.get("forward_ms", {})
            mine = ours.get(r["context"])
            sp = fm["median"] / mine if mine and fm.get("median") else None
            err = f" ({r['error']})" if "error" in r else ""
            lines.append(
                f"| {r['context']} | {r['backend']}{err} | {_f(fm.get('median'))} | "
                f"{_f(fm.get('p90'))} | {_f(mine)} | {_f(sp, 2)}{'x' if sp else ''} |"
            )
        lines.append("")
    if "host" in sec:
        lines += ["## Host CPU time per call (µs, cProfile; profiler overhead included)", ""]
        for r in sec["host"]:
            if r.get("kind") == "core_bookkeeping":
                lines += [
                    f"Rust core bookkeeping alone (no profiler): {_f(r['us_per_seq_step'], 2)} µs "
                    "per sequence per step (append, plan + confirm precompute, note, verify).",
                    "",
                ]
                continue
            parts = ", ".join(f"{k} {_f(v, 1)}" for k, v in r["profile_us_per_call"].items())
            lines += [
                f"- ctx {r['context']}, n {r['batch']}: wall {_f(r['wall_us_per_call_profiled'], 1)} µs "
                f"per call under the profiler; {parts}; blockdraft's own (Python + Rust) "
                f"{_f(r['blockdraft_own_us_per_call'], 1)} µs = "
                f"{_f(r['blockdraft_own_us_per_seq'], 2)} µs per sequence",
            ]
            if "glue_us_per_seq" in r:
                lines.append(
                    f"  - unprofiled, device work stubbed out: {_f(r['glue_us_per_call'], 1)} µs "
                    f"per call = **{_f(r['glue_us_per_seq'], 2)} µs per sequence** of blockdraft "
                    "host work (Python glue + Rust core + its small copies)"
                )
            if "commit_us_per_seq" in r:
                lines.append(
                    f"  - the step's `commit_ctx` of one row: {_f(r['commit_us_per_seq'], 2)} µs "
                    f"per sequence; its verify record: {_f(r.get('verify_us_per_seq'), 2)} µs; "
                    f"**a whole step (commit + propose + verify): "
                    f"{_f(r['step_us_per_seq'], 2)} µs per sequence**"
                )
        lines.append("")
    if "kernels" in sec and sec["kernels"]:
        lines += ["## Device time per kernel (µs per call, torch.profiler)", ""]
        for r in sec["kernels"]:
            lines.append(
                f"- ctx {r['context']}, n {r.get('batch', 1)}, {r['path']} path: "
                f"{_f(r['device_us_per_call'], 1)} µs device, "
                f"{_f(r.get('wall_us_per_call'), 1)} µs wall per call; "
                + "; ".join(f"{k['kernel'][:60]} {_f(k['us_per_call'], 1)}" for k in r["kernels"][:8])
            )
        lines.append("")
    if "e2e" in sec:
        lines += [
            "## End to end, batch 1 (ms per speculative step; random pair, tau ~ 1)",
            "",
            "SDPA backend: the process setting both run under; blockdraft's engine picks its own "
            "(every backend but cuDNN, its `sdpa_backends` default). The last column is the "
            "engine told to take torch's choice instead (`sdpa_backends=None`).",
            "",
            "| ctx | SDPA backend | blockdraft | its drafter share | reference dflash_generate | its drafter share | speed-up | blockdraft on torch's choice |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in sec["e2e"]:
            bd = r.get("blockdraft", {})
            rf = r.get("reference", {})
            tc = r.get("blockdraft_torch_choice", {})
            lines.append(
                f"| {r['context']} | {r['backend']} | {_f(bd.get('ms_per_step'), 2)} | "
                f"{_f(bd.get('drafter_share'), 2)} | {_f(rf.get('ms_per_step'), 2)} | "
                f"{_f(rf.get('drafter_share'), 2)} | {_f(r.get('speedup'), 2)} | "
                f"{_f(tc.get('ms_per_step'), 2)} |"
            )
        lines.append("")
    if result.get("errors"):
        lines += ["## Errors", ""]
        for name, tb in result["errors"].items():
            lines += [f"### {name}", "", "```", tb.strip(), "```", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG charts (latency vs context per batch; batched speed-up vs batch per context).
    Returns the files written; none without matplotlib or without a propose section."""
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        log.warning("matplotlib is not installed: no plots")
        return []
    recs = result["sections"].get("propose")
    if not recs:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    name = result["shape"]["name"]

    def chart(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
              title: str, file: str, log2_x: bool) -> Path:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, pts in series.items():
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        if log2_x:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name}: {title}")
        ax.legend()
        path = out_dir / file
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    batches = sorted({r["batch"] for r in recs})
    contexts = sorted({r["context"] for r in recs})
    written = [
        chart(
            {f"n={n}": [(r["context"], r["latency_ms"]["median"]) for r in recs if r["batch"] == n]
             for n in batches},
            "context rows", "propose latency, median (ms)", "latency vs context",
            "latency_vs_context.png", log2_x=True,
        ),
        chart(
            {f"ctx={c}": [(r["batch"], r["speedup_vs_loop"]) for r in recs if r["context"] == c]
             for c in contexts},
            "batch size n", "speed-up of propose_batch over n x propose", "batching speed-up",
            "speedup_vs_batch.png", log2_x=False,
        ),
    ]
    return written


def write_outputs(result: dict[str, Any], out_dir: Path, *, plots: bool = False) -> list[Path]:
    """``bench.json`` and ``bench.md`` (and PNGs with ``plots``) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "bench.json"
    js.write_text(json.dumps(result, indent=1, default=str))
    md = out_dir / "bench.md"
    md.write_text(to_markdown(result))
    files = [js, md]
    if plots:
        files += plot(result, out_dir)
    return files


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(parser: Any) -> None:
    """The ``bench`` subcommand's options (shared by the CLI and ``python -m``)."""
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--contexts", default=None, help="comma-separated (default 512,4096,16384; tiny: 32,128)")
    parser.add_argument("--batches", default=None, help="comma-separated (default 1,4,16,32,64; tiny: 1,4)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--loop-reps", type=int, default=5)
    parser.add_argument("--e2e-steps", type=int, default=24)
    parser.add_argument("--e2e-repeats", type=int, default=1,
                        help="end-to-end runs per engine (alternating); the median is reported")
    parser.add_argument("--e2e-backends", default="flash,default",
                        help="SDPA settings of the end-to-end section on CUDA, in run order")
    parser.add_argument("--sections", default="propose,reference,e2e,host,kernels")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out", help="directory for bench.json / bench.md")
    parser.add_argument("--plot", action="store_true", help="also write PNG charts (matplotlib)")


def config_from_args(args: Any) -> BenchConfig:
    tiny = args.shape == "tiny"
    return BenchConfig(
        shape=args.shape,
        contexts=_ints(args.contexts) if args.contexts else ([32, 128] if tiny else [512, 4096, 16384]),
        batches=_ints(args.batches) if args.batches else ([1, 4] if tiny else [1, 4, 16, 32, 64]),
        reps=args.reps,
        warmup=args.warmup,
        loop_reps=args.loop_reps,
        e2e_steps=args.e2e_steps,
        e2e_repeats=args.e2e_repeats,
        e2e_backends=[b.strip() for b in args.e2e_backends.split(",") if b.strip()],
        device=args.device,
        dtype=args.dtype,
        sections=[s for s in args.sections.split(",") if s.strip()],
        seed=args.seed,
    )


def main_from_args(args: Any) -> int:
    """Run, write the outputs, and return 0 when every section ran."""
    cfg = config_from_args(args)
    out = Path(args.out)

    def checkpoint(partial: dict[str, Any]) -> None:
        write_outputs(partial, out)

    result = run(cfg, checkpoint=checkpoint)
    files = write_outputs(result, out, plots=args.plot)
    print(to_markdown(result))
    print("wrote " + ", ".join(str(f) for f in files))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    import argparse
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(prog="python -m blockdraft.bench")
    add_arguments(p)
    sys.exit(main_from_args(p.parse_args()))
