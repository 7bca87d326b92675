"""Typed surface of the Rust core (``blockdraft._core``).

The core owns all bookkeeping of the proposer and never touches device memory: which pool
pages a sequence holds, which context rows it keeps, at which positions, how many of them have
K/V in the paged cache, and whether a batch is accepted. Python owns the tensors and moves them
according to the plans returned here.

Users import these names from :mod:`blockdraft`, never from ``blockdraft._core``.
"""

from collections.abc import Sequence
from typing import Any, Final, NoReturn, final

__version__: Final[str]

ENV_CTX_CAP: Final[str]
"""Name of the environment variable holding the context-window cap (``BLOCKDRAFT_DFLASH_CTX_CAP``)."""

DEFAULT_CTX_CAP: Final[int]
"""Cap used when the environment variable is unset (16384 tokens)."""

ENV_SLIDE: Final[str]
"""Name of the environment variable holding the slide fraction (``BLOCKDRAFT_DFLASH_SLIDE``)."""

DEFAULT_SLIDE: Final[float]
"""Slide fraction used when the environment variable is unset (0.125 of the window)."""

PAD_SLOT: Final[int]
"""Slot value that marks a row the K/V store must skip (-1)."""

TEST_HOOKS: Final[bool]
"""Whether this build has the test-only entry points (the ``test-hooks`` cargo feature:
``_panic_for_tests`` and ``plan_proposals(fail_at=...)``). ``maturin develop --features
test-hooks`` (``bash .ci/dev``) builds them in; release wheels (``maturin build --release``) do
not."""

class BlockdraftError(Exception):
    """Base class of every error blockdraft raises on purpose."""

class PoolExhaustedError(BlockdraftError):
    """The shared page pool cannot satisfy an allocation; nothing was changed."""

class InvalidStateError(BlockdraftError):
    """A state or plan was used out of its lifecycle (freed, foreign, stale, or bad pages)."""

class CheckpointError(BlockdraftError):
    """A drafter checkpoint is missing, unreadable or inconsistent."""

class ConfigError(BlockdraftError, ValueError):
    """A configuration value (for example an environment variable) cannot be used."""

def ctx_window(
    max_seq_len: int,
    block_size: int,
    budget_tokens: int | None = None,
    cap: int | None = None,
) -> int:
    """Rows of the per-sequence context accumulator.

    ``ceiling = max_seq_len`` if the cap is 0, else ``min(max_seq_len, cap)``;
    ``window = min(ceiling, budget_tokens + block_size + 1)`` (saturating). An unknown budget
    (``None``) means the ceiling.

    Args:
        max_seq_len: longest sequence the target serves (>= 1).
        block_size: drafter block size B (>= 1).
        budget_tokens: prompt plus max new tokens when known (>= 0), else ``None``.
        cap: explicit cap (0 = uncapped); ``None`` reads ``BLOCKDRAFT_DFLASH_CTX_CAP``
            (default 16384).

    Returns:
        The window in rows (>= 1).

    Raises:
        ValueError: a negative or zero size.
        ConfigError: the environment variable is not a non-negative integer.
    """

def ctx_ceiling(max_seq_len: int, cap: int | None = None) -> int:
    """``max_seq_len`` if the cap is 0, else ``min(max_seq_len, cap)``; ``cap=None`` reads the env.

    Raises:
        ValueError: ``max_seq_len < 1`` or a negative cap.
        ConfigError: the environment variable is not a non-negative integer.
    """

def read_ctx_cap() -> int:
    """The cap from ``BLOCKDRAFT_DFLASH_CTX_CAP`` (default 16384, 0 = uncapped).

    Raises:
        ConfigError: the value is not a non-negative integer.
    """

def read_slide() -> float:
    """The slide fraction from ``BLOCKDRAFT_DFLASH_SLIDE`` (default 0.125): the share of the
    window a slide leaves free beyond the rows of the commit that caused it.

    Raises:
        ConfigError: the value is not a fraction in ``[0, 1)``.
    """

