"""The DFlash proposer: drafter + target embeddings/lm_head + paged ctx K/V + the Rust core.

The Rust core (:mod:`blockdraft._core`) decides every piece of bookkeeping (which pool blocks a
sequence holds, which context rows it keeps and at which positions, how many rows have K/V in
the paged cache, whether a batch is accepted); this module owns the tensors and moves them
according to the core's plans:

* ``commit_ctx`` / ``commit_ctx_batch``: ``plan_appends`` -> accumulator copy (slide first
  when a plan says so) -> ``AppendBatch.apply``.
* ``propose`` / ``propose_batch``: ``plan_proposals`` (every anchor checked, every sequence's
  ``plan_precompute``) -> one GEMM for every layer's ctx K/V -> ``ctx_kv_store`` into the
  paged cache -> drafter ``forward_block`` attending over the paged cache -> target
  ``lm_head`` -> masked argmax -> ``confirm_proposals``. Any failure before the confirm aborts
  the plans, which gives the blocks back and leaves every state as it was.

The core's whole-step entry points (``plan_appends``, ``plan_proposals``,
``confirm_proposals``, ``verify_all``, ``GraphMeta.fill``) take every sequence of a call at
once: the per-sequence host work of a step is a few list comprehensions, not a dozen
Python-to-Rust calls (issue 6's host target).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from blockdraft import _core, faults
from blockdraft._core import (
    AppendBatch,
    BlockPool,
    ConfigError,
    ContextState,
    InvalidStateError,
    PrecomputePlan,
)
from blockdraft.graphs import GraphMode, GraphRunner, resolve_mode
from blockdraft.kernels.reference import embed_blocks
from blockdraft.levers import Levers, read_levers

log = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]

_owner_ids = itertools.count(1)
# The window-cap notice is once per process, as in the seed: it is about the serve's sizing,
# not about any one sequence.
_cap_logged = False


class _Ops:
    """The kernel launchers of :mod:`blockdraft.kernels`, pinned to one backend."""

    def __init__(self, backend: Literal["torch", "triton"]) -> None:
        from blockdraft import kernels

        self._kernels = kernels
        self.backend: Literal["torch", "triton"] = backend

    def ctx_kv_store(self, *args: Any, **kwargs: Any) -> None:
        self._kernels.ctx_kv_store(*args, backend=self.backend, **kwargs)

    def block_attention(self, *args: Any, **kwargs: Any) -> Tensor:
        out: Tensor = self._kernels.block_attention(*args, backend=self.backend, **kwargs)
        return out

    def block_inputs(self, *args: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        out: tuple[Tensor, Tensor, Tensor, Tensor] = self._kernels.block_inputs(
            *args, backend=self.backend
        )
        return out

    def masked_argmax(self, logits: Tensor, bitmask: Tensor | None) -> Tensor:
        out: Tensor = self._kernels.masked_argmax(logits, bitmask, backend=self.backend)
        return out


def _resolve_backend(backend: str, device: torch.device) -> Literal["torch", "triton"]:
    if backend not in ("auto", "torch", "triton"):
        raise ConfigError(f"backend must be 'auto', 'torch' or 'triton', not {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return "triton" if backend == "triton" else "torch"


def _target_parts(target: Any) -> tuple[Tensor, Any, int]:
    """``(embedding weight [V_in, H], lm_head, vocab size V)`` of a target model or adapter."""
    embed: Any = getattr(target, "embed_weight", None)
    if embed is None:
        get_in = getattr(target, "get_input_embeddings", None)
        if get_in is None:
            raise ConfigError("target has neither get_input_embeddings() nor embed_weight")
        embed = get_in().weight
    head = getattr(target, "lm_head", None)
    if head is None:
        get_out = getattr(target, "get_output_embeddings", None)
        head = get_out() if get_out is not None else None
    if head is None:
        raise ConfigError("target has no lm_head / output embeddings")
    weight: Any = head.weight if isinstance(head, nn.Module) else head
    return embed, head, int(weight.shape[0])


def _target_layers_hidden(target: Any) -> tuple[int | None, int | None]:
    """``(num_hidden_layers, hidden_size)`` of the target when it exposes a config."""
    cfg = getattr(target, "config", None)
    if cfg is None:
        return None, None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(text, "num_hidden_layers", None), getattr(text, "hidden_size", None)


def _cfg(config: Any, *names: str, default: Any = None) -> Any:
    """First of ``names`` present on the drafter config (field names differ across versions)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _unpack(bitmask: Tensor, vocab: int) -> Tensor:
    """Packed int32 ``[R, ceil(V/32)]`` -> ``[R, V]`` bool (bit set = allowed)."""
    ids = torch.arange(vocab, device=bitmask.device)
    return ((bitmask.to(torch.int64)[:, ids // 32] >> (ids % 32)) & 1).to(torch.bool)


class DFlashState:
    """One sequence's proposer state: core bookkeeping + accumulator + device block table.

    Attributes:
        ctx: the core's :class:`~blockdraft.ContextState` (window, positions, blocks, counters).
        acc: the context accumulator ``[window, k*H]`` (zeroed at allocation; ``None`` once
            freed).
        block_table_dev: the block table on the device ``[num_blocks]`` int32 (``None`` until
            the first propose and after free; made on access from the core's table).

    The read-only properties (``window``, ``ctx_len``, ``ctx_committed``, ``ctx_positions``,
    ``block_table``, ``seq_len``, ``prefill_done``, ``last_num_drafted``,
    ``last_num_accepted``, ``freed``, ``owner``) are the same-named getters of ``ctx``.
    """

    __slots__ = ("_addr", "_fresh", "_table", "acc", "ctx")

    def __init__(self, ctx: ContextState, acc: Tensor) -> None:
        self.ctx = ctx
        self.acc: Tensor | None = acc
        self._addr = acc.data_ptr()  # the accumulator kernel's table entry for this state
        # (first row, end row, view of acc) of the last commit: the rows a proposal usually
        # stages next (a different plan range means it does not apply).
        self._fresh: tuple[int, int, Tensor] | None = None
        # (core version, device table): the last table made by `block_table_dev`.
        self._table: tuple[int, Tensor] | None = None

    @property
    def block_table_dev(self) -> Tensor | None:
        """The block table on the device ``[num_blocks]`` int32 (``None`` before the first
        proposal and after free), made from the core's table when it changed since the last
        access: no proposal makes one per sequence."""
        # `prefill_done`: a proposal was confirmed since allocation (free resets it)
        if self.acc is None or not self.ctx.prefill_done:
            return None
        version = self.ctx.version
        if self._table is None or self._table[0] != version:
            table = torch.tensor(self.ctx.block_table, dtype=torch.int32, device=self.acc.device)
            self._table = (version, table)
        return self._table[1]

    @property
    def owner(self) -> int:
        return self.ctx.owner

    @property
    def window(self) -> int:
        return self.ctx.window

    @property
    def ctx_len(self) -> int:
        return self.ctx.ctx_len

    @property
    def ctx_committed(self) -> int:
        return self.ctx.ctx_committed

    @property
    def ctx_positions(self) -> list[int]:
        return self.ctx.ctx_positions

    @property
    def block_table(self) -> list[int]:
        return self.ctx.block_table

    @property
    def seq_len(self) -> int:
        return self.ctx.seq_len

    @property
    def prefill_done(self) -> bool:
        return self.ctx.prefill_done

    @property
    def last_num_drafted(self) -> int:
        return self.ctx.last_num_drafted

    @property
    def last_num_accepted(self) -> int:
        return self.ctx.last_num_accepted

    @property
    def freed(self) -> bool:
        return self.ctx.freed

    def __repr__(self) -> str:
        return (
            f"DFlashState(window={self.window}, ctx_len={self.ctx_len}, "
            f"ctx_committed={self.ctx_committed}, blocks={self.ctx.num_blocks}, "
            f"freed={self.freed})"
        )


@dataclass(slots=True)
class _Step:
    """One proposal over ``n`` sequences, as parallel lists: the states (and their core
    states), anchors, and the outstanding K/V plans from ``plan_proposals``."""

    states: list[DFlashState]
    ctxs: list[ContextState]
    tokens: list[int]
    positions: list[int]
    plans: list[PrecomputePlan]

    def abort(self) -> None:
        """Give back every plan's blocks (confirmed plans are ignored)."""
        _core.abort_plans(self.plans)


class DFlashProposer:
    """Drafts blocks of tokens for many sequences with a DFlash drafter (the seed's contract).

    Args:
        drafter: a loaded DFlash drafter (see ``docs/design/interfaces.md``, "Drafter").
        target: the target model (Hugging Face causal LM or blockdraft's target adapter); only
            its input embeddings and ``lm_head`` are used.
        max_seq_len: the longest sequence the target serves; with the context cap it bounds
            each state's window.
        num_blocks: paged K/V blocks in the pool. ``None`` sizes the pool to
            ``pool_memory_fraction`` of free device memory, at most what ``max_batch`` full
            windows need.
        pool_memory_fraction: fraction of free memory for the pool when ``num_blocks`` is None.
        kv_block_size: tokens per paged block.
        max_batch: the most sequences one ``propose_batch`` accepts.
        backend: "triton", "torch", or "auto" (Triton on CUDA, torch elsewhere).
        device: where the K/V cache and accumulators live (default: the drafter's device).
        dtype: K/V cache and accumulator dtype (default: the drafter's dtype).
        pool: share an existing :class:`~blockdraft.BlockPool` (its sizes win).
        batched_path: allow the batched ``propose_batch`` path at all.
        graphs: the steady-state draft forward (greedy DFlash, no grammar mask) through
            :mod:`blockdraft.graphs`: ``"auto"`` captures CUDA graphs per batch-size bucket on
            CUDA and runs the plain path elsewhere; ``"capture"``, ``"static"`` (the graph
            path's buffers, run eagerly) or ``"off"`` force one.

    Raises:
        ConfigError: a bad lever, backend or ``graphs`` mode (``"capture"`` off CUDA too), or
            a drafter that does not fit the target.
        ValueError: non-positive sizes.
    """

    def __init__(
        self,
        drafter: Any,
        target: Any,
        *,
        max_seq_len: int,
        num_blocks: int | None = None,
        pool_memory_fraction: float = 0.25,
        kv_block_size: int = 16,
        max_batch: int = 16,
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        pool: BlockPool | None = None,
        batched_path: bool = True,
        graphs: GraphMode = "auto",
    ) -> None:
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, not {max_seq_len}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, not {max_batch}")
        if kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, not {kv_block_size}")
        if not 0.0 < pool_memory_fraction <= 1.0:
            raise ValueError(f"pool_memory_fraction must be in (0, 1], not {pool_memory_fraction}")
        self.levers: Levers = read_levers()
        self.drafter = drafter
        self.target = target
        cfg = drafter.config
        self.config = cfg
        first = next(iter(drafter.parameters()), None) if hasattr(drafter, "parameters") else None
        self.device = torch.device(
            device if device is not None else (first.device if first is not None else "cpu")
        )
        self.dtype = dtype if dtype is not None else (first.dtype if first is not None else torch.float32)
        self._device_type = self.device.type
        self.backend = _resolve_backend(backend, self.device)
        self._ops = _Ops(self.backend)

        self.hidden_size = int(_cfg(cfg, "hidden_size"))
        self.num_layers = int(_cfg(cfg, "num_layers", "num_hidden_layers"))
        self.num_kv_heads = int(_cfg(cfg, "num_kv_heads", "num_key_value_heads"))
        self.num_heads = int(_cfg(cfg, "num_heads", "num_attention_heads"))
        self.head_dim = int(_cfg(cfg, "head_dim", default=self.hidden_size // self.num_heads))
        self.gamma = int(_cfg(cfg, "block_size"))
        self.target_layer_ids = list(_cfg(cfg, "target_layer_ids"))
        mask = _cfg(cfg, "mask_token_id")
        if mask is None:
            raise ConfigError("the drafter config has no mask_token_id")
        self.mask_token_id = int(mask)
        self.eps = float(_cfg(cfg, "rms_norm_eps", default=1e-6))
        if self.gamma < 2:
            raise ConfigError(f"the drafter's block_size must be >= 2, not {self.gamma}")

        self._embed, self._lm_head, self.vocab_size = _target_parts(target)
        self._vocab_in = int(self._embed.shape[0])  # ids the embedding table takes
        t_layers, t_hidden = _target_layers_hidden(target)
        if int(self._embed.shape[1]) != self.hidden_size or (
            t_hidden is not None and t_hidden != self.hidden_size
        ):
            raise ConfigError(
                f"drafter hidden size {self.hidden_size} does not match the target's "
                f"{int(self._embed.shape[1])}"
            )
        if t_layers is not None and any(
            i < 0 or i >= t_layers for i in self.target_layer_ids
        ):
            raise ConfigError(
                f"drafter target_layer_ids {self.target_layer_ids} are outside the target's "
                f"{t_layers} layers"
            )
        if not 0 <= self.mask_token_id < int(self._embed.shape[0]):
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} is outside the target's embedding table "
                f"({int(self._embed.shape[0])} rows)"
            )

        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self._batched_path = batched_path
        self.ceiling = _core.ctx_ceiling(max_seq_len, self.levers.ctx_cap)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.ctx_row_width = len(self.target_layer_ids) * self.hidden_size
        self.ctx_slot_bytes = self.ctx_row_width * elem

        if pool is None:
            if num_blocks is None:
                num_blocks = self._default_num_blocks(kv_block_size, pool_memory_fraction, elem)
            pool = BlockPool(num_blocks, kv_block_size)
        self.pool = pool
        self.kv_block_size = pool.block_size
        shape = (
            self.num_layers,
            pool.num_blocks,
            pool.block_size,
            self.num_kv_heads,
            self.head_dim,
        )
        # One paged K/V tensor per drafter layer (views of one allocation each for K and V).
        self._k_all = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._v_all = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # Plain select views: unbind() views refuse in-place writes.
        self.k_cache: list[Tensor] = [self._k_all[i] for i in range(self.num_layers)]
        self.v_cache: list[Tensor] = [self._v_all[i] for i in range(self.num_layers)]
        self.slot_pos = torch.full(
            (pool.num_blocks * pool.block_size,), -1, dtype=torch.int32, device=self.device
        )
        self._owner = next(_owner_ids)

        self._kv_weight: Tensor = drafter.ctx_kv_weight()
        bias_fn = getattr(drafter, "ctx_kv_bias", None)
        self._kv_bias: Tensor | None = bias_fn() if bias_fn is not None else None
        # DFlash2 picks drafts with its candidate selector (drafter.draft), DFlash by argmax.
        self._selector = bool(getattr(cfg, "is_dflash2", False))
        self._k_norm_w: Tensor = drafter.k_norm_weights()
        rope = drafter.rope
        self._inv_freq: Tensor = rope.inv_freq.to(device=self.device, dtype=torch.float32)
        self._rope_scale = float(getattr(rope, "attention_scaling", 1.0))
        self._scale = float(_cfg(cfg, "attn_scale", default=self.head_dim**-0.5))
        self._layer_window, self._layer_causal = self._layer_attention_kinds()
        graph_mode = resolve_mode(graphs, self.device)
        self._graphs: GraphRunner | None = (
            GraphRunner(self, graph_mode) if graph_mode is not None else None
        )

    # ------------------------------------------------------------------ set-up helpers

    def _default_num_blocks(self, block_size: int, fraction: float, elem: int) -> int:
        per_block = (
            2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem + 4 * block_size
        )
        want = self.max_batch * math.ceil(self.ceiling / block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            try:
                free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError):
                free = 1 << 30
        fits = int(free * fraction) // per_block
        if fits < 1:
            raise ConfigError(
                f"pool_memory_fraction={fraction} of {free} free bytes holds no K/V block "
                f"({per_block} bytes each)"
            )
        return max(1, min(want, fits))

    def _layer_attention_kinds(self) -> tuple[list[int | None], list[bool]]:
        """Per drafter layer: sliding window (``None`` = full) and whether the block is causal."""
        cfg = self.config
        if hasattr(cfg, "layer_sliding_window") and hasattr(cfg, "layer_is_causal"):
            return (
                [cfg.layer_sliding_window(i) for i in range(self.num_layers)],
                [bool(cfg.layer_is_causal(i)) for i in range(self.num_layers)],
            )
        types = _cfg(cfg, "layer_types")
        is_causal = getattr(cfg, "is_causal", None)
        windows: list[int | None] = []
        causal: list[bool] = []
        for layer in range(self.num_layers):
            kind = types[layer] if types else "full_attention"
            sliding = kind == "sliding_attention"
            windows.append(int(cfg.sliding_window) if sliding else None)
            causal.append(sliding if is_causal is None else bool(is_causal))
        return windows, causal

    # ------------------------------------------------------------------ the contract

    @property
    def block_gamma(self) -> int:
        """The drafter's block size B (anchor + B-1 drafts)."""
        return self.gamma

    @property
    def owner_id(self) -> int:
        """Tag carried by every state this proposer makes."""
        return self._owner

    def alloc_state(self) -> DFlashState:
        """A fresh state whose window is the ceiling (``max_seq_len`` bounded by the cap)."""
        return self._alloc(None)

    def alloc_state_for(self, budget_tokens: int) -> DFlashState:
        """A fresh state whose window is ``min(ceiling, budget_tokens + B + 1)``.

        Args:
            budget_tokens: prompt plus max new tokens (>= 0).

        Raises:
            ValueError: a negative budget.
        """
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int):
            raise TypeError(f"budget_tokens must be an int, not {type(budget_tokens).__name__}")
        if budget_tokens < 0:
            raise ValueError(f"budget_tokens must be >= 0, not {budget_tokens}")
        return self._alloc(budget_tokens)

    def _alloc(self, budget: int | None) -> DFlashState:
        global _cap_logged
        window = _core.ctx_window(self.max_seq_len, self.gamma, budget, self.levers.ctx_cap)
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
        if faults._ACTIVE is not None:
            faults.hit("accumulator")
        acc = torch.zeros((window, self.ctx_row_width), dtype=self.dtype, device=self.device)
        return DFlashState(ContextState(self.pool, window, self._owner), acc)

    def _own(self, st: object, what: str) -> DFlashState:
        if not isinstance(st, DFlashState):
            raise InvalidStateError(f"{what}: not a DFlash proposer state ({type(st).__name__})")
        if st.ctx.owner != self._owner:
            raise InvalidStateError(f"{what}: the state belongs to another proposer")
        return st

    def _live(self, st: object, what: str) -> DFlashState:
        own = self._own(st, what)
        if own.acc is None or own.ctx.freed:
            raise InvalidStateError(f"{what}: the state was freed")
        return own

    def commit_ctx(self, st: DFlashState, hidden_rows: Tensor, positions: Sequence[int] | Tensor) -> None:
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
        state = self._live(st, "commit_ctx")
        self._check_rows(hidden_rows)
        pos = self._positions(positions)
        if len(pos) != hidden_rows.shape[0]:
            raise ValueError(f"{hidden_rows.shape[0]} rows but {len(pos)} positions")
        if not len(pos):
            raise ValueError("positions must not be empty")
        batch = _core.plan_appends("commit_ctx", [state.ctx], [pos], self._owner)
        self._write_rows([state], batch, hidden_rows)

    def commit_ctx_batch(
        self,
        states: Sequence[DFlashState],
        hidden_rows: Tensor,
        positions: Sequence[Sequence[int] | Tensor],
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
        ctxs = self._ctxs(states, "commit_ctx_batch")
        if len(positions) != len(ctxs):
            raise ValueError(f"{len(ctxs)} states but {len(positions)} position lists")
        self._check_rows(hidden_rows)
        lists = [self._positions(p) for p in positions]
        batch = _core.plan_appends("commit_ctx_batch", ctxs, lists, self._owner)
        if batch.n_rows != hidden_rows.shape[0]:
            raise ValueError(f"{hidden_rows.shape[0]} rows but {batch.n_rows} positions in all")
        self._write_rows(states, batch, hidden_rows)

    def _write_rows(self, states: Sequence[DFlashState], batch: AppendBatch, hidden_rows: Tensor) -> None:
        """Carry out a checked ``AppendBatch``: the slides, the rows into the accumulators, then
        record it in the core. Every allocation (the rows in the accumulators' dtype, each
        slide's copy of the rows it keeps, the kernel's table) happens before an accumulator is
        touched: a failure (device OOM) leaves every accumulator as it was, since the core
        still describes the old layout.

        A state written by a copy keeps the view of its new rows (``_fresh``): the graph path
        stages exactly those rows at the next proposal in the common case, and a view of
        ``acc`` by row range stays right for that range for as long as the accumulator
        lives."""
        if faults._ACTIVE is not None:
            faults.hit("accumulator")
        entries = batch.entries  # (state index, src row, dst row, count) per state with rows
        if not entries:
            return
        accs: list[Tensor] = [states[e[0]].acc for e in entries]  # type: ignore[misc]
        new_rows = self._detached_rows(hidden_rows, accs[0])
        slides = batch.slides
        moves = self._prepare_slides(slides, accs) if slides else []
        # One kernel launch takes many sequences' rows as they are when no state's rows were
        # cut (so they lie in order, back to back) and they are a step's few per sequence (the
        # steady state: up to B); one sequence, bigger commits (prefills) and the torch backend
        # copy per sequence.
        n = len(entries)
        if self.backend == "triton" and 1 < n and batch.n_rows == batch.kept <= self.gamma * n:
            from blockdraft.kernels.accumulator import acc_append_mapped, append_table

            rows = new_rows.contiguous()
            table = append_table([states[e[0]]._addr for e in entries], batch.row_map(), rows.device)
            for acc, keep, kept in moves:
                acc[:keep] = kept
            acc_append_mapped(rows, table)
        else:
            for acc, keep, kept in moves:
                acc[:keep] = kept
            whole = new_rows.shape[0]
            for (i, src, dst, count), acc in zip(entries, accs):
                rows = acc[dst : dst + count]
                rows.copy_(new_rows if count == whole else new_rows[src : src + count])
                states[i]._fresh = (dst, dst + count, rows)
        batch.apply()

    @staticmethod
    def _prepare_slides(
        slides: list[tuple[int, int, int]], accs: list[Tensor]
    ) -> list[tuple[Tensor, int, Tensor]]:
        """An ``AppendBatch``'s slides (``accs``: per entry its accumulator) made ready without
        touching any accumulator: per slide the accumulator, the number of rows it keeps and a
        copy of them (a fault point each: the copy is an allocation). Writing them is
        ``acc[:keep] = copy``."""
        out = []
        for e, src, keep in slides:
            if faults._ACTIVE is not None:
                faults.hit("accumulator")
            acc = accs[e]
            out.append((acc, keep, acc[src : src + keep].clone()))
        return out

    def _ctxs(self, states: Sequence[object], what: str) -> list[ContextState]:
        """The core states of ``states`` (the core checks their owner, liveness and that none
        repeats); a non-state raises ``InvalidStateError``."""
        ctxs = [st.ctx for st in states if type(st) is DFlashState]
        if len(ctxs) != len(states):
            ctxs = [self._own(st, what).ctx for st in states]
        return ctxs

    def _check_rows(self, hidden_rows: object) -> None:
        """``hidden_rows`` must be a floating ``[R, k*H]`` tensor on the proposer's device type."""
        if not isinstance(hidden_rows, Tensor):
            raise TypeError(f"hidden_rows must be a torch.Tensor, not {type(hidden_rows).__name__}")
        if not hidden_rows.is_floating_point():
            raise TypeError(f"hidden_rows must be floating point, not {hidden_rows.dtype}")
        if hidden_rows.dim() != 2 or hidden_rows.shape[1] != self.ctx_row_width:
            raise ValueError(
                f"hidden_rows must be [R, {self.ctx_row_width}] (k*H), not {list(hidden_rows.shape)}"
            )
        if hidden_rows.device.type != self._device_type:
            raise ValueError(
                f"hidden_rows are on {hidden_rows.device}, the proposer on {self.device}"
            )

    @staticmethod
    def _positions(positions: Sequence[int] | Tensor) -> Sequence[int]:
        """Positions as the core takes them: a list, tuple or range as it is, a tensor as its
        list, any other iterable listed (the core checks the ints: a float position is never
        rounded)."""
        if isinstance(positions, (list, tuple, range)):
            return positions
        if isinstance(positions, Tensor):
            out: list[int] = positions.tolist()
            return out
        try:
            return list(positions)
        except TypeError:
            raise TypeError(
                f"positions must be a sequence of ints, not {type(positions).__name__}"
            ) from None

    @staticmethod
    def _detached_rows(hidden_rows: Tensor, acc: Tensor) -> Tensor:
        """The rows in ``acc``'s dtype and on its device, out of autograd (a ``no_grad``
        context would cost µs per call)."""
        if hidden_rows.requires_grad:
            hidden_rows = hidden_rows.detach()
        return hidden_rows.to(device=acc.device, dtype=acc.dtype)

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
            st: a live state of this proposer.
            last_token: the anchor (last verified token).
            position: the anchor's position; drafts predict ``position + 1 ...``.
            num_drafts: ``1 .. B-1`` (the draft-cap lever may return fewer).
            grammar_bitmask: packed int32 allowed-token bits, ``[ceil(V/32)]`` for every draft
                or ``[num_drafts, ceil(V/32)]`` per draft; masked-out tokens are never drafted.

        Returns:
            The drafts (``min(num_drafts, draft_cap)`` tokens).

        Raises:
            InvalidStateError: a foreign or freed state.
            ValueError: bad token, position, ``num_drafts`` or bitmask (nothing changed).
            PoolExhaustedError: no blocks for the new context K/V (nothing changed).
        """
        state = self._own(st, "propose")
        self._check_num_drafts(num_drafts)
        take = self._num_take(num_drafts)
        mask = self._bitmask(grammar_bitmask, take) if grammar_bitmask is not None else None
        step = self._plan_step("propose", [state], [state.ctx], [last_token], [position])
        try:
            tokens = self._draft(step, take, mask)
        except BaseException:
            step.abort()
            raise
        return tokens[0]

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
        try:
            n = len(last_tokens)
            reason = _core.batch_decline_reason(
                n,
                self.max_batch,
                self._batched_path and self.levers.batch_propose >= 2,
                len(positions),
                len(states),
            )
        except Exception as exc:  # noqa: BLE001 - declining is the contract
            reason = f"bad arguments: {exc}"
        if reason is not None:
            log.debug("DFlash propose_batch declined: %s", reason)
            return None
        step: _Step | None = None
        try:
            self._check_num_drafts(num_drafts)
            take = self._num_take(num_drafts)
            ctxs = self._ctxs(states, "propose_batch")
            if not self.levers.batched_precompute:
                self._precompute_each(states, ctxs, last_tokens, positions)
            step = self._plan_step("propose_batch", list(states), ctxs, last_tokens, positions)
            return self._draft(step, take, None)
        except Exception as exc:  # noqa: BLE001 - declining is the contract
            if step is not None:
                step.abort()
            log.warning("DFlash batched propose: %s - per-sequence path", exc)
            return None
        except BaseException:
            if step is not None:
                step.abort()
            raise

    def _plan_step(
        self,
        what: str,
        states: list[DFlashState],
        ctxs: list[ContextState],
        tokens: Sequence[int],
        positions: Sequence[int],
    ) -> _Step:
        """Check every anchor and plan every sequence's ctx K/V (all or nothing: on an error
        no plan is outstanding)."""
        fail_at = faults.hits("pool_blocks", len(ctxs)) if faults._ACTIVE is not None else None
        plans = _core.plan_proposals(
            what, ctxs, tokens, positions, self._vocab_in, self._owner, fail_at
        )
        return _Step(states, ctxs, list(tokens), list(positions), plans)

    def _precompute_each(
        self,
        states: Sequence[DFlashState],
        ctxs: list[ContextState],
        tokens: Sequence[int],
        positions: Sequence[int],
    ) -> None:
        """The batched precompute lever off: once every anchor is checked and every plan made,
        each sequence's ctx K/V is stored (one GEMM each) and its plan confirmed by itself, so a
        failure part way leaves the sequences before it with valid K/V (the draft then plans
        again: empty plans for them)."""
        step = self._plan_step("propose_batch", list(states), ctxs, tokens, positions)
        try:
            for st, plan in zip(step.states, step.plans):
                self._store_ctx_kv([(st, plan)])
                st.ctx.confirm_precompute(plan)
        except BaseException:
            step.abort()
            raise

    def after_verify(self, st: DFlashState, num_accepted: int) -> None:
        """Record the verification of the last proposal (resets ``last_num_drafted``).

        Raises:
            InvalidStateError: a state of another proposer (or kind), or a freed one.
            ValueError: more accepted than drafted.
        """
        state = self._own(st, "after_verify")
        state.ctx.after_verify(int(num_accepted))

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

    def free_state(self, st: object) -> None:
        """Give back every block and the accumulator; reset every counter. Idempotent.

        A state of another kind is ignored; a DFlash state of another proposer is an error.
        """
        if not isinstance(st, DFlashState):
            return
        state = self._own(st, "free_state")
        state.ctx.free()
        state.acc = None
        state._fresh = None
        state._table = None

    # ------------------------------------------------------------------ internals

    def _check_num_drafts(self, num_drafts: int) -> None:
        if isinstance(num_drafts, bool) or not isinstance(num_drafts, int):
            raise TypeError(f"num_drafts must be an int, not {type(num_drafts).__name__}")
        if not 1 <= num_drafts <= self.gamma - 1:
            raise ValueError(f"num_drafts must be in 1..{self.gamma - 1}, not {num_drafts}")

    def _num_take(self, num_drafts: int) -> int:
        cap = self.levers.draft_cap
        return num_drafts if cap is None else min(num_drafts, cap)

    def _bitmask(self, mask: Tensor | Sequence[int], rows: int) -> Tensor:
        words = (self.vocab_size + 31) // 32
        t = mask if isinstance(mask, Tensor) else torch.tensor(list(mask), dtype=torch.int64)
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"grammar_bitmask must hold packed int32 words, not {t.dtype}")
        if t.dtype != torch.int32:
            # Accept unsigned-looking words (bit 31 set) given as Python ints.
            t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
        if t.dim() == 1:
            t = t.unsqueeze(0).expand(rows, -1)
        if t.dim() != 2 or t.shape[1] != words or t.shape[0] < rows:
            raise ValueError(
                f"grammar_bitmask must be [{words}] or [{rows}, {words}] packed int32, "
                f"not {list(t.shape)}"
            )
        return t[:rows].to(self.device).contiguous()

    @torch.no_grad()
    def _store_ctx_kv(self, items: Sequence[tuple[DFlashState, PrecomputePlan]]) -> None:
        """One GEMM for every layer's K/V of all the plans' rows, then the paged store."""
        rows: list[Tensor] = []
        positions: list[int] = []
        slots: list[int] = []
        for state, plan in items:
            if plan.row_end > plan.row_start:
                assert state.acc is not None
                rows.append(state.acc[plan.row_start : plan.row_end])
                positions.extend(plan.positions)
                slots.extend(plan.slots)
        if not rows:
            return
        ctx = torch.cat(rows, 0) if len(rows) > 1 else rows[0]
        if faults._ACTIVE is not None:
            faults.hit("kv_cache")
        self._write_ctx_kv(
            ctx.to(self.dtype),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            torch.tensor(slots, dtype=torch.int64, device=self.device),
            self.drafter.fuse_context,
        )

    def _write_ctx_kv(
        self, ctx: Tensor, positions: Tensor, slots: Tensor, fuse: Callable[[Tensor], Tensor]
    ) -> None:
        """ctx rows ``[R, k*H]`` -> ``fuse`` (fc + hidden_norm) -> one GEMM for every layer's
        K/V -> the paged store of all layers in one launch (``PAD_SLOT`` rows skipped)."""
        kv = F.linear(fuse(ctx), self._kv_weight, self._kv_bias).view(
            -1, self.num_layers, 2, self.num_kv_heads, self.head_dim
        )
        self._ops.ctx_kv_store(
            kv,
            positions,
            slots,
            self._k_norm_w,
            self._inv_freq,
            self._rope_scale,
            self.eps,
            self._k_all,
            self._v_all,
            self.slot_pos,
        )

    def _block_inputs(self, anchors: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        """Anchors and start positions ``[n]`` -> the blocks ``[anchor, MASK x (B-1)]`` embedded
        with the target's table ``[n, B, H]`` and their positions ``[n, B]``. Raw target
        embeddings: ``forward_block`` applies ``input_embedding_scale`` itself."""
        return embed_blocks(anchors, starts, self._embed, self.mask_token_id, self.gamma, self.dtype)

    def _paged_attend(
        self, block_tables: Tensor, ctx_lens: Tensor, q_pos: Tensor, *, fault_hooks: bool = True
    ) -> Callable[[int, Tensor, Tensor, Tensor], Tensor]:
        """The drafter's ``attend``: block queries over each sequence's paged ctx K/V plus the
        block's own K/V. ``fault_hooks=False`` for code captured in a CUDA graph, where a hook
        would only run at capture time."""

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if fault_hooks and faults._ACTIVE is not None:
                faults.hit("attention")
            return self._ops.block_attention(
                q,
                k,
                v,
                self.k_cache[layer],
                self.v_cache[layer],
                block_tables,
                ctx_lens,
                q_pos,
                self.slot_pos,
                scale=self._scale,
                sliding_window=self._layer_window[layer],
                causal_block=self._layer_causal[layer],
            )

        return attend

    def _split_bands(self, band: list[int], n: int, take: int) -> list[list[int]]:
        """``n`` rows of ``[anchor, take drafts]`` (flattened) -> each row's drafts."""
        bands = _core.split_bands(band, n, take + 1, True, take)
        if bands is None:
            raise RuntimeError(f"the drafter forward returned fewer than {n * self.gamma} rows")
        return bands

    def _graph_bands(self, step: _Step, got: Tensor, take: int) -> list[list[int]]:
        """Each sequence's drafts from the graph path's ``got`` [n, B-1] (its rows are the
        drafts already: no anchor column, no mask); confirms the plans.

        The plans are confirmed while the replay runs, before ``tolist`` waits for it: the
        K/V is stored by work already launched, and every host-side failure point lies
        before the launch. (A CUDA error surfacing at the wait leaves the plans confirmed;
        the device context is unusable after one anyway, and aborting a confirmed plan is a
        no-op.) At n = 32 this takes the confirms off the call's critical path."""
        n = len(step.plans)
        if got.shape[0] != n:
            raise RuntimeError(f"the graph path returned {got.shape[0]} rows for {n} sequences")
        self._confirm(step, take)
        rows: list[list[int]] = (got if take == got.shape[1] else got[:, :take]).tolist()
        return rows

    @staticmethod
    def _confirm(step: _Step, counts: int | Sequence[int]) -> None:
        """The drafts exist: confirm every plan (their K/V is stored) and note each proposal
        (its anchor position; ``counts[i]`` drafts, or ``counts`` for every sequence)."""
        _core.confirm_proposals(step.plans, step.positions, counts)

    def _draft(self, step: _Step, take: int, mask: Tensor | None) -> list[list[int]]:
        """See :meth:`_draft_nograd`; enters ``no_grad`` only when gradients are on (callers
        such as the engine already run under ``inference_mode``: the context costs µs)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._draft_nograd(step, take, mask)
        return self._draft_nograd(step, take, mask)

    def _draft_nograd(
        self, step: _Step, take: int, mask: Tensor | None
    ) -> list[list[int]]:
        """Store outstanding ctx K/V, run one drafter forward, pick drafts, confirm the plans.

        Returns ``len(step.plans)`` lists of ``take`` drafts. Raises on any failure with every plan
        still outstanding (the caller aborts them).
        """
        runner = self._graphs
        n = len(step.plans)
        if runner is not None and mask is None and not self._selector and runner.accepts(n):
            # The graph path stores the outstanding ctx K/V itself (inside the graph when every
            # plan has at most B rows); None means it stored nothing.
            got = runner.draft(step)
            if got is not None:
                return self._graph_bands(step, got, take)
        self._store_ctx_kv(list(zip(step.states, step.plans)))
        tables = [ctx.block_table + plan.new_blocks for ctx, plan in zip(step.ctxs, step.plans)]
        width = max(1, max(len(t) for t in tables))
        if faults._ACTIVE is not None:
            faults.hit("block_table_dev")
        block_tables = torch.zeros((n, width), dtype=torch.int32)
        for i, t in enumerate(tables):
            if t:
                block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        block_tables = block_tables.to(self.device)
        ctx_lens = torch.tensor(
            [plan.row_end for plan in step.plans], dtype=torch.int32, device=self.device
        )
        anchors = torch.tensor(step.tokens, dtype=torch.int64, device=self.device)
        starts = torch.tensor(step.positions, dtype=torch.int64, device=self.device)
        embeds, q_pos = self._block_inputs(anchors, starts)
        attend = self._paged_attend(block_tables, ctx_lens, q_pos)
        if faults._ACTIVE is not None:
            faults.hit("forward")
        hidden = self.drafter.forward_block(embeds, q_pos, attend)  # [n, B, H]
        if faults._ACTIVE is not None:
            faults.hit("logits")
        if self._selector:
            # The selector walks all B-1 rows left to right; keep the first `take`.
            picked = self.drafter.draft(hidden[:, 1:], anchors, self._lm_head).tokens[:, :take]
            if mask is not None:
                allowed = _unpack(mask, self.vocab_size).gather(1, picked[0][:, None])[:, 0]
                # A disallowed draft ends the band: later drafts would condition on it.
                picked = torch.where(allowed.to(torch.int64).cumprod(0).bool()[None], picked, -1)
        else:
            rows = hidden[:, 1 : 1 + take].reshape(n * take, self.hidden_size)
            logits = self.drafter.logits(rows, self._lm_head)  # [n*take, V]
            bits = mask.repeat(n, 1) if mask is not None else None
            picked = self._ops.masked_argmax(logits, bits).view(n, take)
        # Row 0 (the anchor) is never a draft; the core's band split drops it.
        band = torch.cat([anchors[:, None], picked], 1).reshape(-1).tolist()
        bands = self._split_bands(band, n, take)
        # A row with no allowed token (-1 from masked_argmax) ends that sequence's drafts.
        bands = [d[: d.index(-1)] if -1 in d else d for d in bands]
        self._confirm(step, [len(d) for d in bands])
        return bands
