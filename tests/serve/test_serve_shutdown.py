"""``blockdraft serve`` as a real process behind TLS and an API key, stopped by SIGTERM under
load: short streams finish, long ones running or still waiting are answered with an error
(a stream's error event, a plain request's 503) when ``--shutdown-timeout`` ends, the
process exits 0 and its log shows every page back. The key comes from the environment and
never reaches the log; the certificate is made by the test."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import ssl
import sys
from pathlib import Path
from typing import Any

import httpx

from blockdraft.parallel import free_port

from support.serve_support import HOST, MODEL, ServerProcess, wait_until
from support.tls import self_signed

KEY = "sk-shutdown-3e8d21"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = 1900  # far more than the built-in pair makes on a CPU within the shutdown timeout
SHORT = 80  # a few verify steps: running at the signal, done well within the timeout


class TLSServeProcess(ServerProcess):
    """``blockdraft serve`` on the built-in pair over HTTPS with an API key from the
    environment (CPU, no warm-up: every path still works, the first requests just compile)."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        key, cert = self_signed(tmp_path)
        self.verify = ssl.create_default_context(cafile=str(cert))
        port = free_port()
        cmd = [sys.executable, "-m", "blockdraft.cli", "serve", "--host", HOST, "--port", str(port),
               "--device", "cpu", "--max-seq-len", "2048", "--max-active", "4", "--no-warmup",
               "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "BLOCKDRAFT_API_KEY": KEY}
        super().__init__(cmd, port, tmp_path / "serve.log", env, deadline_s=120)
        self.url = f"https://{HOST}:{port}"

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"blockdraft serve exited with {self.proc.returncode}:\n{self.output()}")
        try:
            return httpx.get(f"https://{HOST}:{self.port}/health", verify=self.verify, timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def gauges(self) -> tuple[int, int]:
        """(running, waiting) from ``/metrics`` (which needs the key)."""
        text = httpx.get(f"{self.url}/metrics", headers=AUTH, verify=self.verify, timeout=10).text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(("blockdraft_requests_running ", "blockdraft_requests_waiting "))}
        return int(values["blockdraft_requests_running"]), int(values["blockdraft_requests_waiting"])


def _body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


async def _open(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[Any, Any]:
    cm = client.stream("POST", "/v1/completions", json=body)
    r = await cm.__aenter__()
    assert r.status_code == 200
    return cm, r.aiter_lines()


async def _first(lines: Any) -> list[str]:
    """Read up to the first chunk (the request is then running)."""
    got = []
    while not got or not got[-1].startswith("data: {"):
        got.append(await lines.__anext__())
    return got


async def _rest(cm: Any, lines: Any, got: list[str]) -> list[str]:
    got.extend([line async for line in lines])
    await cm.__aexit__(None, None, None)
    return [line[len("data: "):] for line in got if line.startswith("data: ")]


def _text(events: list[str]) -> str:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def test_sigterm_under_load_over_tls(tmp_path: Path) -> None:
    srv = TLSServeProcess(tmp_path, "--shutdown-timeout", "12")

    async def scenario() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=srv.url, verify=srv.verify, timeout=120,
                                     limits=httpx.Limits(max_connections=16)) as client:
            assert (await client.get("/health")).status_code == 200
            denied = await client.post("/v1/completions", json=_body(4, stream=False))
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            client.headers.update(AUTH)
            ok = await client.post("/v1/completions", json=_body(4, stream=False))
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            running = [await _open(client, _body(n)) for n in (LONG, LONG, SHORT, SHORT)]
            firsts = [await _first(lines) for _, lines in running]
            waiting = await _open(client, _body(LONG))
            plain = asyncio.ensure_future(client.post("/v1/completions", json=_body(LONG, stream=False)))
            await asyncio.to_thread(wait_until, lambda: srv.gauges() == (4, 2), "4 running and 2 waiting")
            srv.proc.send_signal(signal.SIGTERM)
            streams = await asyncio.gather(*(_rest(cm, lines, got) for (cm, lines), got in zip(running, firsts)),
                                           _rest(*waiting, []))
            return {"streams": streams, "plain": await plain}

    got = asyncio.run(scenario())
    assert srv.wait() == 0
    long_a, long_b, short_a, short_b, queued = got["streams"]
    for events in (short_a, short_b):  # finished within the timeout
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == SHORT
    assert _text(short_a) == _text(short_b) != ""  # the same greedy answer beside different loads
    for events in (long_a, long_b, queued):  # cancelled when the timeout ended
        assert events[-1] == "[DONE]", events[-3:]
        assert json.loads(events[-2])["error"]["code"] == "cancelled"
        assert not any('"finish_reason":"length"' in e for e in events)
    plain = got["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "cancelled"
    out = srv.output()
    assert "stopped by SIGTERM" in out and re.search(r"draining: [3-6] requests running, [0-2] waiting", out), out
    assert "pools at exit: target 0/" in out and "drafter 0/" in out and "every page back" in out, out
    assert "Traceback" not in out and KEY not in out, out
    assert "OpenAI base URL https://" in out and "API key required" in out
