"""The OpenAI server as a Ray Serve application: replicas of one engine each.

Each replica is a Ray Serve replica (one actor process) that loads the pair and builds its
engine as ``blockdraft serve`` does, from the same flags, and answers the same routes
(:func:`~blockdraft.serve.create_app`) through Serve's FastAPI ingress, streams included.
Ray does the rest: its HTTP proxy routes each request to a replica (fewest ongoing requests
of two picked at random), starts ``num_replicas`` replicas or scales between bounds on
ongoing requests (``autoscaling_config``), restarts a replica whose actor dies or whose
:meth:`BlockdraftReplica.check_health` raises (it does once the engine loop has ended), and
shuts replicas down gracefully: no new request, the running ones go on for
``graceful_shutdown_timeout_s`` (``--shutdown-timeout``), then the app's lifespan stops the
engine loop (which cancels what is left and gives every page back).

The app's lifespan starts the engine loop inside the replica: Serve runs an ingress app's
lifespan start-up once the replica's constructor has returned, and its shutdown when the
replica stops. Every answer carries ``x-blockdraft-replica`` (the replica's Ray actor name),
so a client or a test knows which replica served it; :meth:`BlockdraftReplica.status`, called
through a deployment handle, returns one replica's counters and pools.

With ``--tp N`` each replica is a tensor-parallel group (:mod:`blockdraft.serve.ray_tp`):
the replica is rank 0 and starts the other ranks as Ray actors in the bundles of the
replica's placement group (one bundle per rank, packed on one node).

Entry points: ``blockdraft serve --replicas N`` (:mod:`blockdraft.cli.serve_ray`) and
``serve run blockdraft.serve.ray_app:app_builder replicas=2 max_active=8 ...`` (the
``blockdraft serve`` flags as ``key=value`` arguments; ``docs/deploy.md`` has a config file).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ray import serve
from ray.serve import Application, Deployment
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blockdraft.cli.serve_setup import ReplicaCount, build_serving, parse_replicas, parse_serve_args, serve_config
from blockdraft.serve.app import create_app
from blockdraft.serve.loop import EngineLoop
from blockdraft.serve.metrics import POOLS, STATUSES, ServeMetrics

log = logging.getLogger(__name__)

APP_NAME = "blockdraft"
"""The Serve application's name (``serve status``, deployment handles)."""
DEPLOYMENT_NAME = "blockdraft"
REPLICA_HEADER = "x-blockdraft-replica"
"""The response header naming the replica (its Ray actor name) that answered."""

# The app of the replica running in this process (a replica is a process of its own): its
# constructor builds it, once its engine is built, and leaves it here for ReplicaIngress.
_replica_apps: list[ASGIApp] = []


class ReplicaIngress:
    """The ASGI app Serve's ingress wraps: every call (HTTP and lifespan) goes to the app this
    process's replica built. Serve takes the ingress app when the deployment is defined,
    before any replica or engine exists, so the real app is looked up when it is called."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _replica_apps:
            raise RuntimeError("no blockdraft replica was built in this process")
        await _replica_apps[-1](scope, receive, send)


class ReplicaHeader:
    """ASGI middleware adding :data:`REPLICA_HEADER` to every HTTP answer."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.value = replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, tagged)


def engine_health(loop: EngineLoop) -> None:
    """Raise when the engine loop has ended (failed, or stopped outside a shutdown).

    Raises:
        RuntimeError: naming why; Ray then replaces the replica.
    """
    if loop.failure is not None:
        raise RuntimeError(f"the engine loop failed: {type(loop.failure).__name__}: {loop.failure}")
    if not loop.alive:
        raise RuntimeError("the engine loop is not running")


def replica_status(replica: str, loop: EngineLoop, metrics: ServeMetrics) -> dict[str, Any]:
    """One replica's state as plain values: its name, whether its engine loop runs (and
    warms up), its answered requests by status, requests running and waiting, and its pools."""
    reg = metrics.registry

    def value(name: str, **labels: str) -> float:
        got = reg.get_sample_value(name, labels)
        return 0.0 if got is None else float(got)

    return {
        "replica": replica,
        "alive": loop.alive,
        "warming": loop.warming,
        "requests": {s: value("blockdraft_requests_total", status=s) for s in STATUSES},
        "running": value("blockdraft_requests_running"),
        "waiting": value("blockdraft_requests_waiting"),
        "pages_used": {p: value("blockdraft_pool_pages_used", pool=p) for p in POOLS},
        "pages_total": {p: value("blockdraft_pool_pages_total", pool=p) for p in POOLS},
    }


