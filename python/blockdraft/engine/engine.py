"""The speculative engine: continuous batching of requests over one drafter and one target.

A request is submitted, waits until the pages it may need are free (admission by page budget:
its target pages for prompt + ``max_new_tokens`` + one block of look-ahead, and the drafter
pages of its context window), runs, and leaves the moment it finishes, its pages back at once.
Each :meth:`SpeculativeEngine.step` admits what fits (prefilling it: the prompt's context rows
go to the proposer chunk by chunk), then runs one speculative step for every running request:

1. drafts: ``propose_batch`` over the requests (falling back to ``propose`` per request when
   it declines); a request's grammar then fits its greedy drafts (``Request.fit_drafts``);
2. verify: every request's block ``[anchor, drafts...]`` in one target forward (the
   runtime's; the Hugging Face target goes one sequence at a time);
3. accept: the longest agreeing prefix plus the target's own next token
   (:mod:`blockdraft.engine.accept`); the target keeps the accepted rows' K/V, the proposer
   records the verify (``after_verify_batch``) and takes the accepted rows as context
   (``commit_ctx_batch``).

Where a step's drafts stay on the device (:attr:`SpeculativeEngine.device_drafts`), the next
step's drafts for the requests that go on are launched right after their context rows are
committed (:attr:`SpeculativeEngine.draft_ahead`): the device runs the drafter while the host
finishes the step (the target's records, the events), the caller handles the events and the
next step admits; that step verifies those drafts, joined with drafts for the requests it
admitted (:mod:`blockdraft.engine.drafting`).

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
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from blockdraft import faults
from blockdraft.cuda_graphs import GraphMode
from blockdraft.engine import warmup as _warmup
from blockdraft.engine.accept import first_tokens
from blockdraft.engine.admission import num_admissible, reserve_pages
from blockdraft.engine.collect import generate_all
from blockdraft.engine.compiles import CompileWatch, graph_captures, triton_compiles
from blockdraft.engine.draft_length import DraftLength, DraftLengthPolicy, row_classes
from blockdraft.engine.drafting import StepDrafts, plain_argmax
from blockdraft.engine.logprobs import emitted_logprobs
from blockdraft.engine.request import MaskFn, Request, Status, StepEvent, new_request
from blockdraft.engine.target_only import decode_step
from blockdraft.engine.verified import kept_rows, push_verified, verify
from blockdraft.levers import read_device_drafts, read_draft_ahead
from blockdraft.parallel import TPGroup
from blockdraft.proposer import DFlashProposer, Drafts, agreed_pool_size
from blockdraft.results import GenerationResult
from blockdraft.sampling import SamplingParams
from blockdraft.target import (
    DEFAULT_SDPA_BACKENDS,
    RuntimeTarget,
    TargetBackend,
    TargetRuntime,
    config_int,
    validate_sdpa_backends,
)
from blockdraft.target.select import choose_runtime, open_target

log = logging.getLogger(__name__)

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
        speculate: ``False``: target-only decoding, a token per request per step (no drafter
            work or pages; a proposer built here gets a one-page pool unless
            ``proposer_kwargs`` give ``num_pages`` or ``pool``).
        draft_length: drafts verified per request and step: ``"adaptive"`` (from the batch's
            size and each request's recent acceptance; see
            :mod:`blockdraft.engine.draft_length`), a fixed count (clipped to ``B - 1``), or
            a :class:`~blockdraft.engine.draft_length.DraftLengthPolicy` of one's own;
            ``None``: the ``BLOCKDRAFT_DRAFT_LENGTH`` variable, else adaptive. Greedy output
            is the same for every choice.
        proposer_kwargs: passed to :class:`~blockdraft.DFlashProposer` when one is built.

    Attributes:
        device_drafts: whether a step's greedy drafts may stay on the device into the verify
            (the runtime's graph paths and ``BLOCKDRAFT_DEVICE_DRAFTS``).
        draft_ahead: whether, with ``device_drafts``, the next step's drafts are launched
            before a step's bookkeeping (``BLOCKDRAFT_DRAFT_AHEAD``). Their draft counts are
            chosen for the requests that go on, before the next step admits any.
        drafts: where each step's drafts come from, and how many proposals were batched
            (:class:`~blockdraft.engine.drafting.StepDrafts`).

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
        speculate: bool = True,
        draft_length: DraftLength | DraftLengthPolicy | None = None,
        **proposer_kwargs: Any,
    ) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, not {max_active}")
        sdpa_backends = validate_sdpa_backends(sdpa_backends)
        self.tp = tp
        parallel = tp is not None and tp.size > 1
        which = choose_runtime(runtime, target, tp)
        positions = config_int(target, "max_position_embeddings") or 4096
        if max_seq_len is None:
            max_seq_len = positions
        self.max_seq_len = max_seq_len
        self.max_active = max_active
        self.target_model = target
        self.drafter = drafter
        if proposer is None and not speculate and "pool" not in proposer_kwargs:
            # Target-only decoding never drafts: the proposer stays for the pair's checks and
            # facts, with a one-page K/V pool, so the target's pool (where memory bounds it, a
            # share of what is left after the drafter's) is the one a server of the target
            # alone would have.
            proposer_kwargs.setdefault("num_pages", 1)
        self.proposer = proposer or DFlashProposer(
            drafter, target, max_seq_len=max_seq_len, graphs=graphs, tp=tp, **proposer_kwargs
        )
        if proposer is not None and parallel:
            assert tp is not None
            # Admission reads the pool: every rank's must be the same size.
            agreed_pool_size(tp, proposer.pool.num_pages, sized=False)
        self.block_size = self.proposer.block_gamma
        self.speculate = bool(speculate)
        self._lengths = DraftLengthPolicy.of(self.block_size, draft_length)
        self.draft_length: DraftLength = "adaptive" if self._lengths.fixed is None else self._lengths.fixed
        self.target: TargetBackend = open_target(
            target, drafter.config, which, block_size=self.block_size,
            max_seq_len=min(positions, max_seq_len + self.block_size), num_pages=target_pages,
            page_size=page_size, max_batch=max_active, graphs=graphs, tp=tp, sdpa_backends=sdpa_backends,
            capture_layers=self.proposer.target_layer_ids if speculate else (),
            graph_rows=(1, *row_classes(self.block_size, self.draft_length)) if speculate else (1,),
        )
        self._vocab = self.proposer.head.vocab_in
        self._target_positions = self.proposer.head.max_positions
        self._ids = iter(range(1, 1 << 62))
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._requests: dict[int, Request] = {}
        self.sampled_drafts = bool(sampled_drafts)
        self.steps = 0
        # Rank 0's choice: every rank seeds a sampled request's generator the same way.
        self._seed_base: int | None = None
        if tp is not None and tp.size > 1:
            self._seed_base = int(tp.broadcast(secrets.randbits(62)))
        # Greedy drafts go from the drafter to the verify on the device where the verify has
        # graphs that take them there (the runtime's); else they are read between the two.
        rt = self.runtime
        self.device_drafts = bool(self.speculate and rt is not None and rt.graphs is not None
                                  and read_device_drafts())
        # Where they do, the next step's are launched before a step's bookkeeping.
        self.draft_ahead = self.device_drafts and read_draft_ahead()
        self.drafts = StepDrafts(self.proposer, self._lengths, sampled=self.sampled_drafts,
                                 device_drafts=self.device_drafts)
        # Not a bound method of this engine: that reference cycle would keep a dropped engine's
        # device memory (K/V pages, graphs) until a garbage collection.
        self._watch = CompileWatch(partial(graph_captures, self.proposer, self.runtime))
        self.warmup_report: _warmup.WarmupReport | None = None

    def warmup(self, *, max_prompt: int | None = None,
               progress: _warmup.Progress | None = None) -> _warmup.WarmupReport:
        """Compile every kernel variant and capture every CUDA graph a request can reach
        (:func:`blockdraft.engine.warmup.warm_up`); from then on each compile or capture is
        counted and logged as a warning. Leaves no request behind, every page back, ids and
        counters as they were. With tensor parallelism every rank calls it.

        Args:
            max_prompt: the longest single prompt warmed (default: the longest the engine
                takes, at most 16384 tokens).
            progress: ``progress(done, total)`` after each unit of work.

        Raises:
            RuntimeError: a request is waiting or running.
        """
        if self._waiting or self._running:
            raise RuntimeError("warmup needs an idle engine (no request waiting or running)")
        rt = self.runtime
        full = (self.proposer.device.type == "cuda" or self.proposer.backend == "triton"
                or (rt is not None and rt.backend == "triton"))
        drafts = self.drafts
        saved = (self._ids, self.steps, drafts.batched, drafts.single)
        self._ids = iter(range(1 << 62, 1 << 63))  # apart from the ids requests get
        try:
            report = _warmup.timed(
                lambda: _warmup.warm_up(self, max_prompt=max_prompt, full=full, progress=progress),
                triton_compiles, self.graph_captures)
        finally:
            self._ids, self.steps, drafts.batched, drafts.single = saved
        self._watch.arm()
        self.warmup_report = report
        return report

    @property
    def is_warm(self) -> bool:
        """Whether :meth:`warmup` has run."""
        return self._watch.armed

    @property
    def compiles_after_warmup(self) -> int:
        """Triton kernels compiled since :meth:`warmup` ended (process-wide; 0 before it)."""
        return self._watch.compiles

    @property
    def captures_after_warmup(self) -> int:
        """CUDA graphs this engine captured since :meth:`warmup` ended (0 before it)."""
        return self._watch.captures

    def graph_captures(self) -> int:
        """CUDA graphs this engine's proposer and target runtime have captured."""
        return graph_captures(self.proposer, self.runtime)

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
        self.drafts.drop_ahead()  # views of the drafter's graph outputs, and ended requests
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
        min_tokens: int = 0,
        logprobs: int | None = None,
    ) -> int:
        """Queue a request; it starts at a later :meth:`step` once its pages fit.

        Args:
            prompt: its token ids (non-empty).
            max_new_tokens: the most tokens it generates (>= 1); a request that reaches the
                target's ``max_position_embeddings`` first ends there (``"length"``).
            sampling: how its tokens are chosen, penalties included (``None``: greedy).
            stop_token_ids: it ends after producing one of these (included).
            generator / seed: its random source when sampling (a seed makes one).
            grammar_bitmask_fn: ``fn(generated) -> packed int32 [ceil(V/32)]`` of the tokens
                allowed next; the target's choice is masked at every position.
            min_tokens: ``stop_token_ids`` are masked out of the target's choice until this
                many tokens are generated (``<= max_new_tokens``).
            logprobs: report each token's log-probability under the target with this many
                likeliest alternatives (``Request.out_logprobs``, ``StepEvent.logprobs``;
                see :class:`~blockdraft.TokenLogprob`); ``None``: none are computed.

        Returns:
            the request id.

        Raises:
            TypeError / ValueError: bad arguments, a prompt + ``max_new_tokens`` past
                ``max_seq_len``, or a request that can never fit the pools (nothing queued).
        """
        req = new_request(
            self._ids, prompt, max_new_tokens=max_new_tokens, sampling=sampling,
            stop_token_ids=stop_token_ids, generator=generator, seed=seed, seed_base=self._seed_base,
            mask_fn=grammar_bitmask_fn, min_tokens=min_tokens, logprobs=logprobs, vocab=self._vocab,
            max_seq_len=self.max_seq_len, target_positions=self._target_positions,
        )
        reserve_pages(req, self.target, self.proposer, max_seq_len=self.max_seq_len,
                      block_size=self.block_size, speculate=self.speculate)
        self._requests[req.id] = req
        self._waiting.append(req)
        return req.id

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
    def batched_proposals(self) -> int:
        """Proposals of several requests at once, so far."""
        return self.drafts.batched

    @property
    def single_proposals(self) -> int:
        """Proposals of one request, so far."""
        return self.drafts.single

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
                if self.speculate:
                    self._speculate(running, events)
                else:
                    decode_step(self.target, running)
                    self._settle(running, events)
            except BaseException as exc:
                self._fail_all(running, exc, events)
                raise
        self._watch.check()
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
        min_tokens: int = 0,
        logprobs: int | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after each prompt (submit them all, step
        until they end).

        Args:
            grammar_bitmask_fn: ``fn(prompt_index, generated) -> packed int32 [ceil(V/32)]``.
            generator: random source for sampling, shared by the prompts.
            progress: called with the number of new tokens after every step.
            (the rest as :meth:`submit`)

        Returns:
            the tokens per prompt (and their log-probabilities with ``logprobs``) and
            :class:`~blockdraft.GenerationStats`.

        Raises:
            TypeError / ValueError: bad arguments (nothing submitted). On any exception,
                ``KeyboardInterrupt`` included, every request of the call is cancelled and its
                pages are back in the pools.
        """
        return generate_all(
            self, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
            stop_token_ids=stop_token_ids, grammar_bitmask_fn=grammar_bitmask_fn,
            generator=generator, progress=progress, min_tokens=min_tokens, logprobs=logprobs,
        )

    def _admit(self, events: list[StepEvent]) -> None:
        """Start the waiting requests :func:`~blockdraft.engine.admission.num_admissible`
        lets start, prefilling them together."""
        count = num_admissible(self._waiting, self._running, max_active=self.max_active,
                               target_pages=self.target.total_pages,
                               drafter_pages=self.proposer.pool.num_pages)
        starting, self._waiting = self._waiting[:count], self._waiting[count:]
        batch: list[Request] = []
        for req in starting:
            try:
                req.target_seq = self.target.new(len(req.prompt) + req.max_new_tokens + self.block_size)
                if self.speculate:
                    req.state = self.proposer.alloc_state_for(len(req.prompt) + req.max_new_tokens)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self._fail(req, exc)
                events.append(req.event())
                continue
            req.status = Status.RUNNING
            self._running.append(req)
            batch.append(req)
        if batch:
            try:
                self._prefill(batch, events)
            except BaseException as exc:
                # With tensor parallelism an out-of-memory may be one rank's alone: the ranks
                # could no longer take the same decisions, so it ends the step as any failure.
                if isinstance(exc, torch.OutOfMemoryError) and not (self.tp and self.tp.size > 1):
                    self._out_of_memory(batch, exc, events)
                    return
                self._fail_all(batch, exc, events)
                raise

    def _out_of_memory(self, batch: list[Request], exc: BaseException, events: list[StepEvent]) -> None:
        """A prefill ran out of device memory. A request prefilled alone fails (what it held
        back in the pools; the running requests go on). In a batch none can be blamed: each goes
        back to the head of the queue, in order, holding nothing, to be prefilled by itself."""
        if len(batch) == 1:
            self._fail_all(batch, exc, events)
            return
        for r in reversed(batch):
            self._release(r)
            r.status = Status.WAITING
            r.prefill_alone = True
            self._waiting.insert(0, r)

    def _fail_all(self, reqs: Sequence[Request], exc: BaseException, events: list[StepEvent]) -> None:
        """A step that raised out of its shared work fails every request of it still live."""
        for r in reqs:
            if not r.status.ended:
                self._fail(r, exc)
                events.append(r.event())

    def _prefill(self, batch: list[Request], events: list[StepEvent]) -> None:
        prop = self.proposer

        def commit(idx: list[int], spans: list[range], rows: Tensor) -> None:
            if self.speculate:  # the Hugging Face forward hands its rows over regardless
                prop.commit_ctx_batch([batch[i].state for i in idx], rows, spans)  # type: ignore[misc]

        if faults.active():
            faults.hit("prefill")
        logits = self.target.prefill([r.target_seq for r in batch], [r.prompt for r in batch], commit)
        firsts = first_tokens(batch, logits)
        lps = emitted_logprobs(batch, logits, [1] * len(batch), [[t] for t in firsts])
        now = time.perf_counter()
        for r, tok, lp in zip(batch, firsts, lps):
            r.ttft_s = now - r.submitted_at
            r.push([tok], lp)
        self._settle(batch, events)

    def _settle(self, reqs: list[Request], events: list[StepEvent]) -> None:
        """After new tokens were pushed: end the finished requests, report them all."""
        for r in reqs:
            if r.finish_reason is not None:
                self._end(r, Status.FINISHED, r.finish_reason)
            events.append(r.event())

    def _speculate(self, running: list[Request], events: list[StepEvent]) -> None:
        got = self._draft(running)
        keep = [i for i, r in enumerate(running) if r.status is Status.RUNNING]
        if len(keep) < len(running):
            events.extend(r.event() for r in running if r.status is Status.FAILED)
            if not keep:
                return
        live = [running[i] for i in keep]
        seqs = [r.target_seq for r in live]
        drafts, decided, logits, rows = verify(self.target, live, seqs, got, keep)
        news = [[*d[:a], nxt] if a else [nxt] for d, (a, nxt) in zip(drafts, decided)]
        lens = [len(d) + 1 for d in drafts]
        lps = emitted_logprobs(live, logits, lens, news)
        counts = [a + 1 for a, _ in decided]
        self.proposer.after_verify_batch([r.state for r in live], [a for a, _ in decided])  # type: ignore[misc]
        going, positions = push_verified(live, news, [len(d) for d in drafts], lps, self._lengths)
        if going:
            nexts = [live[i] for i in going]
            states = [r.state for r in nexts]
            kept = kept_rows(rows, lens, counts, going)
            # Drafts on the device mean every request was a plain argmax, so it still is (what
            # can change, stop tokens held back by min_tokens, only ever stops being held).
            if self.draft_ahead and (got.pending is not None or plain_argmax(nexts)):
                # Everything the next drafts need is recorded: the device drafts (from the
                # new context rows as they are) while the host writes them into the
                # accumulators, finishes this step and the caller handles its events.
                with self.proposer.committing(states, kept, positions):  # type: ignore[arg-type]
                    self.drafts.launch_ahead(nexts)
            else:
                self.proposer.commit_ctx_batch(states, kept, positions)  # type: ignore[arg-type]
        self.target.accept(seqs, counts)
        self._settle(live, events)

    def _draft(self, running: list[Request]) -> Drafts:
        """Drafts per request (as many as the draft-length policy chooses; see
        :func:`~blockdraft.engine.drafting.draft_requests`), left on the device where they
        may be (:attr:`device_drafts`), those launched ahead taken where there are; a request
        whose proposal fails is failed."""
        got = self.drafts.for_step(running)
        for r, exc in zip(running, got.errors):
            if exc is not None:
                self._fail(r, exc)
        return got

    def _end(self, req: Request, status: Status, reason: str, *, error: str | None = None) -> None:
        """Give back what ``req`` holds and mark it ended (idempotent)."""
        self._lengths.forget(req.id)
        self._release(req)
        if not req.status.ended:
            req.status = status
            req.finish_reason = req.finish_reason if status is Status.FINISHED else reason
            req.error = error

    def _release(self, req: Request) -> None:
        """Take ``req`` off the queues; give back its target sequence and proposer state."""
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

    def _fail(self, req: Request, exc: BaseException) -> None:
        req.exception = exc
        self._end(req, Status.FAILED, "error", error=f"{type(exc).__name__}: {exc}")


__all__ = ["SpeculativeEngine"]