def slide_room(window: int, fraction: float | None = None) -> int:
    """Rows a slide of a ``window``-row context leaves free: ``floor(window * fraction)``,
    at most ``window - 1``. ``fraction=None`` reads ``BLOCKDRAFT_DFLASH_SLIDE``.

    Raises:
        ValueError: ``window < 1`` or a fraction outside ``[0, 1)``.
        ConfigError: the environment variable is not a fraction in ``[0, 1)``.
    """

@final
class BlockPool:
    """A fixed set of ``num_pages`` K/V pages (pages) of ``page_size`` tokens, shared by
    sequences.

    Thread-safe: every method takes an internal lock and releases the GIL while it works.
    Allocation is all-or-nothing; freeing validates every id before changing anything.
    """

    def __new__(cls, num_pages: int, page_size: int) -> BlockPool:
        """Raises ``ValueError`` when ``num_pages < 1`` or ``page_size < 1``, or when the
        bookkeeping of ``num_pages`` pages cannot be allocated (never an abort)."""

    @property
    def num_pages(self) -> int: ...
    @property
    def page_size(self) -> int:
        """Tokens per page."""
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    def alloc(self, n: int) -> list[int]:
        """Take ``n`` pages (``n >= 0``).

        Raises:
            PoolExhaustedError: fewer than ``n`` pages are free; nothing changed.
            ValueError: ``n`` is negative.
        """

    def free(self, pages: list[int]) -> None:
        """Return ``pages`` to the pool.

        Raises:
            InvalidStateError: an id is out of range (negative ids included), not allocated, or
                listed twice; nothing changed.
            TypeError: ``pages`` is not a sequence of ints.
        """

    def is_allocated(self, page: int) -> bool:
        """Whether ``page`` is currently allocated (``False`` for out-of-range ids)."""

    def check_invariants(self) -> None:
        """Verify the pool's internal consistency (free list vs allocation bitmap).

        Raises:
            InvalidStateError: describing the first violation found.
        """

@final
class SlidePlan:
    """What an append must do to the accumulator before writing new rows.

    Move source rows ``[src_start, src_start + keep)`` to ``[0, keep)``, in order. Their
    positions are kept; ``ctx_committed`` becomes 0, and the state's pages go back to the pool
    (their K/V is recomputed by the next precompute).
    """

    @property
    def src_start(self) -> int: ...
    @property
    def keep(self) -> int: ...

@final
class AppendPlan:
    """The accumulator work of one ``ContextState.plan_append`` call.

    Apply the optional slide, then write the new rows at rows ``[dst_start, dst_start + n_rows)``;
    then call ``ContextState.apply_append(plan)``. A plan is valid only for the state and the
    state version it was made for.
    """

    @property
    def slide(self) -> SlidePlan | None: ...
    @property
    def dst_start(self) -> int: ...
    @property
    def n_rows(self) -> int: ...
    @property
    def positions(self) -> list[int]: ...

@final
class PrecomputePlan:
    """K/V work for context rows ``[row_start, row_end)`` of one state.

    ``new_pages`` were already taken from the pool; ``slots[i]`` is the paged-cache slot
    (``page_id * page_size + offset``) of row ``row_start + i`` and ``positions[i]`` its
    position. Confirm with ``ContextState.confirm_precompute`` after the K/V is written, or
    abort with ``ContextState.abort_precompute`` (dropping an unresolved plan aborts it too),
    which returns ``new_pages`` and leaves the state as it was.
    """

    @property
    def row_start(self) -> int: ...
    @property
    def row_end(self) -> int: ...
    @property
    def new_pages(self) -> list[int]: ...
    @property
    def slots(self) -> list[int]: ...
    @property
    def positions(self) -> list[int]: ...
    @property
    def resolved(self) -> bool:
        """Whether the plan was confirmed or aborted."""

