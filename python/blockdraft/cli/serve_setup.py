"""The flags of ``blockdraft serve`` and what they build: the pair checked before weights
load, one rank's engine, the server's settings. Shared by the command (:mod:`blockdraft.cli.serve`)
and the Ray Serve replicas (:mod:`blockdraft.serve.ray_app`), so both build the same server
from the same flags.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from blockdraft.cli.common import (
    ArgumentParser,
    CliError,
    pick_device,
    progress_bar,
    require_min,
    tp_sizes,
)
from blockdraft.errors import error_line
from blockdraft.pair.load import BUILTIN_MODEL_NAME, PairSource, find_pair
from blockdraft.parallel import DEFAULT_TIMEOUT_S as DEFAULT_TP_TIMEOUT_S

if TYPE_CHECKING:
    from blockdraft.engine import SpeculativeEngine
    from blockdraft.serve import ServeConfig

API_KEY_ENV = "BLOCKDRAFT_API_KEY"
"""The API key when ``--api-key`` is not given (kept out of the process list and shell
history)."""
_BOOL_FLAGS = ("public_metrics", "no_speculation", "no_warmup")


def check_flags(args: argparse.Namespace) -> None:
    """Check the flags that need no pair (and read the key from the environment).

    Raises:
        CliError: naming the flag.
    """
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
    check_ray_flags(args)
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


def plan(args: argparse.Namespace, ranks: int) -> tuple[PairSource, int]:
    """The pair and the context length, checked before weights load (``ranks``: the
    tensor-parallel ranks the target is split over)."""
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


@dataclass(frozen=True)
class Serving:
    """What one rank serves: the pair it came from, the context length, the device, the engine
    and the tokenizer."""

    pair: PairSource
    max_seq_len: int
    device: Any
    engine: SpeculativeEngine
    tokenizer: Any


def build_serving(args: argparse.Namespace, group: Any, *,
                  before_load: Callable[[], None] | None = None) -> Serving:
    """Load the pair ``args`` names and build this rank's engine as ``blockdraft serve`` does
    (``group``: this rank's tensor-parallel group, ``None`` for one rank); ``before_load`` runs
    once the flags are checked against the pair, before any weights load.

    Raises:
        CliError: a pair or a context length that does not fit the flags.
    """
    ranks = 1 if group is None else int(group.size)
    device = pick_device(args.device) if ranks == 1 else group.device
    pair, max_seq_len = plan(args, ranks)
    if before_load is not None:
        before_load()
    loaded = pair.load(device)

    from blockdraft.serve import build_engine

    engine = build_engine(loaded.target, loaded.drafter, max_seq_len=max_seq_len,
                          max_active=args.max_active, target_pages=args.target_pages,
                          drafter_pages=args.drafter_pages, tp=group if ranks > 1 else None,
                          speculate=not args.no_speculation)
    return Serving(pair, max_seq_len, device, engine, loaded.tokenizer)


def serve_config(args: argparse.Namespace, pair: PairSource, *, progress: bool = True) -> ServeConfig:
    """The server settings of ``args`` (``progress``: a warm-up progress bar on the terminal)."""
    from blockdraft.serve import ServeConfig

    warmup = not args.no_warmup
    return ServeConfig(model_name=args.model_name or pair.name, max_queue=args.max_queue,
                       builtin_chat=pair.builtin, warmup=warmup,
                       warmup_progress=_progress_bar() if warmup and progress else None,
                       api_key=args.api_key, public_metrics=args.public_metrics,
                       **({"max_body_bytes": args.max_body_bytes} if args.max_body_bytes else {}))


def _progress_bar() -> Callable[[int, int], None]:
    """A warm-up progress callback drawing a tqdm bar (closed when the work is done)."""
    bar = progress_bar(total=0, desc="warm-up", unit="step", leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def add_serve_arguments(srv: argparse.ArgumentParser) -> None:
    """The flags of ``blockdraft serve`` on ``srv``."""
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
    srv.add_argument("--replicas", default=None, metavar="N",
                     help="serve N replicas, one engine each, as a Ray Serve app (pip install "
                          "blockdraft[ray]); MIN:MAX scales between them on ongoing requests; "
                          "--tp N then splits each replica over N ranks")
    srv.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="with --replicas: join the Ray cluster at ADDR (default: $RAY_ADDRESS, "
                          "else start a local one)")


@dataclass(frozen=True)
class ReplicaCount:
    """``--replicas``: a fixed count (``low == high``) or autoscaling bounds."""

    low: int
    high: int

    @property
    def autoscaling(self) -> bool:
        return self.low != self.high


def parse_replicas(text: str) -> ReplicaCount:
    """``N`` (N replicas) or ``MIN:MAX`` (scaled between them on ongoing requests).

    Raises:
        CliError: anything else, naming ``--replicas``.
    """
    parts = str(text).strip().split(":")
    bad = CliError(f"--replicas must be a count N >= 1 or autoscaling bounds MIN:MAX with "
                   f"1 <= MIN <= MAX, not {text!r}")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise bad
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high:
        raise bad
    return ReplicaCount(low, high)


def check_ray_flags(args: argparse.Namespace) -> None:
    """The flags that only go with ``--replicas``, and those that do not go with it.

    Raises:
        CliError: naming the flag.
    """
    if args.replicas is None:
        if args.ray_address is not None:
            raise CliError("--ray-address needs --replicas N")
        return
    parse_replicas(args.replicas)
    if args.ssl_keyfile or args.ssl_certfile:
        raise CliError("--ssl-keyfile/--ssl-certfile do not go with --replicas: Ray Serve's HTTP "
                       "proxy serves plain HTTP (terminate TLS in front of it)")
    if args.ray_address is not None and not args.ray_address.strip():
        raise CliError("--ray-address must not be empty")
    device = args.device or ""
    if device.startswith("cuda:") and device != "cuda:0":
        raise CliError(f"--device {device} with --replicas: Ray gives each replica (each rank) its "
                       "own GPU, which it sees as cuda:0; give --device cuda")


class _Parser(ArgumentParser):
    """The serve flags' parser, raising :class:`CliError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise CliError(message)


def parse_serve_args(values: dict[str, Any]) -> argparse.Namespace:
    """``blockdraft serve`` flags from ``key=value`` pairs (``serve run``'s arguments, a
    config file's ``args``): ``max_active=8`` is ``--max-active 8``; ``no_warmup=true`` a
    flag without a value. Checked as the command checks them; ``replicas`` defaults to 1.

    Raises:
        CliError: an unknown key, or a bad value (named as its flag).
    """
    parser = _Parser(prog="blockdraft serve")
    add_serve_arguments(parser)
    known = set(vars(parser.parse_args([])))
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise CliError(f"unknown blockdraft serve settings: {', '.join(unknown)} (the flags' names "
                       "with _ for -, such as max_active)")
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if key in _BOOL_FLAGS:
            if str(value).lower() in ("1", "true", "yes"):
                argv.append(flag)
            elif str(value).lower() not in ("0", "false", "no"):
                raise CliError(f"{key} must be true or false, not {value!r}")
        else:
            argv += [flag, str(value)]
    args = parser.parse_args(argv)
    if args.replicas is None:
        args.replicas = "1"
    check_flags(args)
    return args


__all__ = ["API_KEY_ENV", "ReplicaCount", "Serving", "add_serve_arguments", "build_serving",
           "check_flags", "check_port", "check_ray_flags", "parse_replicas", "parse_serve_args", "plan",
           "serve_config"]
