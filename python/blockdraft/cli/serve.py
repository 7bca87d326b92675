"""``blockdraft serve``: the OpenAI-compatible server (:mod:`blockdraft.serve`) on a pair.

Without ``--target/--drafter`` it serves the built-in trained pair. Flags are checked, and
the ``serve`` extra's presence too, before any weights load.

``--tp N`` splits the target over N ranks: the command starts them itself
(:func:`blockdraft.parallel.launch`, which stops them all and names the rank when one fails,
and passes SIGINT/SIGTERM to rank 0), or, run under ``torchrun --nproc-per-node N``, each
process is one rank. Rank 0 serves HTTP and runs the engine loop; the other ranks follow it
(:func:`blockdraft.serve.follow`).

Access: ``--api-key`` (or ``BLOCKDRAFT_API_KEY``) makes every route but ``/health`` need
``Authorization: Bearer <key>`` (``/metrics`` too unless ``--public-metrics``);
``--max-body-bytes`` bounds what a client may send; ``--ssl-keyfile``/``--ssl-certfile``
serve HTTPS. The key file and certificate are loaded once before the weights, so a bad pair
fails with one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blockdraft.cli.common import (
    CliError,
    pick_device,
    progress_bar,
    require_min,
    tp_device,
    tp_sizes,
)
from blockdraft.errors import error_line
from blockdraft.pair.load import BUILTIN_MODEL_NAME, PairSource, find_pair
from blockdraft.parallel import DEFAULT_TIMEOUT_S as DEFAULT_TP_TIMEOUT_S

SERVE_DEPENDENCIES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client",
                      "llguidance": "llguidance"}
API_KEY_ENV = "BLOCKDRAFT_API_KEY"
"""The API key when ``--api-key`` is not given (kept out of the process list and shell
history)."""
PID_DIR_ENV = "BLOCKDRAFT_TEST_PID_DIR"
"""Test suite only: a directory where every rank writes ``rank<r>.pid`` once its engine is
built, so that a test can signal or kill one rank."""


def missing_dependencies() -> list[str]:
    """The ``serve`` extra's packages that are not installed (pip names)."""
    return [pip for module, pip in SERVE_DEPENDENCIES.items()
            if importlib.util.find_spec(module) is None]