@final
class ContextState:
    """Bookkeeping of one sequence's drafter context, without its device memory.

    Holds the window, the context rows' positions, how many have K/V in the paged cache, the
    page table (pages from ``pool``), and the proposal/verify counters (``seq_len``,
    ``last_num_drafted``, ...). Thread-safe (internal lock).
    Call ``free`` explicitly; a state that is garbage-collected unfreed still returns its
    pages, as a safety net against leaks.
    """

    def __new__(
        cls, pool: BlockPool, window: int, owner: int = 0, slide_room: int = 0
    ) -> ContextState:
        """A fresh state with an empty context of ``window`` rows (``window >= 1``).

        ``owner`` tags the state with the id of the proposer that made it, so a proposer can
        reject states of another one. ``slide_room`` (``0 <= slide_room < window``) is how many
        rows every slide leaves free beyond the commit's (0: slide by exactly what the commit
        needs).

        Raises:
            ValueError: ``window < 1`` or ``slide_room`` negative or not below the window.
        """

    @property
    def owner(self) -> int: ...
    @property
    def window(self) -> int: ...
    @property
    def slide_room(self) -> int:
        """Rows a slide leaves free beyond the rows of the commit that caused it."""

    @property
    def ctx_len(self) -> int: ...
    @property
    def ctx_committed(self) -> int: ...
    @property
    def ctx_positions(self) -> list[int]: ...
    @property
    def last_position(self) -> int | None:
        """Position of the newest context row (``None`` while empty); O(1), unlike
        ``ctx_positions[-1]``, which copies the whole list."""

    @property
    def page_table(self) -> list[int]: ...
    @property
    def num_pages(self) -> int:
        """``len(page_table)``; pages of an unresolved ``PrecomputePlan`` are not included."""

    @property
    def seq_len(self) -> int: ...
    @property
    def prefill_done(self) -> bool: ...
    @property
    def last_num_drafted(self) -> int: ...
    @property
    def last_num_accepted(self) -> int: ...
    @property
    def skip_next_decode_append(self) -> bool: ...
    @property
    def ctx_count_drafter(self) -> int: ...
    @property
    def max_ctx_count_drafter(self) -> int: ...
    @property
    def freed(self) -> bool: ...
    @property
    def version(self) -> int:
        """Increases on every change; plans carry the version they were made for."""

    def plan_append(self, positions: list[int]) -> AppendPlan:
        """Plan appending ``len(positions)`` rows (changes nothing).

        Positions must be non-negative, strictly increasing, and greater than the last context
        position. When the rows would overflow the window, the plan slides first, keeping the
        newest ``max(0, window - slide_room - n)`` rows (never cutting a new one).

        Raises:
            ValueError: empty, negative, unordered positions, or more rows than the window.
            InvalidStateError: the state was freed.
        """

    def apply_append(self, plan: AppendPlan) -> None:
        """Commit a plan from ``plan_append`` after the accumulator was written.

        A slide resets ``ctx_committed`` to 0 and returns the state's pages to the pool. Any
        change makes an outstanding ``PrecomputePlan`` stale (it can then only be aborted).

        Raises:
            InvalidStateError: the plan is for another state or an older version, or the state
                was freed.
        """

    def plan_precompute(self) -> PrecomputePlan:
        """Plan K/V for rows ``[ctx_committed, ctx_len)``, taking the pages they need.

        Clamps ``ctx_committed`` to ``ctx_len`` first. A plan with no rows takes no pages.

        Raises:
            PoolExhaustedError: the pool cannot supply the pages; nothing changed.
            InvalidStateError: the state was freed, or another plan is outstanding.
        """

    def confirm_precompute(self, plan: PrecomputePlan) -> None:
        """The K/V of the plan's rows is written: adopt its pages, ``ctx_committed = row_end``.

        Raises:
            InvalidStateError: the plan is foreign, stale, or already resolved, or the state was
                freed.
        """

    def abort_precompute(self, plan: PrecomputePlan) -> None:
        """Give the plan's pages back; the state is as before ``plan_precompute``.

        Aborting an already-resolved plan (or one whose state was freed) does nothing.

        Raises:
            InvalidStateError: the plan belongs to another state.
        """

    def slot_mapping(self) -> list[int]:
        """Paged-cache slot of each committed row ``[0, ctx_committed)``."""

    def note_propose(self, position: int, num_drafted: int) -> None:
        """Record a proposal: ``seq_len = position + 1``, ``last_num_drafted``, prefill done.

        Raises:
            InvalidStateError: the state was freed.
            ValueError: negative values.
        """

    def after_verify(self, num_accepted: int) -> None:
        """Record a verification: ``last_num_accepted = num_accepted``, ``last_num_drafted = 0``.

        Raises:
            InvalidStateError: the state was freed.
            ValueError: ``num_accepted`` exceeds the drafts of the last proposal.
        """

    def free(self, owner: int | None = None) -> bool:
        """Return every page (including an unresolved plan's) and reset every counter.

        Idempotent: returns ``True`` the first time, ``False`` afterwards (nothing done).
        With ``owner``, the state must belong to that proposer (checked first, on a freed state
        too).

        Raises:
            InvalidStateError: ``owner`` is given and the state belongs to another proposer
                ("free: the state belongs to another proposer (owner A, expected B)").
            ValueError: a negative ``owner``.
        """

    def check_invariants(self) -> None:
        """Verify the state's invariant and that every held page is allocated in the pool.

        The invariant: ``0 <= ctx_committed <= ctx_len <= window``, positions strictly
        increasing and non-negative, ``num_pages == ceil(ctx_committed / page_size)``, no page
        held twice, and a freed state equal to a fresh one.

        Raises:
            InvalidStateError: describing the first violation found.
        """

