"""Helpers of the ``blockdraft serve`` tests: the built-in pair, in-process servers on loopback,
``blockdraft serve`` as a subprocess, reading ``/metrics`` and streamed answers, and the solo
(``blockdraft.generate``) reference of a prompt."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import blockdraft
import blockdraft.pretrained
from blockdraft.serve import ServeConfig, build_engine, create_app
from blockdraft.serve.access import DEFAULT_MAX_BODY_BYTES

from support.words import word_tokenizer

HOST = "127.0.0.1"
MODEL = "blockdraft-builtin"
DEADLINE_S = 60.0
WARMUP_DEADLINE_S = 900.0


@dataclass(frozen=True)
class Pair:
    target: Any
    drafter: Any
    tokenizer: Any

    @property
    def eos(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def solo_ids(self, prompt: list[int], n: int) -> list[int]:
        """The pair's own greedy output for ``prompt`` (``blockdraft.generate``, eos stops)."""
        return list(blockdraft.generate(self.target, self.drafter, [prompt], max_new_tokens=n,
                                        stop_token_ids=[self.eos]).tokens[0])

    def solo_text(self, prompt: str | list[int], n: int) -> str:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return str(self.tokenizer.decode(self.solo_ids(ids, n), skip_special_tokens=True))


def builtin_pair() -> Pair:
    target, drafter, tokenizer = blockdraft.pretrained.builtin_pair(device="cpu", dtype=torch.float32)
    return Pair(target, drafter, tokenizer)


def random_pair(shape: str, device: str, dtype: torch.dtype) -> Pair:
    """The random-weight pair of :data:`blockdraft.pair.SHAPES`' ``shape`` on ``device``, with
    a word tokenizer of its vocabulary (the last word its end-of-sequence token)."""
    from blockdraft import pair

    target, drafter = pair.random_pair(pair.SHAPES[shape], device, dtype)
    return Pair(target, drafter, word_tokenizer(pair.SHAPES[shape].vocab, eos=True))


def wait_until(check: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
        time.sleep(0.02)


def sse_events(r: httpx.Response) -> Iterator[dict[str, Any] | str]:
    """A streamed answer's server-sent events: each chunk's JSON object, then ``"[DONE]"``."""
    for line in r.iter_lines():
        if line == "data: [DONE]":
            yield "[DONE]"
        elif line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def sse_chunks(r: httpx.Response) -> Iterator[dict[str, Any]]:
    """The chunk objects of a streamed answer (``[DONE]`` left out)."""
    for ev in sse_events(r):
        if isinstance(ev, dict):
            yield ev


async def sse_chunks_async(r: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """:func:`sse_chunks` of an ``httpx.AsyncClient`` stream."""
    async for line in r.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


class ServerProcess:
    """A ``blockdraft serve`` command in a subprocess listening on ``port``, its output in
    ``log_path``; the constructor returns once ``/health`` answers 200 (and fails with the
    output if the process exits first)."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, env: dict[str, str],
                 deadline_s: float) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.log_path = log_path
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        wait_until(self._healthy, "the server's /health", deadline_s=deadline_s)

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"blockdraft serve exited with {self.proc.returncode}:\n{self.output()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def wait(self, timeout: float = 120.0) -> int:
        """The exit code, waiting at most ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class LiveServer:
    """An app served by uvicorn on a thread, on a loopback socket bound before it starts;
    its own requests (metrics, the OpenAI clients) carry ``api_key`` when one is given."""

    def __init__(self, app: Any, api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def loop(self) -> Any:
        return self.app.state.loop

    @property
    def engine(self) -> Any:
        return self.app.state.loop.engine

    def start(self) -> LiveServer:
        self.thread.start()
        wait_until(lambda: self.server.started, "the server to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "the server did not stop"

    def openai(self, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, **kw)

    def async_openai(self, **kw: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0,
                                  **kw)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of ``/metrics``: ``{(name, sorted labels): value}``."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def pages_used(self) -> dict[str, float]:
        m = self.metrics()
        return {pool: m[("blockdraft_pool_pages_used", (("pool", pool),))] for pool in ("target", "drafter")}

    def idle(self) -> bool:
        m = self.metrics()
        return (all(m[("blockdraft_pool_pages_used", (("pool", p),))] == 0 for p in ("target", "drafter"))
                and m[("blockdraft_requests_running", ())] == 0
                and m[("blockdraft_requests_waiting", ())] == 0)

    def wait_idle(self) -> None:
        """Every page back, nothing running or waiting (within the deadline)."""
        wait_until(self.idle, "every page back and nothing running")


def requests_total(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], status: str) -> float:
    return m[("blockdraft_requests_total", (("status", status),))]


def counter(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return m[(name, ())]


def refused_total(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], reason: str) -> float:
    return m[("blockdraft_refused_requests_total", (("reason", reason),))]


@contextmanager
def live_server(pair: Pair, *, max_seq_len: int = 2048, max_active: int = 16, max_queue: int = 64,
                builtin_chat: bool = True, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                warmup: bool = False, **engine_kw: Any) -> Iterator[LiveServer]:
    """A server on ``pair`` for the duration of the block (with ``warmup``, once its warm-up
    has ended and ``/health`` answers 200); on the way out it checks the engine loop closed
    with every page back."""
    engine = build_engine(pair.target, pair.drafter, max_seq_len=max_seq_len, max_active=max_active,
                          **engine_kw)
    app = create_app(engine, pair.tokenizer, ServeConfig(MODEL, max_queue=max_queue,
                                                         builtin_chat=builtin_chat,
                                                         max_body_bytes=max_body_bytes, warmup=warmup))
    server = LiveServer(app).start()
    if warmup:
        wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200,
                   "the warm-up to end", deadline_s=WARMUP_DEADLINE_S)
    try:
        yield server
    finally:
        server.stop()
    final = server.loop.final
    assert final is not None and final.all_back, final
