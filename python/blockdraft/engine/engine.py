"""The speculative engine: continuous batching of requests over one drafter and one target.

A request is submitted, waits until the pages it may need are free (admission by page budget:
its target pages for prompt + ``max_new_tokens`` + one block of look-ahead, and the drafter
pages of its context window), runs, and leaves the moment it finishes, its pages back at once.
Each :meth:`SpeculativeEngine.step` admits what fits (prefilling it: the prompt's context rows
go to the proposer chunk by chunk), then runs one speculative step for every running request:

1. drafts: ``propose_batch`` over the requests (falling back to ``propose`` per request when
   it declines, or when a grammar mask applies);
2. verify: every request's block ``[anchor, drafts...]`` in one target forward (the
   runtime's; the Hugging Face target goes one sequence at a time);
3. accept: the longest agreeing prefix plus the target's own next token
   (:mod:`blockdraft.engine.accept`); the target keeps the accepted rows' K/V, the proposer
   records the verify (``after_verify_batch``) and takes the accepted rows as context
   (``commit_ctx_batch``).

Greedy output equals the target's own greedy decoding, whatever else runs beside a request.
The engine is not thread-safe: one thread steps it (a server queues submissions and
cancellations for that thread).

Tensor parallelism (``tp=``): every rank builds the same engine and makes the same calls in
the same order. The target's forward is split over the ranks; everything else (the drafter,
the proposer, admission, acceptance) runs replicated on whole rows that are the same bits on
every rank, so every rank takes the same decisions without exchanging them. Sampled requests
without a random source of their own draw from one seeded per request from a base that rank
0 chooses, so every rank draws the same tokens.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

import blockdraft._core as _core
from blockdraft._core import ConfigError
from blockdraft.cuda_graphs import GraphMode
from blockdraft.engine.accept import accept_blocks, first_tokens
from blockdraft.engine.request import MaskFn, Request, Status, StepEvent
from blockdraft.pair import check_context
from blockdraft.parallel import TPGroup
from blockdraft.proposer import DFlashProposer, agreed_pool_size
from blockdraft.results import GenerationResult, GenerationStats
from blockdraft.sampling import SamplingParams, as_sampling
from blockdraft.target import (
    DEFAULT_SDPA_BACKENDS,
    HFTarget,
    RuntimeTarget,
    TargetAdapter,
    TargetBackend,
    TargetRuntime,
    TargetSpec,
    check_prompts,
    model_shard,
    validate_sdpa_backends,
)

log = logging.getLogger(__name__)

RUNTIMES = ("auto", "blockdraft", "hf")


def resolve_runtime(runtime: str, target: Any) -> str:
    """``"blockdraft"`` or ``"hf"`` for ``runtime`` on ``target`` (``"auto"``: the runtime
    when it supports the model, else Hugging Face with one log line).

    Raises:
        ConfigError: an unknown name, or ``"blockdraft"`` on an unsupported model (named).
    """
    if runtime not in RUNTIMES:
        raise ConfigError(f"runtime must be one of {RUNTIMES}, not {runtime!r}")
    if runtime == "hf":
        return "hf"
    try:
        TargetSpec.from_model(target)
    except ConfigError as exc:
        if runtime == "blockdraft":
            raise
        log.info("target runtime: %s; running the target's own forward", exc)
        return "hf"
    return "blockdraft"


class SpeculativeEngine:
    """A target + drafter pair that serves many requests at once.

    Args:
        target: a Hugging Face causal LM.
        drafter: a loaded DFlash drafter matching the target.
        proposer: an existing proposer for this pair (default: one is built).
        runtime: what runs the target: ``"blockdraft"`` (the runtime; an unsupported model is
            a :class:`~blockdraft.ConfigError` naming its architecture), ``"hf"`` (the model's
            own forward, one sequence at a time), ``"auto"`` (the runtime when the model is
            supported).
        max_seq_len: longest prompt + generation (default: the target's
            ``max_position_embeddings``, else 4096).
        max_active: most requests running at once (default: 32); more wait.
        target_pages: target K/V pages of the runtime's pool (default: ``max_active``
            sequences of ``max_seq_len``, at most half the free memory).
        page_size: tokens per target page.
        sdpa_backends: the attention backends of the Hugging Face target's forwards (see
            :class:`~blockdraft.target.HFTarget`).
        graphs: the proposer's and the runtime's CUDA graphs (``"auto"``: on CUDA;
            ``"capture"``, ``"static"``, ``"off"``; see :class:`~blockdraft.TargetRuntime`).
        sampled_drafts: at ``temperature > 0``, draft by sampling the drafter's own
            distribution (with the request's temperature, top-k and top-p) and accept by
            rejection sampling against it, instead of greedy drafts (one-hot ``q``). Both are
            lossless; sampled drafts are accepted more often.
        tp: the tensor-parallel group this process is a rank of (``None``: one rank). Every
            rank builds the engine with the same arguments and then submits, steps and
            cancels in the same order; the target runs on the runtime split over the ranks
            (``runtime`` must not be ``"hf"``) and the drafter runs whole on every rank.
        proposer_kwargs: passed to :class:`~blockdraft.DFlashProposer` when one is built.

    Raises:
        ConfigError / TypeError / ValueError: bad settings.
    """

    def __init__(
        self,
        target: Any,
        drafter: Any,
        *,
        proposer: DFlashProposer | None = None,
        runtime: str = "auto",
        max_seq_len: int | None = None,
        max_active: int = 32,
        target_pages: int | None = None,
        page_size: int = 16,
        sdpa_backends: Any = DEFAULT_SDPA_BACKENDS,
        graphs: GraphMode = "auto",
        sampled_drafts: bool = False,
        tp: TPGroup | None = None,
        **proposer_kwargs: Any,
    ) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, not {max_active}")
        sdpa_backends = validate_sdpa_backends(sdpa_backends)
        self.tp = tp
        parallel = tp is not None and tp.size > 1
        if parallel and runtime == "hf":
            raise ConfigError("tensor parallelism runs the target on the blockdraft runtime, not runtime='hf'")
        which = resolve_runtime(runtime, target)
        if which == "hf" and parallel:
            raise ConfigError("tensor parallelism needs the blockdraft runtime, which does not "
                              f"support {type(target).__name__}")
        if which == "hf" and model_shard(target) != (0, 1):
            raise ConfigError("the target holds a tensor-parallel shard: its Hugging Face "
                              "forward cannot run (use runtime='blockdraft' with its group)")
        cfg = getattr(target, "config", None)
        positions = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        if max_seq_len is None:
            max_seq_len = positions
        self.max_seq_len = max_seq_len
        self.max_active = max_active
        self.target_model = target
        self.drafter = drafter
        self.proposer = proposer or DFlashProposer(
            drafter, target, max_seq_len=max_seq_len, graphs=graphs, tp=tp, **proposer_kwargs
        )
        if proposer is not None and parallel:
            assert tp is not None
            # Admission reads the pool: every rank's must be the same size.
            agreed_pool_size(tp, proposer.pool.num_pages, sized=False)
        self.block_size = self.proposer.block_gamma
        self.target: TargetBackend
        if which == "blockdraft":
            rt = TargetRuntime(
                target, max_seq_len=min(positions, max_seq_len + self.block_size),
                num_pages=target_pages, page_size=page_size, max_batch=max_active,
                capture_layers=self.proposer.target_layer_ids, graphs=graphs,
                graph_rows=(1, self.block_size), tp=tp,
            )
            self.target = RuntimeTarget(rt, self.block_size)
        else:
            self.target = HFTarget(TargetAdapter(target, drafter.config), sdpa_backends)
        self._vocab = self.proposer.head.vocab_in
        self._ids = iter(range(1, 1 << 62))
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._requests: dict[int, Request] = {}
        self.sampled_drafts = bool(sampled_drafts)
        self.batched_proposals = 0
        self.single_proposals = 0
        self.steps = 0
        # Rank 0's choice: every rank seeds a sampled request's generator the same way.
        self._seed_base: int | None = None
        if tp is not None and tp.size > 1:
            self._seed_base = int(tp.broadcast(secrets.randbits(62)))

    @property
    def target_runtime(self) -> str:
        """``"blockdraft"`` or ``"hf"``: what runs the target."""
        return self.target.name

    @property
    def runtime(self) -> TargetRuntime | None:
        """The target's :class:`~blockdraft.TargetRuntime` (``None`` on the Hugging Face
        forward): target-only decoding on it (:func:`blockdraft.decode`) is the fair baseline."""
        return self.target.runtime if isinstance(self.target, RuntimeTarget) else None

    def close(self) -> None:
        """Cancel everything and detach from the target (the engine is unusable afterwards)."""
        for r in list(self._requests.values()):
            if not r.status.ended:
                self.cancel(r.id)
        self.target.close()

    def __enter__(self) -> SpeculativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        grammar_bitmask_fn: MaskFn | None = None,
    ) -> int:
        """Queue a request; it starts at a later :meth:`step` once its pages fit.

        Args:
            prompt: its token ids (non-empty).
            max_new_tokens: the most tokens it generates (>= 1).
            sampling: how its tokens are chosen (``None``: greedy).
            stop_token_ids: it ends after producing one of these (included).
            generator / seed: its random source when sampling (a seed makes one).
            grammar_bitmask_fn: ``fn(generated) -> packed int32 [ceil(V/32)]`` of the tokens
                allowed next; the target's choice is masked at every position.

        Returns:
            the request id.

        Raises:
            TypeError / ValueError: bad arguments, a prompt + ``max_new_tokens`` past
                ``max_seq_len``, or a request that can never fit the pools (nothing queued).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, not {type(max_new_tokens).__name__}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
        params = as_sampling(sampling)
        ids = check_prompts([prompt], self._vocab)[0]
        check_context(len(ids), max_new_tokens, self.max_seq_len)
        rid = next(self._ids)
        if seed is None and generator is None and self._seed_base is not None and not params.greedy:
            seed = (self._seed_base + rid) % (1 << 63)
        if seed is not None and generator is None:
            generator = torch.Generator().manual_seed(int(seed))
        req = Request(
            id=rid, prompt=ids, max_new_tokens=max_new_tokens, params=params,
            stops=frozenset(int(t) for t in (stop_token_ids or ())), mask_fn=grammar_bitmask_fn,
            generator=generator, submitted_at=time.perf_counter(),
        )
        req.target_pages, req.drafter_pages = self._needs(req)
        total_t, total_d = self.target.total_pages, self.proposer.pool.num_pages
        if (total_t is not None and req.target_pages > total_t) or req.drafter_pages > total_d:
            raise ValueError(
                f"the request needs {req.target_pages} target pages and {req.drafter_pages} "
                f"drafter pages; the pools hold {total_t} and {total_d}: it can never run"
            )
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def cancel(self, request_id: int) -> bool:
        """End a request now and give back everything it holds; ``False`` if it had already
        ended (or is unknown)."""
        req = self._requests.get(request_id)
        if req is None or req.status.ended:
            return False
        self._end(req, Status.CANCELLED, "cancelled")
        return True

    def request(self, request_id: int) -> Request:
        """The request (status, tokens so far, steps).

        Raises:
            KeyError: an unknown id.
        """
        return self._requests[request_id]

    def request_ids(self) -> list[int]:
        """The ids of every request the engine still keeps (waiting, running, or ended and
        not yet forgotten)."""
        return list(self._requests)

    def forget(self, request_id: int) -> None:
        """Drop an ended request's record (a server does after answering it)."""
        req = self._requests.get(request_id)
        if req is not None and req.status.ended:
            del self._requests[request_id]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def pages_used(self) -> dict[str, int]:
        """Pages in use per pool: ``{"target": ..., "drafter": ...}`` (target 0 on HF)."""
        used_t = self.target.used_pages if isinstance(self.target, RuntimeTarget) else 0
        return {"target": used_t, "drafter": self.proposer.pool.num_used}

    def pages_total(self) -> dict[str, int]:
        return {"target": self.target.total_pages or 0, "drafter": self.proposer.pool.num_pages}

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """Admit what fits, then one speculative step for every running request.

        Returns:
            one event per request that produced tokens or ended.

        Raises:
            whatever a shared part of the step raised (the target's forward, say) once every
            request that step held has failed and given back what it held; a failure that
            belongs to one request (its grammar mask, its proposal) fails that request only.
        """
        events: list[StepEvent] = []
        self._admit(events)
        running = [r for r in self._running if r.status is Status.RUNNING]
        if running:
            self.steps += 1
            try:
                self._speculate(running, events)
            except BaseException as exc:
                self._fail_all(running, exc, events)
                raise
        return events

    def stream(self, request_ids: Sequence[int] | None = None) -> Iterator[StepEvent]:
        """Step until the given requests (default: all) have ended, yielding their events."""
        want = set(request_ids) if request_ids is not None else None
        while True:
            live = [r for r in self._requests.values() if not r.status.ended
                    and (want is None or r.id in want)]
            if not live:
                return
            for ev in self.step():
                if want is None or ev.request_id in want:
                    yield ev

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] | None = None,
        grammar_bitmask_fn: Callable[[int, Sequence[int]], Tensor | None] | None = None,
        generator: torch.Generator | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after each prompt (submit them all, step
        until they end).

        Args:
            grammar_bitmask_fn: ``fn(prompt_index, generated) -> packed int32 [ceil(V/32)]``.
            generator: random source for sampling, shared by the prompts.
            progress: called with the number of new tokens after every step.
            (the rest as :meth:`submit`)

        Returns:
            the tokens per prompt and :class:`~blockdraft.GenerationStats`.

        Raises:
            TypeError / ValueError: bad arguments (nothing submitted). On any exception,
                ``KeyboardInterrupt`` included, every request of the call is cancelled and its
                pages are back in the pools.
        """
        ids = check_prompts(prompts, self._vocab)
        as_sampling(sampling)
        for i, p in enumerate(ids):
            check_context(len(p), max_new_tokens, self.max_seq_len, prompt=f"prompt {i}")
        start = time.perf_counter()
        rids: list[int] = []
        batched0, single0 = self.batched_proposals, self.single_proposals
        try:
            for i, p in enumerate(ids):
                mask = None
                if grammar_bitmask_fn is not None:
                    mask = _bind_mask(grammar_bitmask_fn, i)
                rids.append(self.submit(
                    p, max_new_tokens=max_new_tokens, sampling=sampling,
                    stop_token_ids=stop_token_ids, generator=generator,
                    grammar_bitmask_fn=mask,
                ))
            for ev in self.stream(rids):
                if progress is not None and ev.tokens:
                    progress(len(ev.tokens))
                if ev.finish_reason == "error":
                    failure = self._requests[ev.request_id].exception
                    if failure is not None:
                        raise failure
                    raise RuntimeError(f"request {ev.request_id} failed: {ev.error}")
        finally:
            for rid in rids:
                self.cancel(rid)
        elapsed = time.perf_counter() - start
        reqs = [self._requests.pop(rid) for rid in rids]
        return GenerationResult(
            [r.out for r in reqs],
            GenerationStats.collect(
                [r.steps for r in reqs], sum(len(r.out) for r in reqs), elapsed,
                [(r.ttft_s or 0.0) - (start - r.submitted_at) for r in reqs], self.target.name,
                self.batched_proposals - batched0, self.single_proposals - single0,
            ),
        )

    def _needs(self, req: Request) -> tuple[int, int]:
        """(target pages, drafter pages) the request may hold at its longest."""
        budget = len(req.prompt) + req.max_new_tokens
        target = self.target.pages_for(budget + self.block_size)
        window = _core.ctx_window(self.max_seq_len, self.block_size, budget,
                                  self.proposer.levers.ctx_cap)
        return target, math.ceil(window / self.proposer.page_size)

    def _admit(self, events: list[StepEvent]) -> None:
        """Start waiting requests in order while their pages fit (no request jumps the queue),
        prefilling them together."""
        total_t = self.target.total_pages
        total_d = self.proposer.pool.num_pages
        held_t = sum(r.target_pages for r in self._running)
        held_d = sum(r.drafter_pages for r in self._running)
        batch: list[Request] = []
        while self._waiting and len(self._running) + len(batch) < self.max_active:
            req = self._waiting[0]
            if total_t is not None and held_t + req.target_pages > total_t:
                break
            if held_d + req.drafter_pages > total_d:
                break
            self._waiting.pop(0)
            held_t += req.target_pages
            held_d += req.drafter_pages
            try:
                req.target_seq = self.target.new(len(req.prompt) + req.max_new_tokens + self.block_size)
                req.state = self.proposer.alloc_state_for(len(req.prompt) + req.max_new_tokens)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self._fail(req, exc)
                events.append(self._event(req))
                continue
            req.status = Status.RUNNING
            self._running.append(req)
            batch.append(req)
        if batch:
            try:
                self._prefill(batch, events)
            except BaseException as exc:
                self._fail_all(batch, exc, events)
                raise

    def _fail_all(self, reqs: Sequence[Request], exc: BaseException, events: list[StepEvent]) -> None:
        """A step that raised out of its shared work fails every request of it still live."""
        for r in reqs:
            if not r.status.ended:
                self._fail(r, exc)
                events.append(self._event(r))

    def _prefill(self, batch: list[Request], events: list[StepEvent]) -> None:
        prop = self.proposer

        def commit(idx: list[int], spans: list[range], rows: Tensor) -> None:
            prop.commit_ctx_batch([batch[i].state for i in idx], rows,  # type: ignore[misc]
                                  spans)

        logits = self.target.prefill([r.target_seq for r in batch], [r.prompt for r in batch], commit)
        firsts = first_tokens(batch, logits)
        now = time.perf_counter()
        for r, tok in zip(batch, firsts):
            r.ttft_s = now - r.submitted_at
            r.push([tok])
            if r.finish_reason is not None:
                self._end(r, Status.FINISHED, r.finish_reason)
            events.append(self._event(r))

    def _speculate(self, running: list[Request], events: list[StepEvent]) -> None:
        drafts, draft_q = self._draft(running)
        events.extend(self._event(r) for r in running if r.status is Status.FAILED)
        live = [r for r in running if r.status is Status.RUNNING]
        if not live:
            return
        blocks = [[r.out[-1], *drafts[r.id]] for r in live]
        logits, rows = self.target.verify([r.target_seq for r in live], blocks)
        decided = accept_blocks(live, [drafts[r.id] for r in live], logits,
                                [draft_q.get(r.id) for r in live])
        self.target.accept([r.target_seq for r in live], [a + 1 for a, _ in decided])
        prop = self.proposer
        prop.after_verify_batch([r.state for r in live], [a for a, _ in decided])  # type: ignore[misc]
        keep_states, keep_rows, keep_pos = [], [], []
        offset = 0
        for r, (accepted, nxt), block in zip(live, decided, blocks):
            start = r.anchor_position
            new = [*drafts[r.id][:accepted], nxt]
            r.steps.append(len(new))
            r.push(new)
            if r.finish_reason is None:
                keep_states.append(r.state)
                keep_rows.append(rows[offset : offset + accepted + 1])
                keep_pos.append(range(start, start + accepted + 1))
            offset += len(block)
        if keep_states:
            prop.commit_ctx_batch(keep_states, torch.cat(keep_rows) if len(keep_rows) > 1  # type: ignore[arg-type]
                                  else keep_rows[0], keep_pos)
        for r in live:
            if r.finish_reason is not None:
                self._end(r, Status.FINISHED, r.finish_reason)
            events.append(self._event(r))

    def _draft(self, running: list[Request]) -> tuple[dict[int, list[int]], dict[int, Tensor]]:
        """Drafts per request (``min(B-1, left-1)`` of them; none for a request's last
        token), and for sampled drafts their distribution ``[drafts, V]`` (on the host); a
        request whose proposal fails is failed. How many to draft is decided here; how they
        are drafted is the proposer's (:meth:`~blockdraft.DFlashProposer.draft`)."""
        got = self.proposer.draft(
            [r.state for r in running],  # type: ignore[misc]
            [r.out[-1] for r in running],
            [r.anchor_position for r in running],
            [min(self.block_size - 1, r.remaining - 1) for r in running],
            # Lists only when some request needs them: most steps have no grammar and greedy drafts.
            masks=([r.bitmask if r.mask_fn is not None else None for r in running]
                   if any(r.mask_fn is not None for r in running) else None),
            sampling=[(r.params, r.generator) for r in running] if self.sampled_drafts else None,
        )
        self.batched_proposals += got.batched
        self.single_proposals += got.single
        drafts: dict[int, list[int]] = {}
        draft_q: dict[int, Tensor] = {}
        for r, tokens, q, exc in zip(running, got.tokens, got.q, got.errors):
            drafts[r.id] = tokens
            if q is not None:
                draft_q[r.id] = q
            if exc is not None:
                self._fail(r, exc)
        return drafts, draft_q

    def _end(self, req: Request, status: Status, reason: str, *, error: str | None = None) -> None:
        """Give back what ``req`` holds and mark it ended (idempotent)."""
        if req in self._waiting:
            self._waiting.remove(req)
        if req in self._running:
            self._running.remove(req)
        try:
            if req.target_seq is not None:
                self.target.free([req.target_seq])
        finally:
            req.target_seq = None
            if req.state is not None:
                self.proposer.free_state(req.state)
            req.state = None
        if not req.status.ended:
            req.status = status
            req.finish_reason = req.finish_reason if status is Status.FINISHED else reason
            req.error = error

    def _fail(self, req: Request, exc: BaseException) -> None:
        req.exception = exc
        self._end(req, Status.FAILED, "error", error=f"{type(exc).__name__}: {exc}")

    def _event(self, req: Request) -> StepEvent:
        new = tuple(req.out[req.reported :])
        req.reported = len(req.out)
        reason = req.finish_reason if req.status.ended else None
        return StepEvent(req.id, new, reason, req.error)


def _bind_mask(fn: Callable[[int, Sequence[int]], Tensor | None], index: int) -> MaskFn:
    return lambda generated: fn(index, generated)


__all__ = ["RUNTIMES", "SpeculativeEngine", "resolve_runtime"]
