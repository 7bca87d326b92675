"""``blockdraft serve --replicas N``: the server as a Ray Serve application
(:mod:`blockdraft.serve.ray_app`; needs ``pip install blockdraft[ray]``).

The command connects to the Ray cluster at ``--ray-address`` (else ``$RAY_ADDRESS``) or starts
a local one, starts Serve's HTTP proxy on ``--host``/``--port``, deploys the app (N replicas,
or ``MIN:MAX`` scaled on ongoing requests) and blocks until SIGINT or SIGTERM; then it shuts
Serve down (each replica drains for ``--shutdown-timeout`` and gives its pages back) and
disconnects; a local cluster stops with it. On a cluster it joined, only its own application
is deleted (Serve and other applications stay).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import threading

from blockdraft.cli.common import CliError
from blockdraft.cli.serve_setup import parse_replicas
from blockdraft.errors import error_line

RAY_PIP = "blockdraft[ray]"
RAY_ADDRESS_ENV = "RAY_ADDRESS"
"""The cluster to join when ``--ray-address`` is not given (read by ``ray.init`` itself)."""


def missing_ray() -> bool:
    """Whether Ray is not installed (the ``ray`` extra)."""
    return importlib.util.find_spec("ray") is None


def run_replicas(args: argparse.Namespace) -> int:
    """Deploy the app on a Ray cluster and block until SIGINT/SIGTERM; 0 once Serve has shut
    down (``args``: the ``blockdraft serve`` flags, checked).

    Raises:
        CliError: Ray is not installed, or the app did not start (why, in one line).
    """
    if missing_ray():
        raise CliError(f"blockdraft serve --replicas needs Ray Serve: pip install {RAY_PIP}")
    import ray
    from ray import serve

    from blockdraft.serve.ray_app import APP_NAME, build_app

    count = parse_replicas(args.replicas)
    joined = bool(args.ray_address or os.environ.get(RAY_ADDRESS_ENV))
    stop = threading.Event()
    ray.init(address=args.ray_address)
    # Ray's own handlers would end the process at once; a stop signal from here on (even one
    # that arrives while the app deploys) shuts Serve down first.
    previous = {sig: signal.signal(sig, lambda s, f: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        except Exception as exc:  # noqa: BLE001 - a replica that could not start: one line
            if joined:
                serve.delete(APP_NAME)
            raise CliError(f"the Ray Serve app did not start: {error_line(exc)}") from None
        replicas = f"{count.low}" if not count.autoscaling else f"{count.low} to {count.high} (autoscaled)"
        print(f"blockdraft serve: {replicas} replicas on Ray ({ray.get_runtime_context().gcs_address}); "
              f"OpenAI base URL http://{args.host}:{args.port}/v1", flush=True)
        while not stop.wait(0.5):
            pass
        print("blockdraft serve: stopping the replicas", flush=True)
        if joined:  # a cluster of others: only this app goes (its replicas drain first)
            serve.delete(APP_NAME)
        else:
            serve.shutdown()  # type: ignore[no-untyped-call]
    finally:
        ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


__all__ = ["RAY_ADDRESS_ENV", "RAY_PIP", "missing_ray", "run_replicas"]
