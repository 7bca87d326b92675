"""The server as a Ray Serve app (``blockdraft serve --replicas N``): a local Ray cluster with
2 replicas of the built-in pair (CPU, fp32), reached through Serve's HTTP proxy on loopback.
The ``openai`` client's completions and streams equal ``blockdraft.generate``; concurrent
clients are spread over both replicas (each replica's own counters move by the requests its
answers name); a replica killed under load is replaced by Ray while the other replica's streams
complete and the killed one's clients get an error, never a hang; every live replica ends with
every page back; Serve and Ray shut down."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from blockdraft.parallel import free_port

from support.serve_support import HOST, MODEL, Pair, sse_chunks_async, wait_until

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from blockdraft.cli.serve_setup import parse_serve_args  # noqa: E402 - after the skip
from blockdraft.serve.ray_app import APP_NAME, DEPLOYMENT_NAME, REPLICA_HEADER, build_app  # noqa: E402

PROMPTS = ("def fibonacci(n):", "import os\n\ndef main(", "class Stack:\n    def push(self, item):")
REPLICA_PREFIX = f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#"
TIMEOUT_S = 60.0
CLIENTS = 8


@dataclass
class Cluster:
    url: str
    handle: Any

    def live_replicas(self) -> set[str]:
        """The replica actors Ray holds now (their names: what the answers' header says)."""
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(REPLICA_PREFIX)}

    def statuses(self, names: set[str]) -> dict[str, dict[str, Any]]:
        """Each named replica's ``status()``: the handle routes each call to one replica, so
        call until every one has answered."""
        seen: dict[str, dict[str, Any]] = {}
        end = time.monotonic() + TIMEOUT_S
        while not names <= seen.keys():
            assert time.monotonic() < end, f"replicas {names - seen.keys()} never answered status()"
            st = self.handle.status.remote().result(timeout_s=TIMEOUT_S)
            seen[st["replica"]] = st
        return {n: seen[n] for n in names}

    def all_idle(self) -> bool:
        names = self.live_replicas()
        return len(names) == 2 and all(
            st["alive"] and st["running"] == st["waiting"] == 0 and not any(st["pages_used"].values())
            for st in self.statuses(names).values())


@pytest.fixture(scope="module")
def solo(pair: Pair) -> Callable[[str, int], str]:
    """``pair.solo_text``, each prompt and length computed once."""
    texts: dict[tuple[str, int], str] = {}

    def text(prompt: str, n: int) -> str:
        if (prompt, n) not in texts:
            texts[prompt, n] = pair.solo_text(prompt, n)
        return texts[prompt, n]

    return text


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ray.init(num_cpus=6, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": HOST, "port": port})
        args = parse_serve_args({"replicas": 2, "device": "cpu", "max_seq_len": 1024, "max_active": 8,
                                 "no_warmup": True, "shutdown_timeout": 5})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        yield Cluster(f"http://{HOST}:{port}", serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME))
    finally:
        serve.shutdown()
        ray.shutdown()
    assert not ray.is_initialized()


