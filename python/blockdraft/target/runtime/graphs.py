"""CUDA-graph replay of the runtime's steady-state forwards.

A decode step (one row per sequence) and a verify step (B rows per sequence) have shapes that
depend only on the number of sequences, so each is captured once per batch-size bucket (powers
of two up to the most sequences) and replayed; per call only the metadata changes, written in
place into the bucket's static buffers (one host-to-device copy of a pinned staging buffer):

    ids / positions / slots [bucket * r] int64: the new rows (rows past n: token 0 at
        position 0 with slot ``PAD_SLOT``, so they write no K/V)
    kv_lens [bucket] int32 (past n: 1), page_tables [bucket, W] int32 (past n: page 0)
    q_starts [bucket + 1] int32: ``i * r``, fixed

Rows past ``n`` read page 0's first token (whatever it holds) and their logits are never
used. ``W`` is the pages of the longest sequence the runtime serves; the attention's grid and
context splits are functions of ``W`` and the bucket only, so one graph serves every context
length. Prefill chunks (any number of rows) run eagerly. ``mode="static"`` runs the same
buffers eagerly on any device: the CPU tests use it to check the bookkeeping.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from torch import Tensor

from blockdraft._core import PAD_SLOT, ForwardPlan
from blockdraft.cuda_graphs import capture, default_buckets
from blockdraft.target.runtime.forward import ForwardBatch, TargetForward

log = logging.getLogger(__name__)

class _Bucket:
    """Static buffers (and the graph) for up to ``size`` sequences of ``rows`` rows each."""

    def __init__(self, size: int, rows: int, width: int, capture_width: int, dtype: torch.dtype,
                 device: torch.device, pin: bool) -> None:
        self.size, self.rows = size, rows
        m = size * rows
        # One pinned staging buffer for the int64 metadata (ids, positions, slots) and one for
        # the int32 metadata (kv_lens, then the page table), each copied in one launch.
        self.host64 = torch.zeros((3, m), dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros((size + size * width,), dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros((3, m), dtype=torch.int64, device=device)
        self.dev32 = torch.zeros((size + size * width,), dtype=torch.int32, device=device)
        self.host_table = self.host32[size:].view(size, width)
        self.batch = ForwardBatch(
            input_ids=self.dev64[0], positions=self.dev64[1], slots=self.dev64[2],
            page_tables=self.dev32[size:].view(size, width),
            q_starts=torch.arange(size + 1, dtype=torch.int32, device=device) * rows,
            kv_lens=self.dev32[:size], max_rows=rows,
        )
        self.capture = torch.zeros((m, capture_width), dtype=dtype, device=device) if capture_width else None
        self.graph: Any = None
        self.logits: Tensor | None = None
        # Sequences whose rows a call wrote since the padding was last reset: a call of as
        # many or more rewrites every row of its own and leaves the padding past it clean.
        self.written = 0

    def reset_padding(self) -> None:
        """Rows past any call's ``n``: token 0 at position 0, no K/V written, one key."""
        self.written = 0
        self.host64[0].zero_()
        self.host64[1].zero_()
        self.host64[2].fill_(PAD_SLOT)
        self.host32.zero_()
        self.host32[: self.size].fill_(1)


class RuntimeGraphs:
    """Fixed-shape decode and verify forwards of one :class:`TargetForward`.

    Args:
        forward: the runtime's forward (its cache and kernels are used in place).
        mode: ``"capture"`` records a graph per (bucket, rows) on first use and replays it;
            ``"static"`` runs the same buffers eagerly.
        width: page-table entries per sequence (pages of the longest sequence).
        max_batch: the most sequences one call takes.
        rows: rows per sequence with graphs of their own (1 for decode, B for verify).

    Attributes:
        calls / captures / replays: calls taken, graphs recorded and replayed so far;
        ``disabled``: why capture stopped (a failed capture), or ``None``.
    """

    def __init__(self, forward: TargetForward, mode: Literal["capture", "static"], *, width: int,
                 max_batch: int, rows: tuple[int, ...]) -> None:
        self.forward = forward
        self.mode = mode
        self.width = width
        self.buckets = default_buckets(max_batch)
        self.rows = tuple(sorted(set(rows)))
        self._slots: dict[tuple[int, int], _Bucket] = {}
        self._pool: Any = None
        self.calls = 0
        self.captures = 0
        self.replays = 0
        self.disabled: str | None = None

    def accepts(self, n: int, rows: int) -> bool:
        """Whether ``n`` sequences of ``rows`` rows each can take this path."""
        return (self.disabled is None and rows in self.rows and n <= self.buckets[-1])

    def run(self, plan: ForwardPlan, flat: list[int], n: int, rows: int,
            drafts: Tensor | None = None) -> tuple[Tensor, Tensor | None] | None:
        """The forward of ``n`` sequences of ``rows`` new rows each (``plan`` from the core,
        ``flat`` their tokens): ``(logits [n * rows, V], captured rows [n * rows, k*H] or
        None)`` as views of the bucket's static outputs (valid until the next call of this
        bucket), or ``None`` when capture failed (graphs are then off for good).

        ``drafts`` ``[n, rows - 1]`` int64 on the device: each sequence's tokens after its
        first, copied into the ids on the device (``flat``'s entries there are ignored)."""
        size = next(b for b in self.buckets if b >= n)
        bucket = self._slots.get((size, rows))
        if bucket is None:
            fwd = self.forward
            bucket = _Bucket(size, rows, self.width, fwd.ctx_row_width, fwd.spec.dtype,
                             fwd.spec.device, self.mode == "capture")
            bucket.reset_padding()
            self._slots[(size, rows)] = bucket
        m = n * rows
        self.calls += 1
        if n < bucket.written:
            bucket.reset_padding()
        bucket.written = n
        # Rows [:n] get their ids, positions, slots, lengths and the pages holding their
        # kv_lens tokens; a table row's entries past those keep what an earlier call wrote
        # (page ids of this pool, or 0): the attention loads no table entry past a sequence's
        # length, so a table as wide as max_seq_len costs each step only the pages in use.
        bucket.host64[:, :m] = torch.tensor((flat, plan.positions, plan.slots), dtype=torch.int64)
        bucket.host32[:n] = torch.tensor(plan.kv_lens, dtype=torch.int32)
        plan.fill(bucket.host_table[:n], self.width, pad=False)
        bucket.dev64.copy_(bucket.host64, non_blocking=True)
        bucket.dev32.copy_(bucket.host32, non_blocking=True)
        if drafts is not None:
            bucket.dev64[0, :m].view(n, rows)[:, 1:].copy_(drafts)
        if self.mode == "static":
            logits = self.forward.run(bucket.batch, bucket.capture)
        else:
            if bucket.graph is None:
                try:
                    self._capture(bucket)
                except Exception as exc:  # noqa: BLE001 - the eager path for good
                    self.disabled = f"CUDA graph capture failed: {exc}"
                    log.warning("target runtime: %s; running eagerly", self.disabled)
                    torch.cuda.synchronize(self.forward.spec.device)
                    return None
            bucket.graph.replay()
            self.replays += 1
            assert bucket.logits is not None
            logits = bucket.logits
        cap = None if bucket.capture is None else bucket.capture[:m]
        return logits[:m], cap

    def _capture(self, bucket: _Bucket) -> None:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        bucket.graph, bucket.logits = capture(
            lambda: self.forward.run(bucket.batch, bucket.capture), self.forward.spec.device,
            self._pool,
        )
        self.captures += 1
        log.debug("target runtime: captured a graph for %d sequences x %d rows", bucket.size, bucket.rows)


__all__ = ["RuntimeGraphs"]
