"""Test-only fault injection: make the N-th allocation (or forward step) at a chosen site fail.

Off by default and nearly free when off: every hook in the library is one line,

    if faults.active():
        faults.hit("accumulator")

so a normal run pays one function call and a comparison per allocation site. Tests turn
it on with :func:`inject` (fail the ``nth`` hit of one site) or :func:`record` (count the hits of
every site without failing, to learn how many injection points a call has).

Sites (each raises what the real failure raises):

| site | where | raises |
| --- | --- | --- |
| ``pool_pages`` | before ``plan_precompute`` (in ``plan_proposals``, through :func:`hits`) | ``PoolExhaustedError`` |
| ``accumulator`` | a state's accumulator, and the staging copies of ``commit_ctx`` | ``torch.OutOfMemoryError`` |
| ``page_table_dev`` | the device page tables of a proposal | ``torch.OutOfMemoryError`` |
| ``kv_cache`` | the paged ctx K/V write into newly taken pages | ``torch.OutOfMemoryError`` |
| ``forward`` | the drafter forward of a proposal | ``RuntimeError`` |
| ``attention`` | each layer's paged block attention (a kernel) | ``RuntimeError`` |
| ``logits`` | the lm_head + draft selection of a proposal | ``RuntimeError`` |
| ``target_forward`` | the target's forward (prefill, verify, decode), runtime or HF | ``torch.OutOfMemoryError`` |
| ``target_pages`` | the runtime's pages for a new sequence | ``PoolExhaustedError`` |
| ``workspace`` | the runtime's per-forward buffers (the captured rows) | ``torch.OutOfMemoryError`` |
| ``prefill`` | the engine's prefill of the requests a step admits (before its forward) | ``torch.OutOfMemoryError`` |

Every injected exception's message starts with ``fault injection``. Not thread-safe: arm
faults from one thread at a time.

Arming needs a build of the extension with its test hooks (``blockdraft._core.TEST_HOOKS``:
``maturin develop --features test-hooks``, as ``bash .ci/dev`` builds it), because the
``pool_pages`` site inside ``plan_proposals`` is the core's ``fail_at`` argument, which release
wheels do not have. While a plan is armed, callers pass ``fail_at``; otherwise they leave it
out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

import blockdraft._core as _core
from blockdraft._core import PoolExhaustedError

PROPOSER_SITES: tuple[str, ...] = (
    "pool_pages",
    "accumulator",
    "page_table_dev",
    "kv_cache",
    "forward",
    "attention",
    "logits",
)
"""The sites inside the proposer (a test of the proposer alone arms these)."""
TARGET_SITES: tuple[str, ...] = ("target_forward", "target_pages", "workspace")
"""The sites of the target's side: its forward and the runtime's allocations."""
ENGINE_SITES: tuple[str, ...] = ("prefill",)
"""The engine's own sites: a prefill that runs out of memory (only the prefill hits it, so a
test can fail one request's prefill while others run)."""
SITES: tuple[str, ...] = PROPOSER_SITES + TARGET_SITES + ENGINE_SITES

_OOM_SITES = frozenset({"accumulator", "page_table_dev", "kv_cache", "target_forward", "workspace",
                        "prefill"})
_POOL_SITES = frozenset({"pool_pages", "target_pages"})


@dataclass
class FaultPlan:
    """What is armed: fail hit number ``nth`` (1-based) of ``site``; ``site=None`` never fails.

    Attributes:
        hits: hits seen so far, per site.
        fired: whether the fault was raised.
    """

    site: str | None
    nth: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    fired: bool = False


_ACTIVE: FaultPlan | None = None


def active() -> bool:
    """Whether a plan is armed (the library's hooks call :func:`hit` only then, so an unarmed
    run pays one check per site)."""
    return _ACTIVE is not None


def _error(site: str, nth: int) -> BaseException:
    msg = f"fault injection: {site} #{nth}"
    if site in _POOL_SITES:
        return PoolExhaustedError(f"{msg} (simulated pool exhaustion)")
    if site in _OOM_SITES:
        return torch.OutOfMemoryError(f"CUDA out of memory ({msg}, simulated)")
    return RuntimeError(f"{msg} (simulated kernel/forward failure)")


def hit(site: str) -> None:
    """Called by the library hooks (only while a plan is armed): count, and raise on the N-th.

    Raises:
        PoolExhaustedError / torch.OutOfMemoryError / RuntimeError: the armed fault.
    """
    plan = _ACTIVE
    if plan is None:
        return
    plan.hits[site] += 1
    if not plan.fired and site == plan.site and plan.hits[site] == plan.nth:
        plan.fired = True
        raise _error(site, plan.nth)


def hits(site: str, count: int) -> int | None:
    """``count`` hits of ``site`` at once, for a hook that covers many sequences in one core
    call (``pool_pages`` in ``plan_proposals``): the 0-based index of the hit that fires the
    armed fault, which the caller hands to the core to fail there, or ``None``."""
    plan = _ACTIVE
    if plan is None:
        return None
    before = plan.hits[site]
    plan.hits[site] += count
    if not plan.fired and site == plan.site and before < plan.nth <= before + count:
        plan.fired = True
        return plan.nth - before - 1
    return None


@contextmanager
def inject(site: str, nth: int) -> Iterator[FaultPlan]:
    """Arm one fault for the duration of the block: hit number ``nth`` of ``site`` raises.

    Raises:
        ValueError: an unknown site or ``nth < 1``.
        RuntimeError: another plan is already armed, or the extension has no test hooks.
    """
    _require_test_hooks()
    if site not in SITES:
        raise ValueError(f"site must be one of {SITES}, not {site!r}")
    if nth < 1:
        raise ValueError(f"nth must be >= 1, not {nth}")
    yield from _armed(FaultPlan(site, nth))


@contextmanager
def record() -> Iterator[FaultPlan]:
    """Count hits of every site for the duration of the block, failing none.

    Raises:
        RuntimeError: another plan is already armed, or the extension has no test hooks.
    """
    _require_test_hooks()
    yield from _armed(FaultPlan(None))


def _require_test_hooks() -> None:
    # Read at call time (not imported by name) so a test can switch it off.
    if not _core.TEST_HOOKS:
        raise RuntimeError(
            "this build of blockdraft._core has no test hooks; build it with "
            "`maturin develop --features test-hooks` (as `bash .ci/dev` does)"
        )


def _armed(plan: FaultPlan) -> Iterator[FaultPlan]:
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a fault plan is already armed")
    _ACTIVE = plan
    try:
        yield plan
    finally:
        _ACTIVE = None