def _body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                  on_first: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One streamed completion: the replica that answered, its text, its finish reason, and
    the error that ended it early (``None`` when it ended normally); ``on_first(replica)``
    once its first text arrives."""
    out: dict[str, Any] = {"prompt": prompt, "n": max_tokens, "text": "", "reason": None, "error": None}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=_body(prompt, max_tokens)) as r:
            out["replica"] = r.headers.get(REPLICA_HEADER)
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}"
                return out
            async for chunk in sse_chunks_async(r):
                if "error" in chunk:
                    out["error"] = chunk["error"]
                    continue
                if on_first is not None and not out["text"] and chunk["choices"][0]["text"]:
                    on_first(out["replica"])
                out["text"] += chunk["choices"][0]["text"]
                out["reason"] = chunk["choices"][0]["finish_reason"] or out["reason"]
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out




def test_openai_client_through_the_proxy_equals_generate(cluster: Cluster, solo: Callable[[str, int], str]) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    for prompt in PROMPTS[:2]:
        want = solo(prompt, 24)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == want and got.choices[0].finish_reason == "length"
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert [m.id for m in client.models.list().data] == [MODEL]
    wait_until(cluster.all_idle, "every replica idle")


def test_concurrent_clients_spread_over_both_replicas(cluster: Cluster, solo: Callable[[str, int], str]) -> None:
    names = cluster.live_replicas()
    assert len(names) == 2
    before = cluster.statuses(names)

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=16)) as client:
            async def one_client(c: int) -> list[dict[str, Any]]:
                return [await _stream(client, cluster.url, PROMPTS[(c + r) % len(PROMPTS)], 32) for r in range(2)]

            return [a for per in await asyncio.gather(*(one_client(c) for c in range(CLIENTS))) for a in per]

    answers = asyncio.run(main())
    for a in answers:
        assert a["error"] is None and a["text"] == solo(a["prompt"], 32) and a["reason"] == "length", a
    served = {n: sum(a["replica"] == n for a in answers) for n in names}
    assert sum(served.values()) == len(answers) and all(v > 0 for v in served.values()), served
    wait_until(cluster.all_idle, "every replica idle")
    after = cluster.statuses(names)
    for n in names:
        assert after[n]["requests"]["length"] - before[n]["requests"]["length"] == served[n], (n, served)


def test_a_killed_replica_is_replaced_and_the_other_completes(cluster: Cluster,
                                                            solo: Callable[[str, int], str]) -> None:
    names = cluster.live_replicas()
    assert len(names) == 2
    n_tokens = 300
    first: list[str] = []

    async def main() -> list[dict[str, Any]]:
        started = asyncio.Event()

        def on_first(replica: str) -> None:
            first.append(replica)
            if len(first) == CLIENTS:
                started.set()

        async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=16)) as client:
            tasks = [asyncio.create_task(_stream(client, cluster.url, PROMPTS[c % len(PROMPTS)], n_tokens, on_first))
                     for c in range(CLIENTS)]
            await asyncio.wait_for(started.wait(), TIMEOUT_S)
            victim = sorted(set(first))[0]
            await asyncio.to_thread(ray.kill, ray.get_actor(victim, namespace="serve"), no_restart=True)
            # No hang: every client ends well within its own timeouts.
            return [{**a, "victim": victim} for a in await asyncio.wait_for(asyncio.gather(*tasks), 2 * TIMEOUT_S)]

    answers = asyncio.run(main())
    victim = answers[0]["victim"]
    on_victim = [a for a in answers if a["replica"] == victim]
    others = [a for a in answers if a["replica"] != victim]
    assert on_victim and others, [a["replica"] for a in answers]
    for a in on_victim:  # cut off: an error, never a finished answer
        assert a["error"] is not None and a["reason"] is None, a
    for a in others:
        assert a["error"] is None and a["reason"] in ("length", "stop"), a
        assert a["text"] == solo(a["prompt"], n_tokens), a["prompt"]
    wait_until(lambda: len(cluster.live_replicas()) == 2 and victim not in cluster.live_replicas(),
               "Ray to start a replica in place of the killed one", deadline_s=120)
    wait_until(cluster.all_idle, "every live replica idle with every page back", deadline_s=120)
    # The new replica answers.
    new = (cluster.live_replicas() - names).pop()
    assert cluster.statuses({new})[new]["alive"]


def test_a_tensor_parallel_replica(cluster: Cluster, solo: Callable[[str, int], str]) -> None:
    """``--tp 2`` inside a replica: rank 0 is the replica, rank 1 a Ray actor in the second
    bundle of its placement group (gloo on the CPU); its answers equal ``generate``."""
    import openai

    app = "blockdraft-tp"
    args = parse_serve_args({"replicas": 1, "tp": 2, "device": "cpu", "max_seq_len": 512, "max_active": 4,
                             "no_warmup": True, "shutdown_timeout": 5})
    serve.run(build_app(args), name=app, route_prefix="/tp")
    try:
        client = openai.OpenAI(base_url=f"{cluster.url}/tp/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        for prompt in PROMPTS[:2]:
            got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
            assert got.choices[0].text == solo(prompt, 24)
        handle = serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app)
        metrics = httpx.get(f"{cluster.url}/tp/metrics", timeout=TIMEOUT_S).text
        assert "blockdraft_tp_size 2.0" in metrics
        handle.check_health.remote().result(timeout_s=TIMEOUT_S)
        st = handle.status.remote().result(timeout_s=TIMEOUT_S)
        assert st["requests"]["length"] == 2 and not any(st["pages_used"].values()), st
    finally:
        serve.delete(app)


def test_health_check_raises_once_the_engine_loop_has_ended(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """What each replica's ``check_health`` runs: quiet while the loop runs, raising once it
    has failed or stopped (Ray then replaces the replica)."""
    from blockdraft.serve import EngineLoop, ServeMetrics, build_engine
    from blockdraft.serve.ray_app import engine_health

    loop = EngineLoop(build_engine(pair.target, pair.drafter, max_seq_len=256, max_active=2),
                      ServeMetrics(), max_queue=4)
    loop.start()
    engine_health(loop)
    loop.stop(TIMEOUT_S)
    with pytest.raises(RuntimeError, match="the engine loop is not running"):
        engine_health(loop)

    engine = build_engine(pair.target, pair.drafter, max_seq_len=256, max_active=2)

    def broken_warmup(**kw: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "warmup", broken_warmup)
    failing = EngineLoop(engine, ServeMetrics(), max_queue=4, warmup=True)
    failing.start()
    wait_until(lambda: failing.failure is not None, "the engine loop to fail")
    with pytest.raises(RuntimeError, match="the engine loop failed: RuntimeError: device lost"):
        engine_health(failing)
    failing.stop(TIMEOUT_S)


def test_deployment_options_follow_the_flags() -> None:
    from blockdraft.serve.ray_app import deployment_options

    fixed = deployment_options(parse_serve_args({"replicas": 3, "max_active": 8, "max_queue": 4,
                                                 "shutdown_timeout": 7}), gpus=True)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert fixed["max_ongoing_requests"] == 12 and fixed["graceful_shutdown_timeout_s"] == 7.0
    assert "placement_group_bundles" not in fixed
    scaled = deployment_options(parse_serve_args({"replicas": "1:4", "tp": 2, "max_active": 16}), gpus=True)
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16.0}
    assert scaled["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert scaled["placement_group_strategy"] == "STRICT_PACK"
    cpu = deployment_options(parse_serve_args({"tp": 2, "device": "cpu"}), gpus=False)
    assert cpu["placement_group_bundles"] == [{"CPU": 1.0}] * 2 and cpu["ray_actor_options"]["num_gpus"] == 0.0