def propose_batch_max(batched_path: bool, width: int, max_batch: int) -> int:
    """1 without a batched path or when ``width < 2``; else ``min(width, max(max_batch, 1))``."""

def batch_decline_reason(
    n: int,
    max_batch: int,
    batched_path: bool,
    num_positions: int,
    num_states: int,
) -> str | None:
    """Why ``propose_batch`` must decline before doing any work, or ``None`` to proceed.

    Declines: ``n < 2``, ``n > max_batch``, ``num_positions != n``, ``num_states != n``, or no
    batched path.
    """

def split_bands(
    tokens: list[int],
    n: int,
    block_size: int,
    has_mask_token: bool,
    draft_cap: int | None = None,
) -> list[list[int]] | None:
    """Split ``n * block_size`` output tokens into ``n`` bands of drafts.

    Each band is ``tokens[i*block_size:(i+1)*block_size]``; with a mask token its row 0 (the
    anchor) is dropped; at most ``draft_cap`` drafts are kept (``None`` = all). Returns ``None``
    when fewer than ``n * block_size`` tokens were given (the caller declines).

    Raises:
        ValueError: ``n < 1``, ``block_size < 1`` or ``draft_cap < 1``.
    """

# whole-step entry points
# One call does a step's bookkeeping for every sequence of a batch (rust/blockdraft-py/src/step.rs).

def plan_proposals(
    what: str,
    states: Sequence[ContextState],
    tokens: Sequence[int],
    positions: Sequence[int],
    vocab: int,
    owner: int,
    fail_at: int | None = None,
) -> list[PrecomputePlan]:
    """Check every state and anchor of a proposal over ``states``, then plan every sequence's
    ctx K/V.

    All or nothing: on any error no plan stays outstanding. ``what`` names the caller in error
    messages; ``owner`` is the proposer every state must belong to; every state must have
    committed context (the lifecycle is alloc, commit context, propose); a token must lie in
    ``[0, vocab)``, a position in ``[0, 2**62)`` after the state's last context position.

    ``fail_at`` exists only in a build with test hooks (``TEST_HOOKS``; a release build takes
    six arguments): fault injection (``blockdraft.faults.hits``), planning sequence ``fail_at``
    raises ``PoolExhaustedError``. Pass it only while a fault plan is armed.

    Raises:
        InvalidStateError: not a ``ContextState`` ("{what}: not a DFlash proposer state"),
            another proposer's ("{what}: the state belongs to another proposer (owner A,
            expected B)"), freed ("{what}: the state was freed"), or with an empty context
            ("{what}: the state has no committed context (commit_ctx before propose)").
        TypeError: a token or position that is not an int (``bool`` included).
        ValueError: a bad token or position, a state given twice, lengths that differ.
        PoolExhaustedError: not enough free pages for every plan.
    """

def confirm_proposals(
    plans: list[PrecomputePlan], positions: Sequence[int], counts: int | Sequence[int]
) -> None:
    """The drafts exist: confirm each plan and record its proposal at ``positions[i]`` with
    ``counts[i]`` drafts (an int: the same for all). Stops at the first error.

    Raises:
        InvalidStateError: a stale, foreign or resolved plan, or a freed state.
    """

