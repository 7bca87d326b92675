"""Building the serving engine and running the app under uvicorn until a signal stops it.

Shutdown on SIGINT or SIGTERM: uvicorn stops listening, the engine loop takes no new request
and lets the running and waiting ones go on for ``shutdown_timeout_s``, then cancels those
left (their streams end with an error event and ``[DONE]``; every page comes back). Once the
answers are out, the app's lifespan closes the engine and logs the pools. uvicorn's own
cancellation of hanging tasks stays as a backstop a few seconds later. uvicorn re-raises the
signal once it has shut down, so that a default handler would kill the process after all;
the handlers installed here take that second delivery, and the process exits normally.

TLS: with a key file and a certificate uvicorn serves HTTPS. Listening on an address that is
not loopback without an API key is logged as a warning: anyone who reaches the port can use
the server then.

With tensor parallelism this runs on rank 0 (the other ranks run
:func:`blockdraft.serve.follow`); an engine loop that fails there stops the server, since
every rank has to end then.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn

from blockdraft.engine import SpeculativeEngine
from blockdraft.parallel import TPGroup

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
BACKSTOP_S = 5  # after the drain's own deadline, uvicorn cancels what still hangs


def build_engine(
    target: Any,
    drafter: Any,
    *,
    max_seq_len: int,
    max_active: int,
    target_pages: int | None = None,
    drafter_pages: int | None = None,
    tp: TPGroup | None = None,
    speculate: bool = True,
) -> SpeculativeEngine:
    """The engine a server steps: ``max_active`` requests at once, proposals batched up to
    16 wide, pools sized by the engine's defaults unless given; with ``tp``, this rank's
    engine of a tensor-parallel group (every rank builds it with the same arguments); with
    ``speculate=False``, target-only decoding on the same runtime.

    Raises:
        ConfigError / TypeError / ValueError: bad settings.
    """
    kwargs: dict[str, Any] = {}
    if drafter_pages is not None:
        kwargs["num_pages"] = drafter_pages
    return SpeculativeEngine(target, drafter, max_seq_len=max_seq_len, max_active=max_active,
                             target_pages=target_pages, max_batch=min(max_active, 16), tp=tp,
                             speculate=speculate, **kwargs)


@contextmanager
def _signals_after_shutdown() -> Iterator[list[int]]:
    """Handlers for uvicorn to restore and re-deliver its stop signal to: they record it."""
    seen: list[int] = []

    def note(sig: int, frame: FrameType | None) -> None:
        seen.append(sig)

    previous = {sig: signal.signal(sig, note) for sig in STOP_SIGNALS}
    try:
        yield seen
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine loop to drain the moment a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._on_exit()


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (``127.0.0.1``, ``::1``,
    ``localhost``); ``0.0.0.0``, ``::`` and names that do not resolve are not."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
        return bool(found) and all(ipaddress.ip_address(str(a)).is_loopback for a in found)
    except (OSError, UnicodeError, ValueError):
        return False


def serve(app: Any, *, host: str, port: int, shutdown_timeout_s: float = 30.0,
          log_level: str = "info", ssl_keyfile: str | None = None,
          ssl_certfile: str | None = None) -> bool:
    """Serve ``app`` (from :func:`~blockdraft.serve.create_app`) on ``host:port`` until
    SIGINT/SIGTERM (call from the main thread); HTTPS with ``ssl_keyfile`` and
    ``ssl_certfile`` (PEM files).

    Returns:
        whether the server started (``False``: it could not listen, or the key or the
        certificate could not be loaded; uvicorn logged why).

    Raises:
        ValueError: one of ``ssl_keyfile`` / ``ssl_certfile`` without the other.
    """
    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise ValueError("TLS needs both ssl_keyfile and ssl_certfile")
    if getattr(app.state, "config", None) is not None and app.state.config.api_key is None \
            and not is_loopback(host):
        log.warning("blockdraft serve: listening on %s, which is not a loopback address, without "
                    "an API key: anyone who can reach port %d can use this server (set "
                    "--api-key or BLOCKDRAFT_API_KEY)", host, port)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=math.ceil(shutdown_timeout_s) + BACKSTOP_S,
                            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
    loop = app.state.loop
    server = _Server(config, lambda: loop.drain(shutdown_timeout_s))

    def stop_listening() -> None:
        server.should_exit = True  # uvicorn's main loop polls it

    loop.on_failure = stop_listening
    with _signals_after_shutdown() as seen:
        try:
            server.run()
        except SystemExit:  # uvicorn's way of saying start-up failed
            return False
        except (OSError, ValueError) as exc:  # ssl: a key or certificate it cannot load
            if server.started:
                raise
            log.error("blockdraft serve: cannot start: %s: %s", type(exc).__name__, exc)
            return False
    if seen:
        log.info("blockdraft serve: stopped by %s", signal.Signals(seen[0]).name)
    return bool(server.started)


__all__ = ["STOP_SIGNALS", "build_engine", "is_loopback", "serve"]
