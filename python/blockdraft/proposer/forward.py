"""The draft forward: one proposal's device work, from the paged context to the drafts.

Steps, each a public method so that the plain path (:meth:`DraftForward.run`) and the graph
runner (:mod:`blockdraft.proposer.graphs`, which replays the same steps over static buffers)
compose the same pieces:

1. :meth:`~DraftForward.store_plans` / :meth:`~DraftForward.write_ctx_kv`: the ctx rows of the
   outstanding plans -> ``fc`` + ``hidden_norm`` -> one GEMM for every layer's K/V -> the paged
   store (``k_norm`` + RoPE) of all layers in one launch; :meth:`~DraftForward.store_long_plans`
   does the same for plans too long for a graph's staging (a prefill, the recompute after a
   window slide) through the graph path's fused steps, in launches of a few fixed sizes;
2. :meth:`~DraftForward.embed_blocks` (or :meth:`~DraftForward.block_inputs` from the graph
   metadata): ``[anchor, MASK x (B-1)]`` embedded with the target's table, and positions;
3. :meth:`~DraftForward.layers` with :meth:`~DraftForward.attention`: the drafter layers, each
   attending over the sequence's paged ctx K/V plus the block's own K/V;
4. :meth:`~DraftForward.pick`: the target ``lm_head`` and the drafts (masked argmax, or
   DFlash2's candidate selector).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from blockdraft import faults
from blockdraft._core import PAD_SLOT, PrecomputePlan
from blockdraft.kernels import KernelOps
from blockdraft.kernels.projections import Projections
from blockdraft.kv_cache import PagedKVCache
from blockdraft.levers import read_skinny_gemm
from blockdraft.models.drafter import AttendFn, DFlashDrafter
from blockdraft.models.layers import CandidateSelector, embed_blocks
from blockdraft.proposer.fast import FastDrafter
from blockdraft.proposer.spec import DraftSpec
from blockdraft.proposer.state import DFlashState, Proposal
from blockdraft.sampling import SamplingParams, allowed_ids, sample_rows, target_probs
from blockdraft.target import TargetHead

Generators = torch.Generator | Sequence[torch.Generator | None] | None
"""A random source for all sequences of a call, or one per sequence."""


def _single(generator: Generators) -> torch.Generator | None:
    assert generator is None or isinstance(generator, torch.Generator)
    return generator


def gumbel(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    """Gumbel(0, 1) draws ``shape`` fp32 on ``device``, from ``generator`` on its own device
    (a host generator gives the same stream wherever the rows live)."""
    where = generator.device if generator is not None else device
    u = torch.rand(shape, generator=generator, device=where)
    # u = 0 gives -inf (never chosen), not NaN
    return (-torch.log(-torch.log(u))).to(device)


LONG_STORE_SIZES = (64, 128, 256, 512, 1024)
"""Rows per launch of :meth:`DraftForward.store_long_plans`: full launches of the largest size,
the rest padded up to the smallest size that holds it. Fixed sizes, all multiples of 16 (Triton
specialises integer arguments on being 1 or a multiple of 16): a plan of any length compiles no
kernel variant of its own. The padding, which goes through the GEMMs for nothing, is under half
of the last launch (at most 511 rows) and under 64 rows for a rest of up to 64."""


def launch_sizes(rows: int, sizes: Sequence[int] = LONG_STORE_SIZES) -> list[int]:
    """The launch sizes (ascending ``sizes``) that store ``rows`` rows: as many of the largest
    as fit whole, then the smallest that holds what is left (none when nothing is)."""
    top = sizes[-1]
    out = [top] * (rows // top)
    rest = rows - top * len(out)
    if rest:
        out.append(next(s for s in sizes if s >= rest))
    return out


def _segments(lengths: Sequence[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """``(piece, first row, end row)`` of the pieces of ``lengths`` rows, laid back to back,
    that hold rows ``[start, end)``."""
    out: list[tuple[int, int, int]] = []
    base = 0
    for i, n in enumerate(lengths):
        lo, hi = max(start, base), min(end, base + n)
        if lo < hi:
            out.append((i, lo - base, hi - base))
        base += n
    return out


class DraftForward:
    """The draft forward of one proposer (its drafter, target head, paged cache and kernels).

    Args:
        drafter: the DFlash / DFlash2 drafter (its ``forward_block``, ``fuse_context``,
            ``logits`` and, for DFlash2, ``candidate_selector``).
        spec / head: what the proposer read from the drafter and the target.
        cache: the paged ctx K/V the store writes and the attention reads.
        ops: the kernels of the proposer's backend.
        dtype / device: of the cache and the accumulators.
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        spec: DraftSpec,
        head: TargetHead,
        cache: PagedKVCache,
        ops: KernelOps,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.drafter = drafter
        self.spec = spec
        self.head = head
        if cache.slot_pos is None:
            raise ValueError("the draft forward needs a cache with slot_pos (sliding-window "
                             "layers read each slot's position)")
        self.cache = cache
        self.slot_pos: Tensor = cache.slot_pos
        """The cache's ``slot_pos``."""
        self.ops = ops
        # The fused view's projections: the weight-streaming GEMMs where the lever allows
        # (read here, so a bad value fails when the proposer is built).
        self.proj = Projections(ops, read_skinny_gemm())
        self.dtype = dtype
        self.device = device
        self._kv_weight = drafter.ctx_kv_weight()
        self._kv_bias = drafter.ctx_kv_bias()
        self._k_norm_w = drafter.k_norm_weights()
        self._inv_freq = drafter.rope.inv_freq.to(device=device, dtype=torch.float32)
        self._rope_scale = float(drafter.rope.attention_scaling)
        self._fused: FastDrafter | None = None
        self._fused_made = False
        self.last_q: Tensor | None = None
        """The draft distribution ``[n, take, V]`` of the last sampled :meth:`run`."""

    # 1. ctx K/V

    def write_ctx_kv(
        self, ctx: Tensor, positions: Tensor, slots: Tensor, *, fused: bool = False
    ) -> None:
        """ctx rows ``[R, k*H]`` at ``positions`` / ``slots`` ``[R]`` int64 -> fc + hidden_norm
        (the fused view's with ``fused``) -> one GEMM for every layer's K/V -> the paged store
        of all layers in one launch (``PAD_SLOT`` rows skipped)."""
        view = self.fused_view() if fused else None
        fuse = view.fuse_context if view is not None else self.drafter.fuse_context
        spec = self.spec
        kv = F.linear(fuse(ctx), self._kv_weight, self._kv_bias).view(
            -1, spec.num_layers, 2, spec.num_kv_heads, spec.head_dim
        )
        c = self.cache
        self.ops.ctx_kv_store(
            kv, positions, slots, self._k_norm_w, self._inv_freq, self._rope_scale, spec.eps,
            c.k, c.v, self.slot_pos,
        )

    @torch.no_grad()
    def store_plans(self, items: Sequence[tuple[DFlashState, PrecomputePlan]]) -> None:
        """The K/V of every plan's rows ``[row_start, row_end)`` (of its state's accumulator)
        into the plan's slots: one GEMM and one store launch for all of them."""
        rows, positions, slots = _plan_rows(items)
        if not rows:
            return
        ctx = torch.cat(rows, 0) if len(rows) > 1 else rows[0]
        if faults.active():
            faults.hit("kv_cache")
        self.write_ctx_kv(
            ctx.to(self.dtype),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            torch.tensor(slots, dtype=torch.int64, device=self.device),
        )

    @torch.no_grad()
    def store_long_plans(
        self,
        items: Sequence[tuple[DFlashState, PrecomputePlan]],
        sizes: Sequence[int] = LONG_STORE_SIZES,
    ) -> None:
        """:meth:`store_plans` through the fused steps the graph path stores with
        (``write_ctx_kv(fused=True)``), in launches of the fixed ``sizes`` (see
        :data:`LONG_STORE_SIZES`): the rows of all plans, back to back, are cut into launches;
        padding rows get slot ``PAD_SLOT`` and are not stored. A launch inside one accumulator
        reads it in place; one that spans plans or ends in padding is gathered first."""
        pieces, positions, slots = _plan_rows(items)
        total = len(positions)
        if not total:
            return
        if faults.active():
            faults.hit("kv_cache")
        plan_sizes = launch_sizes(total, sizes)
        padded = sum(plan_sizes)
        pad = padded - total
        pos_dev = torch.tensor(positions + [0] * pad, dtype=torch.int64, device=self.device)
        slot_dev = torch.tensor(slots + [PAD_SLOT] * pad, dtype=torch.int64, device=self.device)
        lengths = [p.shape[0] for p in pieces]
        gather: Tensor | None = None
        start = 0  # the launch's first row, counted over all plans' rows back to back
        for size in plan_sizes:
            segs = _segments(lengths, start, min(start + size, total))
            i, lo, hi = segs[0]
            if len(segs) == 1 and hi - lo == size:
                ctx = pieces[i][lo:hi]
            else:
                if gather is None:
                    gather = torch.empty(
                        (sizes[-1], pieces[0].shape[1]), dtype=self.dtype, device=self.device
                    )
                ctx = gather[:size]
                at = 0
                for i, lo, hi in segs:
                    ctx[at : at + hi - lo].copy_(pieces[i][lo:hi])
                    at += hi - lo
                ctx[at:].zero_()
            self.write_ctx_kv(
                ctx.to(self.dtype), pos_dev[start : start + size], slot_dev[start : start + size],
                fused=True,
            )
            start += size

    # 2. block inputs

    def embed_blocks(self, anchors: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        """Anchors and start positions ``[n]`` -> the blocks ``[anchor, MASK x (B-1)]``
        embedded with the target's table ``[n, B, H]`` and their positions ``[n, B]``. Raw
        target embeddings: the drafter applies ``input_embedding_scale`` itself."""
        spec = self.spec
        return embed_blocks(anchors, starts, self.head.embed, spec.mask_token_id, spec.block_size, self.dtype)

    def block_inputs(
        self, meta: Tensor, table_col: int, width: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The graph metadata ``[m, C]`` -> ``(ctx lens [m] int32, page tables [m, width]
        int32, embedded blocks [m, B, H], positions [m, B])`` (one kernel on Triton)."""
        spec = self.spec
        return self.ops.block_inputs(
            meta, table_col, width, self.head.embed, spec.mask_token_id, spec.block_size,
            self.dtype,
        )

    # 3. layers

    def attention(
        self, page_tables: Tensor, ctx_lens: Tensor, q_pos: Tensor, *, fault_hooks: bool = True
    ) -> AttendFn:
        """The drafter's ``attend``: block queries over each sequence's paged ctx K/V
        (``page_tables [n, W]`` int32, ``ctx_lens [n]`` int32 rows with K/V) plus the block's
        own K/V. ``fault_hooks=False`` for code captured in a CUDA graph, where a hook would
        only run at capture time."""
        spec, cache, attend_op = self.spec, self.cache, self.ops.block_attention
        slot_pos = self.slot_pos

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if fault_hooks and faults.active():
                faults.hit("attention")
            return attend_op(
                q, k, v, cache.k_layers[layer], cache.v_layers[layer], page_tables, ctx_lens,
                q_pos, slot_pos, scale=spec.scale,
                sliding_window=spec.layer_window[layer], causal_block=spec.layer_causal[layer],
            )

        return attend

    def fused_view(self) -> FastDrafter | None:
        """The drafter's fused view (stacked weights, fused elementwise kernels), made on first
        use; ``None`` for drafters without one (not a :class:`DFlashDrafter`)."""
        if not self._fused_made:
            self._fused = FastDrafter.from_drafter(self.drafter, self.ops, self.proj)
            self._fused_made = True
        return self._fused

    def layers(self, embeds: Tensor, q_pos: Tensor, attend: AttendFn, *, fused: bool = False) -> Tensor:
        """The drafter layers over ``n`` blocks: ``embeds [n, B, H]``, ``q_pos [n, B]`` ->
        ``[n, B, H]`` after the final norm; ``fused`` runs the fused view where there is one."""
        view = self.fused_view() if fused else None
        forward_block: Callable[[Tensor, Tensor, AttendFn], Tensor] = (
            view.forward_block if view is not None else self.drafter.forward_block
        )
        return forward_block(embeds, q_pos, attend)

    # 4. drafts

    def greedy(self, rows: Tensor, bitmask: Tensor | None = None) -> Tensor:
        """Hidden rows ``[R, H]`` -> the target head -> masked argmax ``[R]`` int64 (-1 where
        the bitmask ``[R, ceil(V/32)]`` allows nothing)."""
        logits = self.drafter.logits(rows, self.head.lm_head)
        out: Tensor = self.ops.masked_argmax(logits, bitmask)
        return out

    def _selector(self) -> CandidateSelector:
        sel = getattr(self.drafter, "candidate_selector", None)
        if not isinstance(sel, CandidateSelector):
            raise TypeError("DFlash2 drafts need the drafter's candidate_selector")
        return sel

    def select(
        self, rows: Tensor, anchors: Tensor, noise: Tensor | None = None, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """DFlash2: block rows ``[n, T, H]`` (rows 1..B-1 of each block) and the anchors ``[n]``
        int64 -> the target head -> top-K candidates and ``hidden_projection`` -> the selector
        walk (one ``selector_walk`` launch for all sequences). ``noise`` ``[n, T, K]`` Gumbel
        draws sample at ``temperature``; ``None`` is greedy. Returns ``(tokens [n, T] int64,
        candidates [n, T, K] int64, q [n, T, K] fp32 or None)``, as
        ``CandidateSelector.select`` does; fixed shapes, no host reads (graph-capturable)."""
        sel = self._selector()
        n, steps, size = rows.shape
        # One [n*T, H] matrix: the rows are a strided slice of [n, B, H], and a 3-D strided
        # input makes the head a batched GEMM that reads the whole [V, H] weight once per
        # sequence (9 ms at n = 32, Qwen3-8B shapes) instead of once.
        flat = rows.reshape(n * steps, size)
        logits = self.drafter.logits(flat, self.head.lm_head)
        unary, candidates = self.ops.topk(logits.view(n, steps, -1), sel.top_k)
        projected = sel.hidden_projection(flat).view(n, steps, -1)
        tokens, q = self.ops.selector_walk(
            unary, candidates, projected, sel.predecessor_codebook, sel.successor_codebook,
            anchors, noise, temperature,
        )
        return tokens, candidates, q

    def pick(self, hidden: Tensor, anchors: Tensor, take: int, mask: Tensor | None) -> Tensor:
        """``hidden [n, B, H]`` -> the first ``take`` drafts ``[n, take]`` int64; ``mask``
        ``[take, ceil(V/32)]`` packed allowed tokens per draft (the same for every sequence).
        -1 marks a draft with nothing allowed, which ends that sequence's drafts."""
        n = hidden.shape[0]
        if self.spec.is_dflash2:
            # The selector walks all B-1 rows left to right; keep the first `take`.
            picked: Tensor = self.select(hidden[:, 1:], anchors)[0][:, :take]
            if mask is not None:
                allowed = allowed_ids(mask, self.head.vocab_size)
                ok = allowed.gather(1, picked[0][:, None])[:, 0]
                # A disallowed draft ends the band: later drafts would condition on it.
                picked = torch.where(ok.to(torch.int64).cumprod(0).bool()[None], picked, -1)
            return picked
        rows = hidden[:, 1 : 1 + take].reshape(n * take, self.spec.hidden_size)
        bits = mask.repeat(n, 1) if mask is not None else None
        return self.greedy(rows, bits).view(n, take)

    def sample(
        self, hidden: Tensor, anchors: Tensor, take: int, params: SamplingParams,
        generator: Generators,
    ) -> tuple[Tensor, Tensor]:
        """``hidden [n, B, H]`` -> ``take`` drafts per sequence sampled from the drafter's
        distribution, and that distribution ``q [n, take, V]`` fp32 (each draft's, given the
        drafts before it): the drafter's logits through ``params`` (temperature, top-k,
        top-p) for DFlash; DFlash2's selector walk samples among its candidates (Gumbel draws
        from ``generator``, one ``selector_walk`` launch). ``generator``: one random source for
        all sequences, or a list of one per sequence (each sequence's draws then equal those
        of a call for it alone)."""
        n = hidden.shape[0]
        vocab = self.head.vocab_size
        per_seq = None if generator is None or isinstance(generator, torch.Generator) else list(generator)
        if per_seq is not None and len(per_seq) != n:
            raise ValueError(f"{len(per_seq)} generators for {n} sequences")
        if self.spec.is_dflash2:
            rows = hidden[:, 1:]
            shape = (rows.shape[1], self._selector().top_k)
            if per_seq is None:
                noise = gumbel((n, *shape), _single(generator), hidden.device)
            else:
                noise = torch.cat([gumbel((1, *shape), g, hidden.device) for g in per_seq])
            tokens, candidates, q_top = self.select(rows, anchors, noise, params.temperature)
            assert q_top is not None
            q = torch.zeros((n, q_top.shape[1], vocab), dtype=torch.float32, device=hidden.device)
            q.scatter_(2, candidates, q_top)
            return tokens[:, :take], q[:, :take]
        rows = hidden[:, 1 : 1 + take].reshape(n * take, self.spec.hidden_size)
        logits = self.drafter.logits(rows, self.head.lm_head)
        q = target_probs(logits, params.temperature, params.top_p, params.top_k)
        if per_seq is None:
            tokens = sample_rows(q, _single(generator))
        else:
            tokens = torch.cat([sample_rows(q[i * take : (i + 1) * take], g)
                                for i, g in enumerate(per_seq)])
        return tokens.view(n, take), q.view(n, take, vocab)

    # the plain path

    def run(
        self, proposal: Proposal, take: int, mask: Tensor | None,
        sampling: tuple[SamplingParams, Generators] | None = None,
    ) -> Tensor:
        """The whole forward of ``proposal`` on the plain path: store its plans' K/V, draft.
        Returns ``[n, take]`` int64 drafts (see :meth:`pick`); with ``sampling`` ``(params,
        generator or one per sequence)`` the drafts are sampled (:meth:`sample`) and their distribution is kept
        in :attr:`last_q`. Every plan stays outstanding (the caller confirms or aborts
        them)."""
        n = len(proposal.plans)
        self.store_plans(list(zip(proposal.states, proposal.plans)))
        tables = [ctx.page_table + plan.new_pages for ctx, plan in zip(proposal.ctxs, proposal.plans)]
        width = max(1, max(len(t) for t in tables))
        if faults.active():
            faults.hit("page_table_dev")
        page_tables = torch.zeros((n, width), dtype=torch.int32)
        for i, t in enumerate(tables):
            if t:
                page_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        page_tables = page_tables.to(self.device)
        ctx_lens = torch.tensor(
            [plan.row_end for plan in proposal.plans], dtype=torch.int32, device=self.device
        )
        anchors = torch.tensor(proposal.tokens, dtype=torch.int64, device=self.device)
        starts = torch.tensor(proposal.positions, dtype=torch.int64, device=self.device)
        embeds, q_pos = self.embed_blocks(anchors, starts)
        attend = self.attention(page_tables, ctx_lens, q_pos)
        if faults.active():
            faults.hit("forward")
        hidden = self.layers(embeds, q_pos, attend)  # [n, B, H]
        if faults.active():
            faults.hit("logits")
        if sampling is not None:
            tokens, self.last_q = self.sample(hidden, anchors, take, sampling[0], sampling[1])
            return tokens
        return self.pick(hidden, anchors, take, mask)



def _plan_rows(items: Sequence[tuple[DFlashState, PrecomputePlan]]) -> tuple[list[Tensor], list[int], list[int]]:
    """The accumulator rows ``[row_start, row_end)`` of every plan that has any, with their
    positions and slots, in order."""
    rows: list[Tensor] = []
    positions: list[int] = []
    slots: list[int] = []
    for state, plan in items:
        if plan.row_end > plan.row_start:
            rows.append(state.rows(plan.row_start, plan.row_end))
            positions.extend(plan.positions)
            slots.extend(plan.slots)
    return rows, positions, slots

__all__ = ["DraftForward"]