def abort_plans(plans: list[PrecomputePlan]) -> None:
    """Give back every plan's pages; a resolved plan is ignored."""

def verify_all(what: str, states: Sequence[ContextState], accepted: Sequence[int], owner: int) -> None:
    """``after_verify(accepted[i])`` on every state of proposer ``owner``; stops at the first
    error (the states before it are recorded). Every state's owner is checked before any is
    recorded. With one state it costs about as much as ``ContextState.after_verify``.

    Raises:
        InvalidStateError: not a ``ContextState``, another proposer's, or freed (the messages
            of :func:`plan_proposals`).
        ValueError: a count above the last proposal's drafts or negative, a state given twice,
            lengths that differ.
    """

@final
class AppendBatch:
    """The accumulator work of one commit over many states (from :func:`plan_appends`).

    Entries are the states that get rows, in the call's order.
    """

    @property
    def n_rows(self) -> int:
        """Rows given in all (cut ones included)."""
    @property
    def entries(self) -> list[tuple[int, int, int, int]]:
        """Per entry ``(index of its state in the call, its first kept row in the call's rows,
        its first accumulator row to write, rows kept)``."""
    @property
    def kept(self) -> int:
        """Rows kept in all."""
    @property
    def slides(self) -> list[tuple[int, int, int]]:
        """``(entry, src_start, keep)`` of each slide to do before writing the rows."""
    def row_map(self) -> list[int]:
        """Per kept row its entry, then per kept row its destination row (the accumulator
        kernel's map)."""
    def apply(self) -> None:
        """The rows are written: record every append.

        Raises:
            InvalidStateError: a plan gone stale (the state changed since it was planned).
        """

def plan_appends(
    what: str, states: Sequence[ContextState], positions: Sequence[Sequence[int]], owner: int
) -> AppendBatch:
    """Plan a commit of ``positions[i]`` (may be empty) to each state; a state given more rows
    than its window keeps only the newest. Changes nothing.

    Raises:
        InvalidStateError: not a ``ContextState``, another proposer's, or freed.
        TypeError: positions that are not ints.
        ValueError: negative, unordered or not after the context; a state given twice;
            lengths that differ.
    """

@final
class GraphMeta:
    """The graph path's metadata writer over a pinned host tensor (``blockdraft_core::step``):
    per call every sequence's scalars, page table and staged context rows, with a mirror of
    what each row holds so unchanged tables are not rewritten."""

    @staticmethod
    def layout(width: int, block_size: int) -> tuple[int, int, int, int, int]:
        """The matrix's columns for tables of ``width`` entries and blocks of ``block_size`` rows:
        ``(table_col, pos_col, slot_col, src_col, cols)``. The layout is the core's; callers
        read it here instead of spelling it again."""
    def __new__(
        cls, host: Any, width: int, block_size: int, mask_id: int, stride: int = 0
    ) -> GraphMeta:
        """``host``: a contiguous CPU int64 tensor ``[rows, layout(width, block_size)[4]]``, written
        in place from now on (initialised at once; keep it private to the writer); ``stride``:
        bytes between two rows of a source (see ``fill``'s ``bases``).

        Raises:
            ValueError: another shape, dtype or device, or a zero size.
        """
    @property
    def staged(self) -> int:
        """Staged rows of the last filled call."""
    def fill(
        self,
        plans: list[PrecomputePlan],
        tokens: list[int],
        positions: list[int],
        bases: list[int] | None = None,
    ) -> tuple[int, list[int], list[tuple[int, int, int]]] | None:
        """Write one call: the outstanding plans of its sequences and their anchors; with
        ``bases``, each sequence's source base address: the source column then holds
        ``base + row * stride`` for each staged row (the graph gathers the rows itself, and
        ``staged_rows`` is empty).

        Returns ``(staged, eager, staged_rows)``: staged row count, the sequences whose plans
        are longer than ``block_size`` (the caller stores their K/V first), and
        ``(sequence, row_start, row_end)`` of each staged plan in order; ``None`` when a table
        is wider than ``width`` (the call takes the plain path).

        Raises:
            ValueError: more plans than rows, or lengths that differ.
        """