def _check_flags(args: argparse.Namespace) -> None:
    require_min("--max-active", args.max_active)
    require_min("--max-queue", args.max_queue, 0)
    require_min("--port", args.port, 0)
    if args.port > 65535:
        raise CliError(f"--port must be <= 65535, not {args.port}")
    for flag in ("--max-seq-len", "--target-pages", "--drafter-pages"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            require_min(flag, value, 2 if flag == "--max-seq-len" else 1)
    if not args.shutdown_timeout >= 0:
        raise CliError(f"--shutdown-timeout must be >= 0 seconds, not {args.shutdown_timeout}")
    if args.tp is not None:
        require_min("--tp", args.tp)
    if not args.tp_timeout > 0:
        raise CliError(f"--tp-timeout must be > 0 seconds, not {args.tp_timeout}")
    if args.max_body_bytes is not None:
        require_min("--max-body-bytes", args.max_body_bytes)
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    elif not args.api_key:
        raise CliError("--api-key must not be empty")
    _check_tls(args.ssl_keyfile, args.ssl_certfile)


def _check_tls(keyfile: str | None, certfile: str | None) -> None:
    """Both TLS files or neither, and a key and certificate that load as a pair."""
    if keyfile is None and certfile is None:
        return
    if keyfile is None or certfile is None:
        raise CliError("give both --ssl-keyfile and --ssl-certfile (or neither)")
    import ssl

    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if not Path(path).is_file():
            raise CliError(f"{flag} {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as exc:
        raise CliError(f"--ssl-certfile/--ssl-keyfile: cannot load them as a certificate and its "
                       f"key ({error_line(exc)})") from None


def run_serve(args: argparse.Namespace) -> int:
    """Load the pair, build the engine, serve until SIGINT/SIGTERM; 0 when every page came
    back at exit. With ``--tp N`` (or under ``torchrun``) the target is split over N ranks."""
    from blockdraft.parallel import end_rank_process, init_tp, launch, launched_by_torchrun

    missing = missing_dependencies()
    if missing:
        raise CliError(f"blockdraft serve needs {', '.join(missing)}: pip install blockdraft[serve]")
    _check_flags(args)
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.tp is not None and args.tp != world:
            raise CliError(f"--tp {args.tp} but torchrun started {world} ranks (WORLD_SIZE)")
        _plan(args, world)
        group = init_tp(device=tp_device(args.device), timeout_s=args.tp_timeout)
        if not group.is_first:
            # torchrun passes a stop signal to every rank; rank 0 alone decides when the
            # group stops (it drains first), so the others follow it until then.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            logging.getLogger().setLevel(logging.WARNING)
        error = _serve(args, group)
        group.close()
        if error is None:
            end_rank_process(0)  # this process is the rank: no teardown (see end_rank_process)
    elif (args.tp or 1) == 1:
        error = _serve(args, None)
    else:
        _plan(args, args.tp)  # one line before any rank starts
        check_port(args.host, args.port)
        errors = launch(_serve_on_rank, args.tp, (args,), device=tp_device(args.device),
                        timeout_s=args.tp_timeout, forward_signals=True)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CliError(error)
    return 0


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go: a port in use or a host that is not this
    machine's fails with one line (port 0, any free port, always binds)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise CliError(f"--host {host}: cannot resolve it ({error_line(exc)})") from None
    with socket.socket(family, kind, proto) as sock:
        # As the server's own socket: a port whose last connections are in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise CliError(f"--port {port}: cannot listen on {host}:{port} "
                           f"({exc.strerror or error_line(exc)})") from None


def _plan(args: argparse.Namespace, ranks: int) -> tuple[PairSource, int]:
    """The pair and the context length, checked before weights load."""
    pair = find_pair(args.target, args.drafter)
    max_seq_len = args.max_seq_len or pair.max_positions or 4096
    if pair.max_positions is not None and max_seq_len > pair.max_positions:
        raise CliError(f"--max-seq-len {max_seq_len} is past the target's max_position_embeddings "
                       f"({pair.max_positions})")
    if ranks > 1:
        from blockdraft.parallel import check_split

        arch, sizes = tp_sizes(pair.config)
        check_split(arch, sizes, ranks)
    return pair, max_seq_len


def _serve_on_rank(group: Any, args: argparse.Namespace) -> str | None:
    """One rank of ``serve --tp N`` (module level: each rank imports it). Its logging is set
    up as ``main`` sets it up for one process; the other ranks log warnings only."""
    debug = bool(getattr(args, "debug", False))
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(message)s")
    if not group.is_first:
        logging.getLogger().setLevel(logging.WARNING)
    return _serve(args, group)


def _serve(args: argparse.Namespace, group: Any) -> str | None:
    """Serve on this rank (rank 0, or the only one) or follow rank 0 (the others).

    Returns:
        ``None``, or the one-line error of a serve that ended with every rank told to stop.

    Raises:
        CliError: a failure that left the other ranks running (the process that watches the
            ranks stops them).
    """
    ranks = 1 if group is None else int(group.size)
    device = pick_device(args.device) if ranks == 1 else group.device
    pair, max_seq_len = _plan(args, ranks)
    if group is None or group.is_first:
        check_port(args.host, args.port)  # before the weights load: a port in use fails at once
    loaded = pair.load(device)
    target, drafter, tokenizer = loaded.target, loaded.drafter, loaded.tokenizer

    from blockdraft.serve import ServeConfig, build_engine, create_app, follow, serve

    engine = build_engine(target, drafter, max_seq_len=max_seq_len, max_active=args.max_active,
                          target_pages=args.target_pages, drafter_pages=args.drafter_pages,
                          tp=group if ranks > 1 else None, speculate=not args.no_speculation)
    rank = 0 if group is None else int(group.rank)
    pid_dir = os.environ.get(PID_DIR_ENV)
    if pid_dir:
        Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank > 0:
        if not args.no_warmup:
            engine.warmup()  # a collective: rank 0 warms up on its engine loop
        used, total = follow(engine, group)
        if any(used.values()):
            return f"tensor-parallel rank {rank}: pages were not all back at exit: {used} of {total} in use"
        return None
    config = ServeConfig(model_name=args.model_name or pair.name, max_queue=args.max_queue,
                         builtin_chat=pair.builtin, warmup=not args.no_warmup,
                         warmup_progress=_progress_bar() if not args.no_warmup else None,
                         api_key=args.api_key, public_metrics=args.public_metrics,
                         **({"max_body_bytes": args.max_body_bytes} if args.max_body_bytes else {}))
    app = create_app(engine, tokenizer, config)
    loop = app.state.loop
    pools = engine.pages_total()
    where = f"; tensor parallel over {ranks} ranks ({group.backend})" if ranks > 1 else ""
    where += "; speculation off (target-only decoding)" if args.no_speculation else ""
    scheme = "https" if args.ssl_certfile else "http"
    print(f"blockdraft serve: {pair.description} as {config.model_name!r} on {device}{where}; "
          f"{args.max_active} running at most, {args.max_queue} queued, context {max_seq_len}; "
          f"pools: target {pools['target']} pages, drafter {pools['drafter']} pages; "
          f"OpenAI base URL {scheme}://{args.host}:{args.port}/v1"
          + ("; API key required" if args.api_key else "")
          + ("; warming up first (/health answers 503 until ready)" if config.warmup else ""),
          flush=True)
    if not serve(app, host=args.host, port=args.port, shutdown_timeout_s=args.shutdown_timeout,
                 ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile):
        loop.stop(config.stop_timeout_s)  # the lifespan may have started it; this stops every rank
        return f"could not serve on {args.host}:{args.port} (the log above says why)"
    if ranks > 1 and loop.failure is not None:
        raise CliError(f"the engine loop failed: {error_line(loop.failure)}")
    final = loop.final
    if final is None:
        raise CliError("the engine loop did not close at exit")
    if not final.all_back:
        return f"pages were not all back at exit: {final.used} of {final.total} in use"
    return None


def _progress_bar() -> Callable[[int, int], None]:
    """A warm-up progress callback drawing a tqdm bar (closed when the work is done)."""
    bar = progress_bar(total=0, desc="warm-up", unit="step", leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def add_serve_command(sub: Any) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install blockdraft[serve])")
    srv.add_argument("--target", default=None, help="target model directory (HF format)")
    srv.add_argument("--drafter", default=None, help="DFlash drafter directory")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    srv.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    srv.add_argument("--max-active", type=int, default=16,
                     help="most requests running at once (default 16)")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="most requests waiting beyond those the next step starts; more get "
                          "429 (default 64)")
    srv.add_argument("--max-seq-len", type=int, default=None,
                     help="longest prompt + generation (default: the target's max_position_embeddings)")
    srv.add_argument("--model-name", default=None,
                     help=f"the model id clients name (default {BUILTIN_MODEL_NAME!r} for the "
                          "built-in pair, else the target directory's name)")
    srv.add_argument("--target-pages", type=int, default=None,
                     help="target K/V pages (default: --max-active sequences of --max-seq-len)")
    srv.add_argument("--drafter-pages", type=int, default=None,
                     help="drafter K/V pages (default: the proposer's, by memory)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds a SIGINT/SIGTERM waits for running requests before "
                          "cancelling them (default 30)")
    srv.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on every route but /health "
                          f"(default: ${API_KEY_ENV}, else no key)")
    srv.add_argument("--public-metrics", action="store_true",
                     help="with --api-key, serve /metrics without the key")
    srv.add_argument("--max-body-bytes", type=int, default=None,
                     help="largest request body read; larger ones get 413 (default 4 MiB)")
    srv.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this PEM private key")
    srv.add_argument("--ssl-certfile", default=None, help="... and this PEM certificate (chain)")
    srv.add_argument("--no-speculation", action="store_true",
                     help="serve by target-only decoding on the same runtime (the drafter is loaded "
                          "but never run): the baseline beside speculation")
    srv.add_argument("--tp", type=int, default=None, metavar="N",
                     help="split the target over N ranks (tensor parallelism; starts N processes, "
                          "or the ranks torchrun started); rank 0 serves HTTP")
    srv.add_argument("--tp-timeout", type=float, default=DEFAULT_TP_TIMEOUT_S, metavar="S",
                     help="with --tp: the longest a rank waits for the others in one collective; "
                          f"a rank silent this long ends the server (default {DEFAULT_TP_TIMEOUT_S:g})")
    srv.add_argument("--no-warmup", action="store_true",
                     help="report ready without warming up (kernel compiles and CUDA graph "
                          "captures then land on the first requests); for development")
    srv.set_defaults(func=run_serve)
