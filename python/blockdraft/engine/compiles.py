"""Counting kernel compiles and CUDA-graph captures, to find those that happen after warm-up.

A compile or a capture on the request path costs a request hundreds of milliseconds to
seconds; after :meth:`~blockdraft.SpeculativeEngine.warmup` there should be none. Triton
compiles are counted process-wide by a hook Triton calls after each compile of a kernel
variant this process has not built yet (a variant loaded from Triton's disk cache counts
too: it is still host work on the request path). Triton 3.4 and later take the hook as
``triton.knobs.runtime.jit_post_compile_hook``, 3.3 as ``JITFunction.compiled_hook``; a hook
installed before this one is still called. Under Triton's CPU interpreter nothing compiles.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_compiles = 0
_recent: deque[tuple[int, str]] = deque(maxlen=64)  # (compile number, kernel name)
_installed: bool | None = None  # None: not tried yet; False: this Triton has no hook


def _on_compile(previous: Callable[..., Any] | None) -> Callable[..., Any]:
    def hook(*args: Any, **kwargs: Any) -> Any:
        global _compiles
        fn = kwargs.get("fn")
        name = str(getattr(fn, "name", None) or kwargs.get("repr") or "a Triton kernel")
        with _lock:
            _compiles += 1
            _recent.append((_compiles, name))
        return previous(*args, **kwargs) if previous is not None else None

    return hook


def install() -> bool:
    """Install the compile hook once (idempotent); ``False`` when Triton is not importable
    or exposes no hook this module knows."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        _installed = False
        try:
            import triton  # type: ignore[import-untyped]
        except Exception:  # noqa: BLE001 - no Triton: nothing compiles
            return False
        knobs = getattr(triton, "knobs", None)
        runtime = getattr(knobs, "runtime", None)
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            runtime.jit_post_compile_hook = _on_compile(runtime.jit_post_compile_hook)
            _installed = True
        else:
            from triton.runtime.jit import JITFunction  # type: ignore[import-untyped]

            if hasattr(JITFunction, "compiled_hook"):
                JITFunction.compiled_hook = _on_compile(JITFunction.compiled_hook)
                _installed = True
        return _installed


def triton_compiles() -> int:
    """Triton kernel variants compiled in this process since the hook was installed."""
    install()
    return _compiles


class CompileWatch:
    """Compiles and captures since :meth:`arm` (warm-up's end), with a warning per new one.

    Args:
        captures: the CUDA graphs captured so far (over every graph path it watches).
    """

    def __init__(self, captures: Callable[[], int]) -> None:
        install()
        self._captures = captures
        self.armed = False
        self._compile_base = 0
        self._capture_base = 0
        self._compiles_seen = 0
        self._captures_seen = 0

    def arm(self) -> None:
        """Count from now on."""
        self._compile_base = self._compiles_seen = triton_compiles()
        self._capture_base = self._captures_seen = self._captures()
        self.armed = True

    @property
    def compiles(self) -> int:
        """Triton compiles since :meth:`arm` (0 before it)."""
        return triton_compiles() - self._compile_base if self.armed else 0

    @property
    def captures(self) -> int:
        """CUDA-graph captures since :meth:`arm` (0 before it)."""
        return self._captures() - self._capture_base if self.armed else 0

    def check(self) -> None:
        """Log a warning for each compile and capture since the last check (after arming)."""
        if not self.armed:
            return
        compiles = triton_compiles()
        if compiles > self._compiles_seen:
            with _lock:
                names = [n for k, n in _recent if k > self._compiles_seen]
            for name in names or ["a Triton kernel"]:
                log.warning("%s compiled after warm-up (a request waited for it)", name)
            self._compiles_seen = compiles
        captures = self._captures()
        if captures > self._captures_seen:
            log.warning("%d CUDA graph(s) captured after warm-up (a request waited for it)",
                        captures - self._captures_seen)
            self._captures_seen = captures


def graph_captures(proposer: Any, runtime: Any) -> int:
    """CUDA graphs a proposer and a target runtime (``None``: none) have captured so far."""
    runner = proposer.graph_runner
    graphs = runtime.graphs if runtime is not None else None
    return (runner.captures if runner is not None else 0) + (graphs.captures if graphs is not None else 0)


__all__ = ["CompileWatch", "graph_captures", "install", "triton_compiles"]
