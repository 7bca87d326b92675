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
from pathlib import Path
from typing import Any

from blockdraft.cli.common import CliError, tp_device
from blockdraft.cli.serve_setup import (
    add_serve_arguments,
    build_serving,
    check_flags,
    check_port,
    plan,
    serve_config,
)
from blockdraft.errors import error_line

SERVE_DEPENDENCIES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client",
                      "llguidance": "llguidance"}
PID_DIR_ENV = "BLOCKDRAFT_TEST_PID_DIR"
"""Test suite only: a directory where every rank writes ``rank<r>.pid`` once its engine is
built, so that a test can signal or kill one rank."""


def missing_dependencies() -> list[str]:
    """The ``serve`` extra's packages that are not installed (pip names)."""
    return [pip for module, pip in SERVE_DEPENDENCIES.items()
            if importlib.util.find_spec(module) is None]


def run_serve(args: argparse.Namespace) -> int:
    """Load the pair, build the engine, serve until SIGINT/SIGTERM; 0 when every page came
    back at exit. With ``--tp N`` (or under ``torchrun``) the target is split over N ranks."""
    from blockdraft.parallel import end_rank_process, init_tp, launch, launched_by_torchrun

    missing = missing_dependencies()
    if missing:
        raise CliError(f"blockdraft serve needs {', '.join(missing)}: pip install blockdraft[serve]")
    check_flags(args)
    if args.replicas is not None:
        if launched_by_torchrun():
            raise CliError("--replicas does not go with torchrun: each replica starts its own --tp ranks")
        from blockdraft.cli.serve_ray import run_replicas

        plan(args, int(args.tp or 1))  # the pair and --tp checked before any cluster starts
        return run_replicas(args)
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.tp is not None and args.tp != world:
            raise CliError(f"--tp {args.tp} but torchrun started {world} ranks (WORLD_SIZE)")
        plan(args, world)
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
        plan(args, args.tp)  # one line before any rank starts
        check_port(args.host, args.port)
        errors = launch(_serve_on_rank, args.tp, (args,), device=tp_device(args.device),
                        timeout_s=args.tp_timeout, forward_signals=True)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CliError(error)
    return 0


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

    def port_first() -> None:
        if group is None or group.is_first:
            check_port(args.host, args.port)  # before the weights load: a port in use fails at once

    serving = build_serving(args, group, before_load=port_first)
    engine, pair, device, max_seq_len = serving.engine, serving.pair, serving.device, serving.max_seq_len

    from blockdraft.serve import create_app, follow, serve

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
    config = serve_config(args, pair)
    app = create_app(engine, serving.tokenizer, config)
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


def add_serve_command(sub: Any) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install blockdraft[serve])")
    add_serve_arguments(srv)
    srv.set_defaults(func=run_serve)
