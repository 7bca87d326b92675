"""CUDA-graph replay of the proposer's steady-state draft forward.

In the steady state one proposal is a fixed sequence of kernels whose shapes depend only on the
number of sequences ``n``: the ctx K/V precompute of the rows committed since the last call
(``fc`` + ``hidden_norm`` + one K/V GEMM for every layer + the paged store, over the staging
capacity: 1, 4 or B rows per sequence of the bucket, the smallest that holds the call's staged
rows), the drafter's inputs from the metadata (one ``graph_inputs`` kernel), the drafter layers
with paged block attention, the target ``lm_head`` on rows 1..B-1 and argmax (DFlash2: top-K
candidates and the selector walk, one launch for all sequences). This module
captures that sequence once per (batch-size bucket, staging capacity) and replays it; per call
only the metadata and the staged ctx rows change, written in place into static buffers per
bucket::

    meta [bucket, 3 + W + 3B] int64 on the device:
        column 0: ctx rows with K/V (the plan's row_end), 1: anchor token, 2: anchor position,
        columns 3..3+W: the page table (W = ceil(ceiling / page_size) entries, zero padded),
        then B positions, B slots and B source addresses of the staged ctx rows (staged row j
        is meta row j // B, entry j % B; unused entries have slot PAD_SLOT = -1, which the
        store skips; the layout is the Rust core's, ``blockdraft_core::step``)
    stage [bucket * B, k*H]: the accumulator rows of the outstanding plans, packed in order.
        On Triton the graph fills it itself (``stage_gather``, by the source addresses: the
        host copies no rows); elsewhere one copy launch per call fills it
        (``torch.cat(..., out=stage)``; a sequence's rows are the view of its accumulator
        kept by its last ``commit_ctx`` when that covers them)

A sequence commits ``accepted + 1`` (1..B) rows per step, so its plan always fits its B staged
rows; a longer plan (a prefill, a first call, the recompute after a window slide) has its K/V
stored before the replay by ``DraftForward.store_long_plans``: the same fused steps, in
launches of a few fixed sizes, so no length compiles kernels of its own.
The steps are those of :class:`~blockdraft.proposer.forward.DraftForward` (the plain path runs
the same ones); the drafter layers run through its fused view (stacked weights, fused
elementwise kernels) when the drafter has one.

The host keeps a pinned copy of ``meta``, written in place by the Rust core's
``GraphMeta.fill`` in one call for all the sequences (:meth:`GraphRunner._fill`): per row the
three scalars, plus the blocks a precompute plan appended (a row's whole table is rewritten
only when the row holds another state or its table changed in some other way, e.g. after a
slide), and the staged positions/slots. One host-to-device copy per call moves it. The
states' device page tables are not made per call (``DFlashState.page_table_dev`` builds one
from the core on access). Rows past ``n`` (bucket padding) have no context and their drafts
are ignored. Inside the graph the ctx K/V store runs
on a second stream beside the first layer's input work (:meth:`GraphRunner._store_beside`).

Attention splits are derived from ``W`` (shapes only), so a graph stays valid for every context
length up to the window ceiling. ``mode="static"`` runs the same buffers eagerly on any device:
the CPU tests use it to check that the bookkeeping gives the drafts of the plain path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from blockdraft import faults
from blockdraft._core import GraphMeta
from blockdraft.cuda_graphs import capture, default_buckets
from blockdraft.proposer.forward import DraftForward
from blockdraft.proposer.state import Proposal

log = logging.getLogger(__name__)

class _Bucket:
    """Static buffers (and, when capturing, the graph) for up to ``size`` sequences."""

    def __init__(
        self,
        size: int,
        width: int,
        block_size: int,
        row_width: int,
        dtype: torch.dtype,
        device: torch.device,
        pin: bool,
        mask_id: int,
    ):
        self.size = size
        cols = GraphMeta.layout(width, block_size)[4]
        self.host = torch.zeros((size, cols), dtype=torch.int64, pin_memory=pin)
        # The core's writer of `host` (it sets the initial contents: mask anchors, no slots),
        # with its mirror of which state each row holds.
        self.meta = GraphMeta(self.host, width, block_size, mask_id, row_width * dtype.itemsize)
        self.dev = torch.zeros((size, cols), dtype=torch.int64, device=device)
        self.stage = torch.zeros((size * block_size, row_width), dtype=dtype, device=device)
        # Per staging capacity (see GraphRunner.stage_caps): the captured graph and its output.
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, Tensor] = {}
        # Marks the last copy of `host` to `dev` (CUDA): the pinned buffer is written again
        # only once that copy ran, as two calls may come without the host reading a result
        # between them (drafts left on the device).
        self.copied: Any = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]

    def staged(self) -> None:
        """``dev`` holds what ``host`` held (its copy launched)."""
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def writable(self) -> None:
        """Wait until the last copy of ``host`` ran (at once when a result was read since)."""
        if self.copied is not None:
            self.copied.synchronize()


class GraphRunner:
    """Static-buffer draft forward (greedy DFlash or DFlash2, no grammar mask) of one proposer.

    Args:
        forward: the proposer's draft forward (its drafter, target head, cache and kernels
            are used in place).
        mode: ``"capture"`` records a CUDA graph per bucket on first use and replays it;
            ``"static"`` runs the same buffers eagerly (any device).
        ceiling: the proposer's window ceiling (the page tables' width follows from it).
        max_batch: the most sequences one call takes.
        buckets: batch sizes with their own buffers (default: :func:`default_buckets`).

    Attributes:
        captures / replays: graphs recorded and replayed so far.
        disabled: why the runner stopped taking calls (a failed capture), or ``None``.
    """

    def __init__(
        self,
        forward: DraftForward,
        mode: Literal["capture", "static"],
        *,
        ceiling: int,
        max_batch: int,
        buckets: Sequence[int] | None = None,
    ) -> None:
        self.forward = forward
        self.mode = mode
        spec = forward.spec
        self.block_size = spec.block_size
        self.width = max(1, math.ceil(ceiling / forward.cache.page_size))
        self.buckets = sorted(set(buckets or default_buckets(max_batch)))
        self._slots: dict[int, _Bucket] = {}
        self._pool: Any = None
        self.captures = 0
        self.replays = 0
        self.disabled: str | None = None
        self._store_stream: Any = None  # the ctx K/V store's stream (CUDA only)
        # staged rows per sequence with a graph of their own, ascending (see stage_caps)
        self._stage_per = (1, min(4, self.block_size), self.block_size)
        # the metadata's columns (the core's layout)
        self._table_col, self._pos_col, self._slot_col, self._src_col, _ = GraphMeta.layout(
            self.width, self.block_size
        )
        # Where the backend gathers the staged accumulator rows itself (Triton), the replay
        # does, by the addresses the core writes into the metadata; elsewhere the host copies
        # them into `stage`.
        self.gather = forward.ops.stage_gather is not None

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` sequences, or ``None``."""
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def accepts(self, n: int) -> bool:
        """Whether a call for ``n`` sequences can take this path."""
        return self.disabled is None and self.bucket_for(n) is not None

    def bucket(self, size: int) -> _Bucket | None:
        """The buffers of bucket ``size`` once a call used them (``None`` before)."""
        return self._slots.get(size)

    def draft(self, proposal: Proposal) -> Tensor | None:
        """Drafts ``[n, B-1]`` int64 on the device for the prepared sequences, or ``None`` when
        this call must take the plain path (a table wider than the graphs' width).

        The proposal's precompute plans are outstanding and their K/V is not stored yet: when
        this returns drafts it has stored it (plans of at most B rows inside the graph,
        longer ones eagerly first); when it returns ``None`` it has stored nothing and the
        caller stores and drafts on the plain path. Call it under ``torch.no_grad()``.
        """
        n = len(proposal.plans)
        size = self.bucket_for(n)
        if size is None or self.disabled is not None:
            return None
        bucket = self._slots.get(size)
        if bucket is None:
            fwd = self.forward
            bucket = _Bucket(
                size, self.width, self.block_size, fwd.spec.ctx_row_width, fwd.dtype,
                fwd.device, self.mode == "capture", fwd.spec.mask_token_id,
            )
            self._slots[size] = bucket
        bucket.writable()
        staged = self._fill(bucket, proposal)
        if staged is None:
            return None
        if faults.active():
            # The graph replaces the eager forward: the same fault site covers it.
            faults.hit("forward")
        bucket.staged()
        return self.launch(bucket, n, self.stage_cap(bucket.size, staged))

    def stage_caps(self, size: int) -> list[int]:
        """The staging capacities (ctx rows whose K/V one call stores) with a graph of their
        own for a bucket of ``size`` rows: 1, 4 and B rows per sequence. The K/V GEMMs run over
        the whole capacity, so a step that commits one row per sequence (nothing accepted)
        does not pay for B."""
        return sorted({per * size for per in self._stage_per})

    def stage_cap(self, size: int, staged: int) -> int:
        """The smallest capacity of :meth:`stage_caps` holding ``staged`` rows."""
        for per in self._stage_per:
            if per * size >= staged:
                return per * size
        raise AssertionError(f"{staged} staged rows exceed the bucket's {size} x B")

    def launch(self, bucket: _Bucket, n: int, cap: int) -> Tensor | None:
        """The device work of one call on the filled buffers, storing ``cap`` staged rows'
        K/V: replay (capturing on first use) or, in static mode, the eager forward. ``None``:
        capture failed, graphs are off."""
        if self.mode == "static":
            got = self._forward(bucket.dev, bucket.stage, cap)
            # A replay's aliasing: the drafts are the bucket's buffer, which its next call
            # overwrites.
            out = bucket.outs.setdefault(cap, got)
            if out is not got:
                out.copy_(got)
            return out[:n]
        graph = bucket.graphs.get(cap)
        if graph is None:
            try:
                graph = self._capture(bucket, cap)
            except Exception as exc:  # noqa: BLE001 - fall back to the plain path for good
                self.disabled = f"CUDA graph capture failed: {exc}"
                log.warning("DFlash proposer: %s; using the eager path", self.disabled)
                torch.cuda.synchronize(self.forward.device)
                return None
        graph.replay()
        self.replays += 1
        return bucket.outs[cap][:n]

    def _fill(self, bucket: _Bucket, proposal: Proposal) -> int | None:
        """Write the call into the bucket's buffers; returns the number of staged rows, or
        ``None`` when a page table is wider than the graphs (nothing stored then).

        The core writes ``meta`` (:class:`~blockdraft._core.GraphMeta`). With the in-graph
        gather it also writes where each staged row lies; elsewhere the staged plans'
        accumulator rows go to ``stage`` here, in one copy. Plans longer than B rows are
        stored here instead (``DraftForward.store_long_plans``). This is the per-sequence host work of a graph-path
        call: one core call (and without the gather one list of row views)."""
        states = proposal.states
        bases = ([st.source_base(p.row_start, p.row_end) for st, p in zip(states, proposal.plans)]
                 if self.gather else None)
        got = bucket.meta.fill(proposal.plans, proposal.tokens, proposal.positions, bases)
        if got is None:
            return None
        staged, eager, staged_rows = got
        if eager:
            self.forward.store_long_plans([(states[i], proposal.plans[i]) for i in eager])
        if not staged:
            return 0
        if faults.active():
            faults.hit("kv_cache")
        if self.gather:
            return int(staged)
        rows = [states[i].rows(start, end) for i, start, end in staged_rows]
        if len(rows) > 1:
            torch.cat(rows, 0, out=bucket.stage[:staged])
        else:
            bucket.stage[:staged].copy_(rows[0])
        return int(staged)

    def _forward(self, meta: Tensor, stage: Tensor, cap: int) -> Tensor:
        """meta [m, 3 + W + 3B], stage [m*B, k*H] -> drafts [m, B-1] int64 (the plain path's
        steps, fixed shapes): the first ``cap`` staged rows' ctx K/V into the paged cache
        (staged row j is meta row j // B, entry j % B), then the draft."""
        fwd = self.forward
        m, b = meta.shape[0], self.block_size
        pc, sc = self._pos_col, self._slot_col
        stage_gather = fwd.ops.stage_gather

        def store() -> None:
            if stage_gather is not None:
                stage_gather(meta, sc, self._src_col, b, stage[:cap])
            fwd.write_ctx_kv(
                stage[:cap],
                meta[:, pc : pc + b].reshape(-1)[:cap],
                meta[:, sc : sc + b].reshape(-1)[:cap],
                fused=True,
            )

        # On CUDA the ctx K/V store runs on a second stream: nothing before the first layer's
        # attention reads the paged cache, so the drafter's inputs, first norm and q/k/v GEMM
        # run beside it, and the first attention waits for it.
        joined = self._store_beside(meta.device, store)
        ctx_lens, page_tables, embeds, q_pos = fwd.block_inputs(meta, self._table_col, self.width)
        paged = fwd.attention(page_tables, ctx_lens, q_pos, fault_hooks=False)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if layer == 0:
                joined()
            return paged(layer, q, k, v)

        hidden = fwd.layers(embeds, q_pos, attend, fused=True)  # [m, B, H]
        joined()  # joined even if no layer attended (a repeated wait is a no-op)
        if fwd.spec.is_dflash2:
            # the selector walk over rows 1..B-1, from each row's anchor (metadata column 1)
            return fwd.select(hidden[:, 1:], meta[:, 1])[0]
        rows = hidden[:, 1:].reshape(m * (b - 1), fwd.spec.hidden_size)
        return fwd.greedy(rows).view(m, b - 1)

    def _store_beside(self, device: torch.device, store: Callable[[], None]) -> Callable[[], None]:
        """Run ``store`` on the store stream (CUDA) or right away (elsewhere); returns what
        makes the current stream wait for it."""
        if device.type != "cuda":
            store()
            return lambda: None
        main = torch.cuda.current_stream(device)
        if self._store_stream is None:
            self._store_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side = self._store_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            store()
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(side)
        return lambda: main.wait_event(done)

    def _capture(self, bucket: _Bucket, cap: int) -> Any:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, out = capture(lambda: self._forward(bucket.dev, bucket.stage, cap),
                             self.forward.device, self._pool)
        bucket.graphs[cap] = graph
        bucket.outs[cap] = out
        self.captures += 1
        log.debug(
            "DFlash proposer: captured a CUDA graph for %d sequences, %d staged rows",
            bucket.size, cap,
        )
        return graph


__all__ = ["GraphRunner"]
