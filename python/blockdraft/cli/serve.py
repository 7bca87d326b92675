"""``blockdraft serve``: the OpenAI-compatible server (:mod:`blockdraft.serve`) on a pair.

Without ``--target/--drafter`` it serves the built-in trained pair. Flags are checked, and
the ``serve`` extra's presence too, before any weights load.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.cli.common import (
    CliError,
    check_pair_dirs,
    load_drafter_dir,
    load_target_model,
    load_tokenizer,
    max_positions,
    model_dtype,
    pick_device,
    quiet_transformers,
    read_model_config,
    require_min,
)

SERVE_DEPENDENCIES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}
BUILTIN_MODEL_NAME = "blockdraft-builtin"


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
    for flag in ("--max-seq-len", "--target-pages", "--drafter-blocks"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            require_min(flag, value, 2 if flag == "--max-seq-len" else 1)
    if not args.shutdown_timeout >= 0:
        raise CliError(f"--shutdown-timeout must be >= 0 seconds, not {args.shutdown_timeout}")
    if (args.target is None) != (args.drafter is None):
        raise CliError("give both --target DIR and --drafter DIR (or neither for the built-in pair)")


@dataclass(frozen=True)
class _Pair:
    """A pair known from its config files, loaded only once every flag is checked."""

    name: str
    positions: int | None
    description: str
    builtin: bool
    load: Callable[[Any], tuple[Any, Any, Any]]  # device -> (target, drafter, tokenizer)


def _pair(args: argparse.Namespace) -> _Pair:
    if args.target is None:
        from blockdraft import pretrained

        if not pretrained.available():
            raise CliError("the built-in pair is not installed; pass --target DIR --drafter DIR")

        def builtin(device: Any) -> tuple[Any, Any, Any]:
            quiet_transformers()
            return pretrained.builtin_pair(device=device, dtype=model_dtype(device))

        return _Pair(BUILTIN_MODEL_NAME,
                     max_positions(read_model_config("the built-in target", pretrained.TARGET_DIR)),
                     "built-in trained pair (Python code model + B=8 DFlash drafter)", True, builtin)
    target_dir, drafter_dir = args.target, args.drafter
    raw = check_pair_dirs(target_dir, drafter_dir)

    def from_dirs(device: Any) -> tuple[Any, Any, Any]:
        dtype = model_dtype(device)
        tokenizer = load_tokenizer("--target", target_dir)
        return (load_target_model("--target", target_dir, device, dtype),
                load_drafter_dir(drafter_dir, device, dtype), tokenizer)

    return _Pair(Path(target_dir).resolve().name, max_positions(raw),
                 f"target {target_dir}, drafter {drafter_dir}", False, from_dirs)


def run_serve(args: argparse.Namespace) -> int:
    """Load the pair, build the engine, serve until SIGINT/SIGTERM; 0 when every page came
    back at exit."""
    missing = missing_dependencies()
    if missing:
        raise CliError(f"blockdraft serve needs {', '.join(missing)}: pip install blockdraft[serve]")
    _check_flags(args)
    device = pick_device(args.device)
    pair = _pair(args)
    max_seq_len = args.max_seq_len or pair.positions or 4096
    if pair.positions is not None and max_seq_len > pair.positions:
        raise CliError(f"--max-seq-len {max_seq_len} is past the target's max_position_embeddings "
                       f"({pair.positions})")
    target, drafter, tokenizer = pair.load(device)

    from blockdraft.serve import ServeConfig, build_engine, create_app, serve

    engine = build_engine(target, drafter, max_seq_len=max_seq_len, max_active=args.max_active,
                          target_pages=args.target_pages, drafter_blocks=args.drafter_blocks)
    config = ServeConfig(model_name=args.model_name or pair.name, max_queue=args.max_queue,
                         builtin_chat=pair.builtin)
    app = create_app(engine, tokenizer, config)
    pools = engine.pages_total()
    print(f"blockdraft serve: {pair.description} as {config.model_name!r} on {device}; "
          f"{args.max_active} running at most, {args.max_queue} queued, context {max_seq_len}; "
          f"pools: target {pools['target']} pages, drafter {pools['drafter']} pages; "
          f"OpenAI base URL http://{args.host}:{args.port}/v1", flush=True)
    if not serve(app, host=args.host, port=args.port, shutdown_timeout_s=args.shutdown_timeout):
        raise CliError(f"could not serve on {args.host}:{args.port} (the log above says why)")
    final = app.state.loop.final
    if final is None:
        raise CliError("the engine loop did not close at exit")
    if not final.all_back:
        raise CliError(f"pages were not all back at exit: {final.used} of {final.total} in use")
    return 0


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
    srv.add_argument("--drafter-blocks", type=int, default=None,
                     help="drafter K/V blocks (default: the proposer's, by memory)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds a SIGINT/SIGTERM waits for running requests before "
                          "cancelling them (default 30)")
    srv.set_defaults(func=run_serve)
