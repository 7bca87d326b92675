"""The DFlash proposer: the contract a serving engine calls.

The Rust core (:mod:`blockdraft._core`) decides every piece of bookkeeping (which pool pages a
sequence holds, which context rows it keeps and at which positions, how many rows have K/V in
the paged cache, whether a batch is accepted, whose state it is and whether it is live); the
parts of this package own the tensors and move them according to the core's plans:

* ``commit_ctx`` / ``commit_ctx_batch``: ``plan_appends`` -> :class:`ContextWriter` (slides,
  accumulator copies) -> ``AppendBatch.apply``; ``committing``: the same with the copies
  after the ``with`` block it opens (a proposal inside it drafts from the new rows);
* ``propose`` / ``propose_batch``: ``plan_proposals`` (every anchor checked, every sequence's
  K/V planned, all or nothing) -> :class:`DraftForward` (or its replay,
  :class:`GraphRunner`) -> ``confirm_proposals``. Any failure before the confirm aborts the
  plans, which gives the pages back and leaves every state as it was.

Each entry point makes one core call per phase for all its sequences, so the per-sequence host
work of a step is a few list comprehensions.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor

import blockdraft._core as _core
from blockdraft import faults, kernels
from blockdraft._core import AppendBatch, BlockPool, ConfigError, ContextState, InvalidStateError
from blockdraft.cuda_graphs import GraphMode, resolve_mode
from blockdraft.kv_cache import PagedKVCache
from blockdraft.levers import Levers, read_levers
from blockdraft.parallel.group import TPGroup
from blockdraft.proposer import run
from blockdraft.proposer.commit import ContextWriter, Deferred, as_positions, check_rows
from blockdraft.proposer.draft import Drafts, Mask, SampledDraft, draft_many
from blockdraft.proposer.forward import DraftForward, Generators
from blockdraft.proposer.graphs import GraphRunner
from blockdraft.proposer.pool import pool_pages
from blockdraft.proposer.spec import DraftSpec
from blockdraft.proposer.state import DFlashState, Proposal
from blockdraft.sampling import SamplingParams
from blockdraft.target import TargetHead

log = logging.getLogger(__name__)

BackendName = Literal["auto", "torch", "triton"]
_Drafted = TypeVar("_Drafted")

_owner_ids = itertools.count(1)
# The window-cap notice is once per process: it is about the server's sizing, not about any
# one sequence.
_cap_logged = False


class DFlashProposer:
    """Drafts blocks of tokens for many sequences with a DFlash drafter.

    Args:
        drafter: a loaded DFlash / DFlash2 drafter (:func:`blockdraft.load_drafter`).
        target: the target model (a Hugging Face causal LM or a
            :class:`~blockdraft.TargetAdapter`); only its input embeddings, ``lm_head`` and
            config are used.
        max_seq_len: the longest sequence the target serves; with the context cap it bounds
            each state's window. Default: the target config's ``max_position_embeddings``.
        num_pages: paged K/V pages in the pool. ``None`` sizes the pool to
            ``pool_memory_fraction`` of free device memory, at most what ``max_batch`` full
            windows need.
        pool_memory_fraction: fraction of free memory for the pool when ``num_pages`` is None.
        page_size: tokens per paged K/V page.
        max_batch: the most sequences one ``propose_batch`` accepts.
        backend: "triton", "torch", or "auto" (Triton on CUDA, torch elsewhere).
        device: where the K/V cache and accumulators live (default: the drafter's device).
        dtype: K/V cache and accumulator dtype (default: the drafter's dtype).
        pool: share an existing :class:`~blockdraft.BlockPool` (its sizes win).
        batched_path: allow the batched ``propose_batch`` path at all.
        graphs: the steady-state draft forward (greedy, no grammar mask) through a
            :class:`GraphRunner`: ``"auto"`` captures CUDA graphs per batch-size bucket on CUDA
            and runs the plain path elsewhere; ``"capture"``, ``"static"`` (the graph path's
            buffers, run eagerly) or ``"off"`` force one.
        levers: the proposer's levers (:class:`~blockdraft.Levers`); default: read from the
            ``BLOCKDRAFT_DFLASH_*`` environment variables.
        tp: a tensor-parallel group whose every rank builds this proposer: the pool gets one
            size on every rank before it is allocated (admission reads it), the smallest any
            rank found in its free memory; given sizes must agree.

    Raises:
        ConfigError: a bad lever, backend or ``graphs`` mode (``"capture"`` off CUDA too), a
            drafter that does not fit the target, or no ``max_seq_len`` and a target without
            ``max_position_embeddings``.
        ValueError: non-positive sizes.
    """

    def __init__(
        self,
        drafter: Any,
        target: Any,
        *,
        max_seq_len: int | None = None,
        num_pages: int | None = None,
        pool_memory_fraction: float = 0.25,
        page_size: int = 16,
        max_batch: int = 16,
        backend: BackendName = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        pool: BlockPool | None = None,
        batched_path: bool = True,
        graphs: GraphMode = "auto",
        levers: Levers | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        self.spec = spec = DraftSpec.from_drafter(drafter)
        self.head = head = TargetHead.from_target(target)
        head.check_fits(drafter_hidden=spec.hidden_size, target_layer_ids=spec.target_layer_ids,
                        mask_token_id=spec.mask_token_id)
        if max_seq_len is None:
            if head.max_positions is None:
                raise ConfigError(
                    "max_seq_len not given and the target config has no max_position_embeddings"
                )
            max_seq_len = head.max_positions
        for name, value in (("max_seq_len", max_seq_len), ("max_batch", max_batch),
                            ("page_size", page_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, not {value}")
        if not 0.0 < pool_memory_fraction <= 1.0:
            raise ValueError(f"pool_memory_fraction must be in (0, 1], not {pool_memory_fraction}")
        if levers is not None and not isinstance(levers, Levers):
            raise TypeError(f"levers must be a blockdraft.Levers, not {type(levers).__name__}")
        self.levers: Levers = levers if levers is not None else read_levers()
        self.drafter = drafter
        self.target = target
        first = next(iter(drafter.parameters()), None)
        self.device = torch.device(
            device if device is not None else (first.device if first is not None else "cpu")
        )
        self.dtype = dtype if dtype is not None else (first.dtype if first is not None else torch.float32)
        self.backend: kernels.Backend = kernels.resolve_backend(backend, self.device)
        ops = kernels.ops(self.backend)
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self._batched_path = batched_path
        self.ceiling = _core.ctx_ceiling(max_seq_len, self.levers.ctx_cap)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.ctx_slot_bytes = spec.ctx_row_width * elem
        if pool is None:
            pool = BlockPool(pool_pages(spec, num_pages, page_size=page_size, max_batch=max_batch,
                                        ceiling=self.ceiling, dtype=self.dtype, device=self.device,
                                        fraction=pool_memory_fraction, tp=tp), page_size)
        self.pool = pool
        self.cache = PagedKVCache(
            pool, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, dtype=self.dtype, device=self.device, slot_pos=True,
        )
        self.forward = DraftForward(drafter, spec, head, self.cache, ops, self.dtype, self.device)
        self.writer = ContextWriter(ops, spec.block_size)
        self._owner = next(_owner_ids)
        mode = resolve_mode(graphs, self.device)
        self._graphs: GraphRunner | None = (
            GraphRunner(self.forward, mode, ceiling=self.ceiling, max_batch=max_batch)
            if mode is not None else None
        )
        self._graphs_paused = False
        if spec.max_positions < max_seq_len:
            log.info("the drafter's max_position_embeddings (%d) is below max_seq_len (%d): a "
                     "sequence drafts while its blocks fit below it, then decodes with the target "
                     "alone", spec.max_positions, max_seq_len)

    @property
    def block_gamma(self) -> int:
        """The drafter's block size B (anchor + B-1 drafts)."""
        return self.spec.block_size

    @property
    def max_positions(self) -> int:
        """The drafter's ``max_position_embeddings``: a proposal's rows (its block's included)
        all sit below it."""
        return self.spec.max_positions

    def can_draft(self, position: int) -> bool:
        """Whether a block anchored at ``position`` stays inside the drafter's positions
        (``position + B <= max_positions``). Past that the proposer drafts nothing for the
        sequence (:meth:`draft` gives it no drafts; :meth:`propose` raises ``ValueError``,
        :meth:`propose_batch` declines), and the engine decodes it with the target alone."""
        return position + self.block_gamma <= self.spec.max_positions

    @property
    def page_size(self) -> int:
        """Tokens per paged K/V page of the pool."""
        return self.pool.page_size

    @property
    def owner_id(self) -> int:
        """Tag carried by every state this proposer makes."""
        return self._owner

    @property
    def target_layer_ids(self) -> list[int]:
        """The target layers whose outputs form a ctx row, in row order."""
        return list(self.spec.target_layer_ids)

    @property
    def ctx_row_width(self) -> int:
        """``k * H``: values per ctx row (``hidden_rows`` is ``[R, ctx_row_width]``)."""
        return self.spec.ctx_row_width

    @property
    def vocab_size(self) -> int:
        """V, the target head's vocabulary (drafts and bitmasks cover it)."""
        return self.head.vocab_size

    @property
    def graph_runner(self) -> GraphRunner | None:
        """The graph path, when ``graphs`` turned it on (``None`` otherwise). Assign a
        :class:`GraphRunner` over this proposer's :attr:`forward` to replace it (e.g. with
        other buckets or a narrower width), or ``None`` to turn the graph path off."""
        return self._graphs

    @graph_runner.setter
    def graph_runner(self, runner: GraphRunner | None) -> None:
        if runner is not None and runner.forward is not self.forward:
            raise ValueError("the graph runner must run this proposer's forward")
        self._graphs = runner

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Inside the block, proposals take the plain path even where graphs are on (to time
        or check one against the other)."""
        before, self._graphs_paused = self._graphs_paused, True
        try:
            yield
        finally:
            self._graphs_paused = before

    def alloc_state(self) -> DFlashState:
        """A fresh state whose window is the ceiling (``max_seq_len`` bounded by the cap)."""
        return self._alloc(None)

    def alloc_state_for(self, budget_tokens: int) -> DFlashState:
        """A fresh state whose window is ``min(ceiling, budget_tokens + B + 1)``.

        Args:
            budget_tokens: prompt plus max new tokens (>= 0).

        Raises:
            TypeError / ValueError: a budget that is not an int, or negative.
        """
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int):
            raise TypeError(f"budget_tokens must be an int, not {type(budget_tokens).__name__}")
        if budget_tokens < 0:
            raise ValueError(f"budget_tokens must be >= 0, not {budget_tokens}")
        return self._alloc(budget_tokens)

    def _alloc(self, budget: int | None) -> DFlashState:
        global _cap_logged
        window = _core.ctx_window(self.max_seq_len, self.block_gamma, budget, self.levers.ctx_cap)
        if self.ceiling < self.max_seq_len and not _cap_logged:
            _cap_logged = True
            mib = 1024 * 1024
            log.info(
                "DFlash ctx window capped to %d of max_seq_len %d (%d MB/seq instead of %d MB): "
                "the accumulator is per sequence, so the uncapped size is what runs out of "
                "memory at high concurrency and long context. Override with "
                "BLOCKDRAFT_DFLASH_CTX_CAP=<tokens> (0 = uncapped).",
                self.ceiling,
                self.max_seq_len,
                self.ceiling * self.ctx_slot_bytes // mib,
                self.max_seq_len * self.ctx_slot_bytes // mib,
            )
        # Zeroed so that no earlier allocation's data is visible through a fresh state.
        if faults.active():
            faults.hit("accumulator")
        acc = torch.zeros((window, self.ctx_row_width), dtype=self.dtype, device=self.device)
        room = _core.slide_room(window, self.levers.slide)
        return DFlashState(ContextState(self.pool, window, self._owner, room), acc)

    def free_state(self, st: object) -> None:
        """Give back every page and the accumulator; reset every counter. Idempotent.

        A state of another kind is ignored; a DFlash state of another proposer is an error.

        Raises:
            InvalidStateError: a state of another proposer.
        """
        if not isinstance(st, DFlashState):
            return
        st.ctx.free(self._owner)
        st.release()

    def _ctxs(self, states: Sequence[object], what: str) -> list[ContextState]:
        """The core states of ``states``; the core checks their owner, liveness and that none
        repeats. A non-state raises ``InvalidStateError``."""
        ctxs = [st.ctx for st in states if type(st) is DFlashState]
        if len(ctxs) != len(states):
            ctxs = []
            for st in states:
                if not isinstance(st, DFlashState):
                    raise InvalidStateError(
                        f"{what}: not a DFlash proposer state ({type(st).__name__})"
                    )
                ctxs.append(st.ctx)
        return ctxs

    def commit_ctx(
        self, st: DFlashState, hidden_rows: Tensor, positions: Sequence[int] | Tensor | Iterable[int]
    ) -> None:
        """Append verified target context rows; slides the window when it is full.

        Args:
            st: a live state of this proposer.
            hidden_rows: ``[R, k*H]`` concatenated target hidden states of the selected layers.
            positions: ``R`` strictly increasing token positions, after the last one committed.
                When ``R`` exceeds the window only the newest ``window`` rows are kept.

        Raises:
            InvalidStateError: a foreign or freed state.
            TypeError / ValueError: bad rows or positions (nothing changed).
        """
        ctxs = self._ctxs([st], "commit_ctx")
        check_rows(hidden_rows, self.ctx_row_width, self.device)
        pos = as_positions(positions)
        if len(pos) != hidden_rows.shape[0]:
            raise ValueError(f"{hidden_rows.shape[0]} rows but {len(pos)} positions")
        if not len(pos):
            raise ValueError("positions must not be empty")
        batch = _core.plan_appends("commit_ctx", ctxs, [pos], self._owner)
        self.writer.write([st], batch, hidden_rows)

    def commit_ctx_batch(
        self,
        states: Sequence[DFlashState],
        hidden_rows: Tensor,
        positions: Sequence[Sequence[int] | Tensor | Iterable[int]],
    ) -> None:
        """:meth:`commit_ctx` for many sequences at once, as a serving step has them after one
        verify forward: one core call plans every append, and one copy launch (the
        accumulator kernel on the Triton backend) writes all the rows.

        Args:
            states: distinct live states of this proposer.
            hidden_rows: ``[sum R_i, k*H]``: the rows of ``states[0]``, then ``states[1]``, ...
            positions: per state its ``R_i`` positions (the rules of :meth:`commit_ctx`; a
                state may get 0 rows). When ``R_i`` exceeds a window only its newest rows are
                kept.

        All or nothing: every state is checked and planned before any accumulator is
        touched, so an error leaves every state as it was.

        Raises:
            InvalidStateError: a foreign or freed state.
            TypeError / ValueError: bad rows or positions, a state given twice, or row counts
                that do not add up to ``hidden_rows`` (nothing changed).
        """
        self.writer.write(states, self._plan_appends("commit_ctx_batch", states, hidden_rows, positions),
                          hidden_rows)

    def committing(
        self,
        states: Sequence[DFlashState],
        hidden_rows: Tensor,
        positions: Sequence[Sequence[int] | Tensor | Iterable[int]],
    ) -> Deferred:
        """:meth:`commit_ctx_batch` whose writes into the accumulators are launched when the
        ``with`` block it opens ends, for a caller that drafts from the new rows first::

            with proposer.committing(states, rows, positions):
                drafts = proposer.propose_on_device(states, anchors, anchor_positions, k)

        Everything is checked and the core records the rows when it is called (the same
        errors, all or nothing). Inside the block a proposal reads each state's new rows from
        ``hidden_rows``; any other read of an accumulator writes them first, and a commit that
        slides a window writes at once. ``hidden_rows`` must stay unchanged until the block
        ends (on CUDA: until the work launched in it has read them).

        Raises:
            as :meth:`commit_ctx_batch`.
        """
        batch = self._plan_appends("committing", states, hidden_rows, positions)
        return self.writer.deferred(states, batch, hidden_rows)

    def _plan_appends(
        self,
        what: str,
        states: Sequence[DFlashState],
        hidden_rows: Tensor,
        positions: Sequence[Sequence[int] | Tensor | Iterable[int]],
    ) -> AppendBatch:
        """The core's checked plan of a batch commit (nothing recorded yet)."""
        ctxs = self._ctxs(states, what)
        if len(positions) != len(ctxs):
            raise ValueError(f"{len(ctxs)} states but {len(positions)} position lists")
        check_rows(hidden_rows, self.ctx_row_width, self.device)
        lists = [as_positions(p) for p in positions]
        batch = _core.plan_appends(what, ctxs, lists, self._owner)
        if batch.n_rows != hidden_rows.shape[0]:
            raise ValueError(f"{hidden_rows.shape[0]} rows but {batch.n_rows} positions in all")
        return batch

    def propose(
        self,
        st: DFlashState,
        last_token: int,
        position: int,
        num_drafts: int,
        grammar_bitmask: Tensor | Sequence[int] | None = None,
    ) -> list[int]:
        """Draft up to ``num_drafts`` tokens following ``last_token`` at ``position``.

        Args:
            st: a live state of this proposer with committed context.
            last_token: the anchor (last verified token).
            position: the anchor's position; drafts predict ``position + 1 ...``.
            num_drafts: ``1 .. B-1`` (the draft-cap lever may return fewer).
            grammar_bitmask: packed int32 allowed-token bits, ``[ceil(V/32)]`` for every draft
                or ``[num_drafts, ceil(V/32)]`` per draft; masked-out tokens are never drafted.

        Returns:
            The drafts (``min(num_drafts, draft_cap)`` tokens).

        Raises:
            InvalidStateError: a foreign or freed state, or one with no committed context.
            ValueError: bad token, position (its block past the drafter's positions too: see
                :meth:`can_draft`), ``num_drafts`` or bitmask (nothing changed).
            PoolExhaustedError: no pages for the new context K/V (nothing changed).
        """
        ctxs = self._ctxs([st], "propose")
        take = run.num_take(num_drafts, self.block_gamma, self.levers.draft_cap)
        mask = (run.bitmask(grammar_bitmask, take, self.vocab_size, self.device)
                if grammar_bitmask is not None else None)
        proposal = self._plan("propose", [st], ctxs, [last_token], [position])
        try:
            tokens = self._draft(proposal, take, mask)
        except BaseException:
            proposal.abort()
            raise
        return tokens[0]

    def propose_sampled(
        self,
        states: Sequence[DFlashState],
        last_tokens: Sequence[int],
        positions: Sequence[int],
        num_drafts: int,
        params: SamplingParams,
        generator: Generators = None,
    ) -> tuple[list[list[int]], Tensor]:
        """Drafts sampled from the drafter's distribution, for lossless rejection sampling at
        ``params.temperature > 0``: one forward over the ``n`` states (``n >= 1``, the rules of
        :meth:`propose_batch` for the arguments, but it raises instead of declining).
        ``generator``: one random source for all states, or a list of one per state (a
        state's drafts then equal those of a call for it alone with its source).

        Returns:
            ``n`` lists of ``min(num_drafts, draft_cap)`` drafts, and their distribution ``q
            [n, take, V]`` fp32 on the proposer's device (``q[i, j]``: what draft ``j`` of
            sequence ``i`` was drawn from, given the drafts before it).

        Raises:
            InvalidStateError / ValueError / PoolExhaustedError: as :meth:`propose` (nothing
                changed).
        """
        if params.greedy:
            raise ValueError("propose_sampled needs temperature > 0 (greedy drafts: propose)")
        ctxs = self._ctxs(states, "propose_sampled")
        if not ctxs or len(last_tokens) != len(ctxs) or len(positions) != len(ctxs):
            raise ValueError(
                f"propose_sampled: {len(ctxs)} states, {len(last_tokens)} tokens and "
                f"{len(positions)} positions (at least one of each, as many of each)"
            )
        take = run.num_take(num_drafts, self.block_gamma, self.levers.draft_cap)
        proposal = self._plan("propose_sampled", list(states), ctxs, last_tokens, positions)
        try:
            return run.run_sampled(self.forward, proposal, take, (params, generator))
        except BaseException:
            proposal.abort()
            raise

    def propose_batch_max(self) -> int:
        """1 without the batched path or with ``BLOCKDRAFT_DFLASH_BATCH_PROPOSE`` < 2, else that
        width capped at ``max_batch``."""
        return _core.propose_batch_max(self._batched_path, self.levers.batch_propose, self.max_batch)

    def propose_batch(
        self,
        states: Sequence[DFlashState],
        last_tokens: Sequence[int],
        positions: Sequence[int],
        num_drafts: int,
    ) -> list[list[int]] | None:
        """Draft for ``n`` sequences in one drafter forward over ``n * B`` rows.

        Returns ``None`` (never raises) to decline; the caller then uses ``propose`` per
        sequence. A declined call leaves the pool and every state as they were, except that with
        the batched precompute off, the sequences already prepared keep their (valid) ctx K/V.

        Returns:
            ``n`` lists of at most ``min(num_drafts, draft_cap)`` drafts, or ``None``.
        """
        return self._propose_many("propose_batch", states, last_tokens, positions, num_drafts,
                                  lambda proposal, take: self._draft(proposal, take, None))

    def propose_on_device(
        self,
        states: Sequence[DFlashState],
        last_tokens: Sequence[int],
        positions: Sequence[int],
        num_drafts: int,
    ) -> Tensor | None:
        """:meth:`propose_batch` (for ``n >= 1`` sequences) with the drafts left on the
        device, for a consumer there (the target's verify) to read without the host waiting
        for the drafter: ``[n, min(num_drafts, draft_cap)]`` int64 on :attr:`device`. The
        tensor may be a view of a CUDA graph's output, valid until this proposer's next
        proposal of as many sequences. ``None`` declines, as :meth:`propose_batch` does."""
        return self._propose_many("propose_on_device", states, last_tokens, positions, num_drafts,
                                  lambda proposal, take: run.run_on_device(
                                      self.forward, self._runner(None), proposal, take),
                                  one=True)

    def _propose_many(
        self,
        what: str,
        states: Sequence[DFlashState],
        last_tokens: Sequence[int],
        positions: Sequence[int],
        num_drafts: int,
        finish: Callable[[Proposal, int], _Drafted],
        *,
        one: bool = False,
    ) -> _Drafted | None:
        """The batched proposal of :meth:`propose_batch`, its drafts made by ``finish(proposal,
        take)``; ``one``: a single sequence is taken too (it needs no batched path)."""
        try:
            n = len(last_tokens)
            if one and n == 1 and len(positions) == len(states) == 1:
                reason = None
            else:
                reason = _core.batch_decline_reason(
                    n, self.max_batch, self._batched_path and self.levers.batch_propose >= 2,
                    len(positions), len(states))
        except Exception as exc:  # noqa: BLE001 - declining is the contract
            reason = f"bad arguments: {exc}"
        if reason is not None:
            log.debug("DFlash %s declined: %s", what, reason)
            return None
        proposal: Proposal | None = None
        try:
            take = run.num_take(num_drafts, self.block_gamma, self.levers.draft_cap)
            ctxs = self._ctxs(states, what)
            if n > 1 and not self.levers.batched_precompute:
                run.precompute_each(self.forward, self._plan(what, list(states), ctxs, last_tokens, positions))
            proposal = self._plan(what, list(states), ctxs, last_tokens, positions)
            return finish(proposal, take)
        except Exception as exc:  # noqa: BLE001 - declining is the contract
            if proposal is not None:
                proposal.abort()
            log.warning("DFlash %s: %s - per-sequence path", what, exc)
            return None
        except BaseException:
            if proposal is not None:
                proposal.abort()
            raise

    def draft(
        self,
        states: Sequence[DFlashState],
        anchors: Sequence[int],
        positions: Sequence[int],
        want: Sequence[int],
        masks: Sequence[Mask | None] | None = None,
        sampling: Sequence[SampledDraft | None] | None = None,
        *,
        on_device: bool = False,
    ) -> Drafts:
        """Up to ``want[i]`` drafts after ``anchors[i]`` at ``positions[i]`` for each state
        (none when ``want[i] <= 0``, or when the block would pass the drafter's positions:
        :meth:`can_draft`), made as :mod:`blockdraft.proposer.draft` describes:
        ``sampling[i]`` (settings, random source) at ``temperature > 0`` drafts by sampling;
        ``masks[i]`` drafts greedily under that grammar mask; the rest draft greedily, batched
        where :meth:`propose_batch` takes them. Batched drafts equal per-sequence ones.
        ``on_device``: when every state wants the same number of greedy drafts without a mask,
        they stay on the device (``Drafts.pending``; :meth:`propose_on_device`).

        Returns:
            :class:`~blockdraft.proposer.draft.Drafts`: a proposal that raised leaves its
            error in the sequence's slot; the other sequences are drafted.

        Raises:
            ValueError: the arguments are not one per state.
        """
        return draft_many(self, states, anchors, positions, want, masks, sampling, on_device)

    def _plan(
        self, what: str, states: list[DFlashState], ctxs: list[ContextState],
        tokens: Sequence[int], positions: Sequence[int],
    ) -> Proposal:
        return run.plan(what, states, ctxs, tokens, positions, vocab_in=self.head.vocab_in,
                        owner=self._owner, max_positions=self.spec.max_positions,
                        block_size=self.block_gamma)

    def _draft(self, proposal: Proposal, take: int, mask: Tensor | None) -> list[list[int]]:
        """:func:`blockdraft.proposer.run.run`, through the graph path where it applies."""
        return run.run(self.forward, self._runner(mask), proposal, take, mask)

    def _runner(self, mask: Tensor | None) -> GraphRunner | None:
        """The graph path for a proposal, or ``None``: paused, or a mask (which it lacks)."""
        return None if self._graphs_paused or mask is not None else self._graphs

    def after_verify(self, st: DFlashState, num_accepted: int) -> None:
        """Record the verification of the last proposal (resets ``last_num_drafted``).

        Raises:
            InvalidStateError: a state of another proposer (or kind), or a freed one.
            ValueError: more accepted than drafted.
        """
        _core.verify_all("after_verify", self._ctxs([st], "after_verify"), [num_accepted], self._owner)

    def after_verify_batch(self, states: Sequence[DFlashState], num_accepted: Sequence[int]) -> None:
        """:meth:`after_verify` for many states in one core call (a serving step's verify).

        Raises:
            InvalidStateError: a foreign or freed state (the states before it are recorded).
            TypeError / ValueError: a count that is not an int, negative, or more than the
                state's drafts; a state given twice; lengths that differ.
        """
        _core.verify_all(
            "after_verify_batch", self._ctxs(states, "after_verify_batch"), num_accepted, self._owner
        )


__all__ = ["DFlashProposer"]