# target K/V pages
# The target runtime's page tables (rust/blockdraft-core/src/pages.rs, pages_step.rs).

@final
class SeqPages:
    """One target sequence's K/V pages and its committed and pending token counts.

    Every page the sequence may need (``ceil(capacity / page_size)``) is taken from ``pool`` at
    creation, so a running sequence never waits for memory; the page table never changes until
    ``free``. Token position ``p`` lives in slot ``pages[p // page_size] * page_size +
    p % page_size``. A forward (:func:`plan_forward`) over ``r`` rows writes positions
    ``length .. length + r - 1`` and leaves them pending; :meth:`accept` commits the first
    ``k``. Rows not accepted cost nothing: the next forward writes the same slots again.

    Thread-safe (internal lock). Call ``free`` explicitly; a sequence that is garbage-collected
    unfreed still returns its pages, as a safety net against leaks. Every operation on a freed
    sequence raises ``InvalidStateError`` ("...: the state was freed") except ``free``; the
    getters still answer (``length == pending == num_pages == 0``).
    """

    def __new__(cls, pool: BlockPool, capacity: int, owner: int = 0) -> SeqPages:
        """A sequence of up to ``capacity`` tokens (prompt + new tokens + look-ahead).

        Args:
            pool: the pool its pages come from (the target's own, or any other).
            capacity: tokens it may ever hold (>= 1).
            owner: tag of the runtime that made it, so whole-step calls can refuse another's.

        Raises:
            PoolExhaustedError: fewer than ``ceil(capacity / page_size)`` free pages; nothing
                was taken.
            ValueError: ``capacity < 1`` or a negative ``owner``.
            TypeError: ``pool`` is not a ``BlockPool``, or a size is not an int.
        """

    @property
    def owner(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def page_size(self) -> int:
        """Tokens per page (the pool's)."""
    @property
    def length(self) -> int:
        """Tokens whose K/V are committed (positions ``0 .. length - 1``)."""
    @property
    def pending(self) -> int:
        """Rows the last forward wrote beyond ``length``, not accepted yet."""
    @property
    def pages(self) -> list[int]:
        """The page table in position order (empty once freed)."""
    @property
    def num_pages(self) -> int:
        """``ceil(capacity / page_size)`` while live, 0 once freed."""
    @property
    def freed(self) -> bool: ...
    def slot(self, pos: int) -> int:
        """The paged-cache slot of token position ``pos``.

        Raises:
            ValueError: ``pos`` outside ``0 .. capacity - 1``.
            InvalidStateError: the sequence was freed.
        """

    def accept(self, k: int) -> None:
        """Commit the first ``k`` pending rows: ``length += k``, ``pending = 0``.

        Raises:
            ValueError: ``k`` negative or above ``pending``; nothing changed.
            InvalidStateError: the sequence was freed.
        """

    def free(self, owner: int | None = None) -> bool:
        """Return every page to the pool; ``length`` and ``pending`` become 0.

        Idempotent: returns ``True`` the first time, ``False`` afterwards (nothing done).
        With ``owner``, the sequence must belong to that owner (checked first, on a freed
        sequence too).

        Raises:
            InvalidStateError: ``owner`` is given and the sequence belongs to another ("free:
                the sequence belongs to another owner (owner A, expected B)").
            ValueError: a negative ``owner``.
        """

    def check_invariants(self) -> None:
        """Verify the sequence against its pool.

        Live: exactly ``ceil(capacity / page_size)`` distinct pages, each allocated in the pool,
        and ``length + pending <= capacity``. Freed: no page, ``length == pending == 0``.

        Raises:
            InvalidStateError: describing the first violation found.
        """

@final
class ForwardPlan:
    """What one forward over many sequences writes and reads (from :func:`plan_forward`), in
    the call's order; plain data.

    Row ``j`` of the forward (sequence ``i``'s rows are ``q_starts[i] .. q_starts[i + 1] - 1``)
    is at token position ``positions[j]`` and writes its K/V to slot ``slots[j]``; sequence
    ``i`` attends to ``kv_lens[i]`` tokens through its page table.
    """

    @property
    def n_rows(self) -> int:
        """New rows in all (``len(positions)``)."""
    @property
    def positions(self) -> list[int]:
        """Token position of every new row, sequence after sequence."""
    @property
    def slots(self) -> list[int]:
        """Paged-cache slot of every new row (same order)."""
    @property
    def q_starts(self) -> list[int]:
        """``n + 1`` cumulative row offsets."""
    @property
    def kv_lens(self) -> list[int]:
        """Per sequence ``length + rows``: the tokens its new rows attend to."""
    @property
    def max_rows(self) -> int:
        """The most new rows of any sequence (0 for an empty call)."""
    @property
    def max_pages(self) -> int:
        """The most pages any sequence's forward reads (0 for an empty call)."""
    def page_table(self, width: int) -> list[int]:
        """The ``n x width`` page table, row-major: each sequence's pages that hold its first
        ``kv_lens[i]`` tokens (those its forward reads and writes; the rest of its reservation
        is left out), zero padded.

        Raises:
            ValueError: ``width < max_pages`` (or negative).
        """

    def fill(self, out: Any, width: int, pad: bool = True) -> None:
        """Write :meth:`page_table` into ``out`` in place, without building a Python list.

        Args:
            out: a contiguous CPU ``torch.int32`` tensor ``[n, width]`` (a plain
                ``torch.Tensor``, not a subclass); the caller must not have an asynchronous
                copy out of it in flight.
            width: entries per row (>= ``max_pages``).
            pad: zero each row past its pages (as :meth:`page_table`); ``False`` writes only
                the pages and leaves the rest of each row as it was, for a caller whose
                kernels never read past a sequence's ``kv_lens[i]`` tokens (a table as wide as
                ``max_seq_len`` then costs only the pages in use).

        Raises:
            TypeError: ``out`` is not a ``torch.Tensor``.
            ValueError: another dtype, device, shape or memory layout, ``width < max_pages``, or
                a page id beyond int32; ``out`` is untouched.
        """

def plan_forward(
    what: str, seqs: Sequence[SeqPages], rows: Sequence[int], owner: int
) -> ForwardPlan:
    """Plan one forward over ``rows[i]`` new rows of each sequence: check every sequence, then
    set each one's ``pending = rows[i]`` (a previous pending count is replaced). Allocates
    nothing.

    ``what`` names the caller in error messages, which name the sequence's index too ("forward:
    sequence 2: the state was freed"); ``owner`` is the owner every sequence must have. All or
    nothing: on any error no sequence changed.

    Raises:
        InvalidStateError: not a ``SeqPages``, another owner's, or freed.
        TypeError: a row count that is not an int (``bool`` included).
        ValueError: a row count below 1 or past the sequence's capacity (the message names
            the capacity), a sequence given twice, lengths that differ.
    """

def accept_rows(what: str, seqs: Sequence[SeqPages], counts: Sequence[int], owner: int) -> None:
    """``accept(counts[i])`` on every sequence, after checking every one. All or nothing.

    Raises:
        InvalidStateError: not a ``SeqPages``, another owner's, or freed (the messages of
            :func:`plan_forward`).
        TypeError: a count that is not an int.
        ValueError: a count negative or above the sequence's ``pending``, a sequence given
            twice, lengths that differ.
    """

def free_all(what: str, seqs: Sequence[SeqPages], owner: int) -> int:
    """Free every sequence after checking that every one belongs to ``owner``; returns how many
    were live (freed ones are skipped).

    Raises:
        InvalidStateError: not a ``SeqPages`` or another owner's; nothing freed.
        ValueError: a sequence given twice.
    """

def _panic_for_tests(pool: BlockPool | None = None) -> NoReturn:
    """Panic inside the extension: raises pyo3's ``PanicException``. Only in a build with test
    hooks (``TEST_HOOKS``); release builds do not have it.

    With ``pool``, the panic happens while the pool's lock is held; every later call on that pool
    (or on a state drawing from it) raises ``InvalidStateError`` ("poisoned").
    """