class BlockdraftReplica:
    """One replica: the pair loaded, its engine built, behind :func:`create_app`'s routes.

    Args:
        args: the ``blockdraft serve`` flags (checked already).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        from blockdraft.serve.ray_tp import RankGroup

        # As the command sets it up: the engine's log lines (pools at exit among them) reach
        # the replica's log, which Ray forwards to the driver.
        logging.basicConfig(level=logging.DEBUG if getattr(args, "debug", False) else logging.INFO,
                            format="%(message)s")
        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        tp = int(args.tp or 1)
        self.ranks = RankGroup.start(args, tp) if tp > 1 else None
        serving = build_serving(args, self.ranks.group if self.ranks is not None else None)
        app = create_app(serving.engine, serving.tokenizer, serve_config(args, serving.pair, progress=False))
        app.add_middleware(ReplicaHeader, replica=self.name)
        self.loop: EngineLoop = app.state.loop
        self.metrics: ServeMetrics = app.state.metrics
        if self.ranks is not None:
            self.ranks.follow()
        pools = serving.engine.pages_total()
        log.info("blockdraft replica %s: %s on %s%s; pools: target %d pages, drafter %d pages",
                 self.name, serving.pair.description, serving.device,
                 f", tensor parallel over {tp} ranks" if tp > 1 else "", pools["target"], pools["drafter"])
        _replica_apps.append(app)

    def check_health(self) -> None:
        """Serve's health check: raises once the engine loop has ended or a rank has."""
        engine_health(self.loop)
        if self.ranks is not None:
            self.ranks.check()

    def status(self) -> dict[str, Any]:
        """This replica's :func:`replica_status`."""
        return replica_status(self.name, self.loop, self.metrics)


def deployment_options(args: argparse.Namespace, *, gpus: bool) -> dict[str, Any]:
    """Serve's deployment options for ``args``: replicas or autoscaling bounds, one CPU (and
    one GPU with ``gpus``) per rank, a placement group of one bundle per rank with ``--tp``,
    and as many ongoing requests per replica as its engine runs and queues."""
    count: ReplicaCount = parse_replicas(args.replicas or "1")
    tp = int(args.tp or 1)
    bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpus else {})}
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1.0 if gpus else 0.0},
        # Beyond this the proxy holds requests back; the engine admits max_active and queues
        # max_queue more (then answers 429), so Ray's limit never refuses before the engine.
        "max_ongoing_requests": args.max_active + args.max_queue,
        "graceful_shutdown_timeout_s": float(args.shutdown_timeout),
    }
    if count.autoscaling:
        options["autoscaling_config"] = {"min_replicas": count.low, "max_replicas": count.high,
                                         "target_ongoing_requests": float(args.max_active)}
    else:
        options["num_replicas"] = count.low
    if tp > 1:
        options["placement_group_bundles"] = [dict(bundle) for _ in range(tp)]
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def wants_gpus(device: str | None) -> bool:
    """Whether each rank needs a GPU: ``--device cuda``, or no ``--device`` and a cluster with
    GPUs (the connected Ray cluster's, else this machine's)."""
    if device in (None, "auto"):
        import ray

        if ray.is_initialized():
            return float(ray.cluster_resources().get("GPU", 0)) > 0  # type: ignore[no-untyped-call]
        import torch

        return bool(torch.cuda.is_available())
    return str(device).startswith("cuda")


def build_app(args: argparse.Namespace) -> Application:
    """The Serve application of ``args`` (the ``blockdraft serve`` flags, checked)."""
    options = deployment_options(args, gpus=wants_gpus(args.device))
    replica_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    ingress = serve.ingress(ReplicaIngress())(BlockdraftReplica)
    deployment: Deployment = serve.deployment(**options)(ingress)
    return deployment.bind(replica_args)


def app_builder(args: dict[str, Any]) -> Application:
    """``serve run blockdraft.serve.ray_app:app_builder key=value ...``: the ``blockdraft
    serve`` flags as keys (``max_active=8``, ``replicas=2``, ``target=DIR``; ``true`` for a
    flag without a value such as ``no_warmup``); ``host``/``port`` are Serve's own settings.

    Raises:
        blockdraft.cli.common.CliError: an unknown key or a bad value, named.
    """
    return build_app(parse_serve_args(args))


__all__ = ["APP_NAME", "DEPLOYMENT_NAME", "REPLICA_HEADER", "BlockdraftReplica", "ReplicaHeader", "ReplicaIngress",
           "app_builder", "build_app", "deployment_options", "engine_health", "replica_status",
           "wants_gpus"]
