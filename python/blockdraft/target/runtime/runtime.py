"""The target runtime: a loaded Hugging Face target run by blockdraft's own forward.

:class:`TargetRuntime` owns the pieces: the checked :class:`TargetSpec`, the paged K/V in pages
of its own :class:`~blockdraft.BlockPool` (page tables kept by the Rust core's
:class:`~blockdraft.core.SeqPages`), and the :class:`TargetForward`. A sequence's life:

* :meth:`TargetRuntime.new_sequence` takes all the pages the sequence may need (its capacity:
  prompt + new tokens + look-ahead) at once, so a running sequence never waits for memory;
* :meth:`TargetRuntime.forward` runs new rows of many sequences in one forward (a prefill
  chunk, a verify block or a decode row each); their K/V are written, pending;
* :meth:`TargetRuntime.accept` commits the first ``k`` of each sequence's pending rows: a
  rejected draft's K/V is simply overwritten by the next forward, no copy;
* :meth:`TargetRuntime.free` gives every page back.

With a tensor-parallel group (``tp=``) every rank builds its own runtime over its shard of the
model (:mod:`blockdraft.target.runtime.shard`) and every rank makes the same calls in the same order:
the pool, the page tables and the forward plans are computed on every rank from the same
inputs (the Rust core is deterministic), so they are the same without being sent anywhere.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

import blockdraft._core as _core
from blockdraft import faults, kernels
from blockdraft._core import BlockPool, ConfigError, ForwardPlan, SeqPages
from blockdraft.cuda_graphs import GraphMode, resolve_mode
from blockdraft.kv_cache import PagedKVCache
from blockdraft.parallel.group import TPGroup
from blockdraft.target.runtime.forward import ForwardBatch, TargetForward
from blockdraft.target.runtime.graphs import RuntimeGraphs
from blockdraft.target.runtime.shard import shard_target
from blockdraft.target.runtime.spec import TargetSpec

log = logging.getLogger(__name__)

_owner_ids = iter(range(1 << 40, 1 << 62))  # apart from the proposers' owner tags


@dataclass
class ForwardOutput:
    """One forward's results.

    Attributes:
        logits: ``[m, V]`` in the target's dtype, for the rows asked for (see
            :meth:`TargetRuntime.forward`), sequence by sequence.
        ctx_rows: ``[R, k*H]`` the captured layers' rows of every new row (``None`` when the
            runtime captures no layer).
        rows: new rows per sequence.
    """

    logits: Tensor
    ctx_rows: Tensor | None
    rows: list[int]


class TargetRuntime:
    """A Hugging Face causal LM run on blockdraft's forward (Llama, Mistral, Qwen2, Qwen3).

    Attaching fuses each layer's q/k/v and gate/up weights into one tensor per layer that
    becomes the model's own storage (the modules' weights are views of it, so the model's own
    forward still works and nothing is held twice). The runtime's memory is its K/V pages and
    per-forward workspaces; ``docs/runtime.md`` gives the figures.

    Args:
        model: the target, in eval mode, already on its device and in its dtype.
        max_seq_len: the longest sequence (prompt + generation + look-ahead) served; default
            and upper bound: the config's ``max_position_embeddings``.
        num_pages: K/V pages in the pool; ``None`` sizes it to ``max_batch`` sequences of
            ``max_seq_len`` tokens, at most ``memory_fraction`` of free memory.
        page_size: tokens per page.
        max_batch: sequences a default-sized pool holds at their longest.
        memory_fraction: the most of the device's free memory a default-sized pool takes.
        backend: ``"auto"`` (Triton on CUDA, the torch references elsewhere), ``"triton"`` or
            ``"torch"``.
        capture_layers: target layer ids whose rows :meth:`forward` returns as ctx rows (a
            drafter's ``target_layer_ids``).
        prefill_chunk: the most prompt rows one prefill forward takes, so a long prompt needs
            neither ``[T, V]`` logits nor a ``T x T`` score matrix.
        graphs: forwards of the same number of rows for every sequence (``graph_rows``)
            through CUDA graphs per batch-size bucket (:mod:`blockdraft.target.runtime.graphs`):
            ``"auto"`` captures on CUDA, ``"capture"`` forces it, ``"static"`` runs the same
            fixed-shape buffers eagerly (any device), ``"off"`` disables them.
        graph_rows: rows per sequence with graphs of their own (1: decode; a drafter's B:
            verify).
        tp: the tensor-parallel group this process is a rank of (``None``: one rank). Every
            rank passes the same settings; the model keeps only this rank's shard of its
            projections from now on (its own forward no longer works), the pool holds this
            rank's K/V heads, and a pool sized from free memory takes the smallest size any
            rank can hold. ``graphs="auto"`` runs eagerly when the group has several ranks
            (CUDA-graph capture of the all-reduces is not verified).

    Raises:
        ConfigError: an unsupported architecture or feature (named), a bad backend, sizes the
            model cannot take, head counts or an intermediate size the group does not divide
            (named with their values), settings that differ between ranks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_seq_len: int | None = None,
        num_pages: int | None = None,
        page_size: int = 16,
        max_batch: int = 16,
        memory_fraction: float = 0.5,
        backend: str = "auto",
        capture_layers: Sequence[int] = (),
        prefill_chunk: int = 512,
        graphs: GraphMode = "auto",
        graph_rows: Sequence[int] = (1,),
        tp: TPGroup | None = None,
    ) -> None:
        spec = TargetSpec.from_model(model)
        if max_seq_len is None:
            max_seq_len = spec.max_positions
        for name, value in (("max_seq_len", max_seq_len), ("page_size", page_size),
                            ("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, not {value!r}")
        if max_seq_len > spec.max_positions:
            raise ConfigError(
                f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                f"{spec.max_positions}"
            )
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], not {memory_fraction}")
        self.backend = kernels.resolve_backend(backend, spec.device)
        mode = resolve_mode(graphs, spec.device)
        # Every check that needs no weights is made before the model gives up its full ones.
        self.tp = tp if tp is not None else TPGroup.single(spec.device)
        self.spec = spec = shard_target(spec, self.tp)
        self.model = model
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        sized = num_pages is None
        if num_pages is None:
            # Enough pages for max_batch full sequences, if the memory fraction holds them.
            num_pages = PagedKVCache.pages_for_memory(
                math.ceil(max_batch * max_seq_len / page_size),
                PagedKVCache.page_bytes(
                    page_size, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                    head_dim=spec.head_dim, dtype=spec.dtype,
                ),
                fraction=memory_fraction, device=spec.device, lever="memory_fraction",
                what="target K/V",
            )
        if self.tp.size > 1:
            if graphs == "auto" and mode == "capture":
                mode = None
            num_pages = self._agree(num_pages, sized, (
                max_seq_len, page_size, max_batch, prefill_chunk, tuple(capture_layers), mode,
                tuple(graph_rows), self.backend,
            ))
        self.pool = BlockPool(num_pages, page_size)
        self.cache = PagedKVCache(
            self.pool, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, dtype=spec.dtype, device=spec.device,
        )
        self.forward_pass = TargetForward(spec, self.cache, kernels.ops(self.backend), capture_layers,
                                          tp=self.tp)
        self._owner = next(_owner_ids)
        self._width = self.pages_for(max_seq_len)
        self.graphs: RuntimeGraphs | None = None
        if mode is not None:
            self.graphs = RuntimeGraphs(
                self.forward_pass, mode, width=self.pages_for(max_seq_len), max_batch=max_batch,
                rows=tuple(int(r) for r in graph_rows),
            )
        log.debug(
            "target runtime: %s on %s (%s), %d pages x %d tokens, %.1f MB of K/V",
            spec.architecture, spec.device, self.backend, num_pages, page_size,
            self.cache.nbytes / 2**20,
        )

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def owner_id(self) -> int:
        """Tag of every sequence this runtime makes."""
        return self._owner

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def pages_for(self, capacity: int) -> int:
        """Pages a sequence of ``capacity`` tokens takes."""
        return -(-capacity // self.pool.page_size)

    def _agree(self, num_pages: int, sized: bool, settings: tuple[object, ...]) -> int:
        """The pool size every rank uses (a size from free memory: the smallest any rank
        found; a given size: the same on every rank), after checking that every rank was
        given the same settings."""
        got = self.tp.gather((num_pages, sized, settings))
        if any(g[1:] != got[0][1:] for g in got):
            raise ConfigError(
                "tensor-parallel ranks built runtimes with different settings: "
                + "; ".join(f"rank {r}: {g[2]}" for r, g in enumerate(got))
            )
        sizes = [int(g[0]) for g in got]
        if not sized and len(set(sizes)) > 1:
            raise ConfigError(f"tensor-parallel ranks were given different num_pages: {sizes}")
        return min(sizes)

    def check_replicas(self, seqs: Sequence[SeqPages] = ()) -> None:
        """Check that every rank holds the same bookkeeping: free pages, and the page table,
        length and pending rows of each of ``seqs`` (a collective: every rank calls it with
        its own copies of the same sequences). Nothing to compare on one rank.

        Raises:
            RuntimeError: naming the first rank that differs from rank 0 and what differs.
        """
        mine = (self.pool.num_free,
                [(list(s.pages), s.length, s.pending, s.capacity) for s in seqs])
        got = self.tp.gather(mine)
        for r, other in enumerate(got[1:], start=1):
            if other != got[0]:
                raise RuntimeError(
                    f"tensor-parallel rank {r}'s pages differ from rank 0's: {other} != {got[0]}"
                )

    def new_sequence(self, capacity: int) -> SeqPages:
        """A sequence that may hold up to ``capacity`` tokens (all its pages taken now).

        Raises:
            ValueError: ``capacity`` below 1 or past ``max_seq_len``.
            PoolExhaustedError: not enough free pages (nothing taken).
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"capacity must be an int, not {type(capacity).__name__}")
        if not 1 <= capacity <= self.max_seq_len:
            raise ValueError(f"capacity must be in 1..{self.max_seq_len} (max_seq_len), not {capacity}")
        if faults.active():
            faults.hit("target_pages")
        return SeqPages(self.pool, capacity, self._owner)

    def free(self, seqs: Sequence[SeqPages]) -> None:
        """Give back every page of ``seqs`` (idempotent).

        Raises:
            InvalidStateError: a sequence of another runtime (nothing freed).
        """
        _core.free_all("free", list(seqs), self._owner)

    def accept(self, seqs: Sequence[SeqPages], counts: Sequence[int]) -> None:
        """Commit the first ``counts[i]`` pending rows of each sequence (the rest of the last
        forward's rows are dropped, to be overwritten).

        Raises:
            InvalidStateError / ValueError: a foreign or freed sequence, a count past its
                pending rows (nothing changed).
        """
        _core.accept_rows("accept", list(seqs), counts, self._owner)

    def forward(
        self,
        seqs: Sequence[SeqPages],
        tokens: Sequence[Sequence[int]],
        *,
        logits: str = "all",
        capture: bool = True,
    ) -> ForwardOutput:
        """One forward over ``tokens[i]`` appended to each sequence (its rows stay pending
        until :meth:`accept`).

        Args:
            seqs: distinct live sequences of this runtime.
            tokens: per sequence its new token ids (at least one).
            logits: ``"all"`` (every new row, as a verify needs) or ``"last"`` (each
                sequence's last row, as a prefill or decode needs).

            capture: return the captured layers' rows (when the runtime has capture layers).

        Returns:
            the logits and captured rows; on the graph path they are views of the graph's
            buffers, valid until the next forward of the same shape.

        Raises:
            InvalidStateError: a foreign or freed sequence.
            TypeError / ValueError: bad tokens, or rows past a sequence's capacity (nothing
                changed). A forward that fails after that leaves every sequence's length as it
                was and nothing pending.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', not {logits!r}")
        if len(tokens) != len(seqs):
            raise ValueError(f"{len(seqs)} sequences but {len(tokens)} token lists")
        return self._planned(seqs, self._tokens(tokens), [len(t) for t in tokens], logits, capture)

    def forward_drafted(self, seqs: Sequence[SeqPages], anchors: Sequence[int], drafts: Tensor) -> ForwardOutput:
        """:meth:`forward` of each sequence's block ``[anchors[i], *drafts[i]]`` (every row's
        logits, the captured rows), with the drafts ``[n, k]`` int64 still on the device (a
        drafter's output): on the graph path they go into the forward's ids on the device, so
        the host launches the verify without waiting for the drafter; elsewhere they are read
        first. The drafts are not range-checked (a drafter picks tokens of the vocabulary the
        target shares); the anchors are.

        Raises:
            as :meth:`forward`.
        """
        if drafts.dim() != 2 or drafts.shape[0] != len(seqs) or len(anchors) != len(seqs):
            raise ValueError(f"{len(seqs)} sequences, {len(anchors)} anchors and drafts of shape "
                             f"{tuple(drafts.shape)} (one row of drafts per sequence)")
        n, rows = len(seqs), drafts.shape[1] + 1
        graphs = self.graphs
        if graphs is None or not graphs.accepts(n, rows):
            return self.forward(seqs, [[a, *d] for a, d in zip(anchors, drafts.tolist())])
        flat = [t for a in self._tokens([anchors]) for t in (a, *([0] * (rows - 1)))]
        return self._planned(seqs, flat, [rows] * n, "all", True, drafts)

    def _planned(self, seqs: Sequence[SeqPages], flat: list[int], counts: list[int], logits: str,
                 capture: bool, drafts: Tensor | None = None) -> ForwardOutput:
        """The core's plan of ``counts[i]`` new rows per sequence, then the forward over it."""
        plan = _core.plan_forward("forward", list(seqs), counts, self._owner)
        try:
            return self._run(plan, flat, counts, logits, capture, drafts)
        except BaseException:
            # The rows were never (or only partly) written: none of them may be accepted.
            _core.accept_rows("forward", list(seqs), [0] * len(counts), self._owner)
            raise

    def _run(self, plan: ForwardPlan, flat: list[int], counts: list[int], logits: str,
             capture: bool, drafts: Tensor | None = None) -> ForwardOutput:
        rows_each = counts[0] if counts else 0
        graphs = self.graphs
        if (graphs is not None and all(c == rows_each for c in counts)
                and (logits == "all" or rows_each == 1) and graphs.accepts(len(counts), rows_each)):
            if faults.active():
                faults.hit("target_forward")
            got = graphs.run(plan, flat, len(counts), rows_each, drafts)
            if got is not None:
                return ForwardOutput(got[0], got[1] if capture else None, counts)
        if drafts is not None:
            # Off the graph path (capture failed): the ids are the host's, drafts read in.
            ids = drafts.tolist()
            flat = [t for i, first in enumerate(flat[::rows_each]) for t in (first, *ids[i])]
        batch = self._batch(plan, flat, logits)
        width = self.forward_pass.ctx_row_width
        rows = None
        if capture and width:
            if faults.active():
                faults.hit("workspace")
            rows = torch.empty((plan.n_rows, width), dtype=self.spec.dtype, device=self.device)
        if faults.active():
            faults.hit("target_forward")
        out = self.forward_pass.run(batch, rows)
        return ForwardOutput(out, rows, counts)

    def prefill(
        self,
        seqs: Sequence[SeqPages],
        prompts: Sequence[Sequence[int]],
        *,
        on_chunk: Callable[[list[int], list[range], Tensor], None] | None = None,
    ) -> Tensor:
        """Run each prompt through its (empty) sequence in chunks of at most
        ``prefill_chunk`` rows in all, accepting them; returns each prompt's last-row logits
        ``[n, V]``.

        Prompts that equal an earlier one of the call (the choices of one request, say) are
        not run again: each chunk of the first's is copied into theirs (its K/V into their
        pages, its rows to ``on_chunk`` for them too), so they cost one forward and hold the
        same bits, each in pages of its own.

        Args:
            on_chunk: called after each chunk with the indices (into ``seqs``) of the
                sequences it held, their positions, and the chunk's ctx rows ``[rows, k*H]``
                (the drafter's context commit).
        """
        if len(prompts) != len(seqs):
            raise ValueError(f"{len(seqs)} sequences but {len(prompts)} prompts")
        first: dict[tuple[int, ...], int] = {}
        lead = [first.setdefault(tuple(p), i) for i, p in enumerate(prompts)]  # who runs it
        copies: dict[int, list[int]] = {}
        for i, j in enumerate(lead):
            if j != i:
                copies.setdefault(j, []).append(i)
        done = [0] * len(prompts)
        last: list[Tensor | None] = [None] * len(prompts)
        while True:
            idx: list[int] = []
            parts: list[list[int]] = []
            budget = self.prefill_chunk
            for i, p in enumerate(prompts):
                left = len(p) - done[i]
                if left > 0 and budget > 0 and lead[i] == i:
                    take = min(left, budget)
                    idx.append(i)
                    parts.append(list(p[done[i] : done[i] + take]))
                    budget -= take
            if not idx:
                break
            out = self.forward([seqs[i] for i in idx], parts, logits="last",
                               capture=on_chunk is not None)
            self.accept([seqs[i] for i in idx], [len(t) for t in parts])
            spans = [range(done[i], done[i] + len(t)) for i, t in zip(idx, parts)]
            rows = out.ctx_rows
            if copies:
                idx, spans, rows = self._copy_chunk(seqs, idx, spans, rows, copies)
            for i, span in zip(idx, spans):
                done[i] = span.stop
                if done[i] == len(prompts[i]):
                    last[i] = out.logits[idx.index(lead[i])]
            if on_chunk is not None and rows is not None:
                on_chunk(idx, spans, rows)
        if any(t is None for t in last):
            raise ValueError("every prompt must hold at least one token")
        return torch.stack([t for t in last if t is not None])

    def _copy_chunk(self, seqs: Sequence[SeqPages], idx: list[int], spans: list[range],
                    rows: Tensor | None, copies: dict[int, list[int]],
                    ) -> tuple[list[int], list[range], Tensor | None]:
        """A prefill chunk's rows of each sequence in ``idx`` copied into the sequences
        ``copies`` lists for it (their K/V written and accepted); ``idx``, ``spans`` and
        ``rows`` with the copies' appended, in the order ``on_chunk`` takes them."""
        offsets = [0]
        for span in spans:
            offsets.append(offsets[-1] + len(span))
        to = [(k, j) for k, i in enumerate(idx) for j in copies.get(i, ())]
        if not to:
            return idx, spans, rows
        dst = [seqs[j] for _, j in to]
        plan = _core.plan_forward("prefill", dst, [len(spans[k]) for k, _ in to], self._owner)
        try:
            src = [seqs[idx[k]].slot(pos) for k, _ in to for pos in spans[k]]
            dev = self.device
            self.forward_pass.cache.copy_slots(torch.tensor(src, dtype=torch.long, device=dev),
                                               torch.tensor(plan.slots, dtype=torch.long, device=dev))
        except BaseException:
            _core.accept_rows("prefill", dst, [0] * len(dst), self._owner)
            raise
        self.accept(dst, [len(spans[k]) for k, _ in to])
        more_rows = None if rows is None else torch.cat(
            [rows] + [rows[offsets[k]:offsets[k + 1]] for k, _ in to])
        return idx + [j for _, j in to], spans + [spans[k] for k, _ in to], more_rows

    def _tokens(self, tokens: Sequence[Sequence[int]]) -> list[int]:
        vocab = int(self.spec.embed.weight.shape[0])
        flat: list[int] = [t for toks in tokens for t in toks]
        # The common case checked in C (every id a plain int in range); anything else is
        # walked token by token below, for the error that names the sequence.
        if flat and set(map(type, flat)) == {int} and 0 <= min(flat) and max(flat) < vocab:
            return flat
        flat = []
        for i, toks in enumerate(tokens):
            for t in toks:
                if isinstance(t, bool) or not isinstance(t, int):
                    try:
                        t = t.__index__()
                    except (AttributeError, TypeError):
                        raise TypeError(f"sequence {i}: token ids must be ints, not {type(t).__name__}") from None
                if not 0 <= t < vocab:
                    raise ValueError(f"sequence {i}: token id {t} is outside the vocabulary [0, {vocab})")
                flat.append(t)
        return flat

    def _batch(self, plan: ForwardPlan, flat: list[int], logits: str) -> ForwardBatch:
        dev = self.device
        n = len(plan.kv_lens)
        # Every table is as wide as the longest sequence's (as on the graph path): the
        # attention's context splits follow the width, and a width that followed the lengths
        # would make a new kernel variant (a compile) for each new length class.
        width = self._width
        table = torch.empty((n, width), dtype=torch.int32)
        plan.fill(table, width)
        q_starts = plan.q_starts
        logit_rows = None
        if logits == "last":
            logit_rows = torch.tensor([q - 1 for q in q_starts[1:]], dtype=torch.int64, device=dev)
        return ForwardBatch(
            input_ids=torch.tensor(flat, dtype=torch.int64, device=dev),
            positions=torch.tensor(plan.positions, dtype=torch.int64, device=dev),
            slots=torch.tensor(plan.slots, dtype=torch.int64, device=dev),
            page_tables=table.to(dev),
            q_starts=torch.tensor(q_starts, dtype=torch.int32, device=dev),
            kv_lens=torch.tensor(plan.kv_lens, dtype=torch.int32, device=dev),
            max_rows=plan.max_rows,
            logit_rows=logit_rows,
        )


__all__ = ["ForwardOutput", "TargetRuntime"]
