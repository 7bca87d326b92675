"""``blockdraft serve --tp 2`` as real processes on loopback (CPU, gloo): rank 0 serves HTTP and
rank 1 follows it. Completions, streamed and not, one at a time and side by side, equal the
built-in pair's own greedy output; an idle stretch longer than the collective timeout leaves the
group working (rank 0's heartbeats); SIGTERM on the launcher, or on rank 0 under ``torchrun``,
exits 0 with every page back; a killed rank ends the command with one line naming it."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from blockdraft.cli import main
from blockdraft.cli.serve import PID_DIR_ENV
from blockdraft.parallel import free_port
from blockdraft.serve.tp import heartbeat_s

from support.scorecard import score
from support.serve_support import HOST, MODEL, Pair, ServerProcess, builtin_pair, sse_events, wait_until
from support.tp_support import pid_alive

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo on loopback, Linux signals")

TP_TIMEOUT_S = 10.0
"""The group's collective timeout in these runs: short, so that an idle follower that got no
heartbeat would time out within the test."""
HANG_BOUND_S = 30.0
"""A dead rank must end the command well before this (the launcher's watchdog acts within
about a second, then gives the other ranks a few seconds to stop)."""
MAX_TOKENS = 24
TARGET_PAGES = 24
"""Target pages of the first server: every request of the test fits, one asking for 16 tokens
per page more than that can never run."""
PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef main():", "class Stack:\n    def push(self, x):")

ROOT = Path(__file__).resolve().parents[2]


def _env(pid_dir: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PID_DIR_ENV: str(pid_dir)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    return env


class TPServer(ServerProcess):
    """``blockdraft serve --tp 2`` (or the same command under ``torchrun``) in a subprocess."""

    def __init__(self, tmp_path: Path, *flags: str, torchrun: bool = False) -> None:
        port = free_port()
        self.pid_dir = tmp_path / "pids"
        self.pid_dir.mkdir()
        argv = ["serve", "--host", HOST, "--port", str(port), "--device", "cpu",
                "--max-seq-len", "1024", "--max-active", "4", "--tp-timeout", str(TP_TIMEOUT_S),
                *flags]
        if torchrun:
            cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
                   "--nproc-per-node", "2", "-m", "blockdraft.cli", *argv]
        else:
            cmd = [sys.executable, "-m", "blockdraft.cli", *argv, "--tp", "2"]
        super().__init__(cmd, port, tmp_path / "serve.log", _env(self.pid_dir), deadline_s=180)
        wait_until(lambda: all((self.pid_dir / f"rank{r}.pid").exists() for r in range(2)),
                   "both ranks' pid files")
        self.ranks = [int((self.pid_dir / f"rank{r}.pid").read_text()) for r in range(2)]

    def kill(self) -> None:
        super().kill()
        for pid in getattr(self, "ranks", []):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

    def complete(self, prompt: str, *, stream: bool, max_tokens: int = MAX_TOKENS) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": stream}
        if not stream:
            r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["usage"]["prompt_tokens"] > 0
            return str(out["choices"][0]["text"])
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            events = list(sse_events(r))
        assert events[-1] == "[DONE]"
        return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert found is not None, text
        return float(found.group(1))


@pytest.fixture(scope="module")
def solo() -> dict[str, str]:
    """The built-in pair's own greedy text for each prompt (one rank, ``blockdraft.generate``)."""
    pair: Pair = builtin_pair()
    return {p: pair.solo_text(p, MAX_TOKENS) for p in PROMPTS}


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    started: list[TPServer] = []

    def go(*flags: str, **kw: Any) -> TPServer:
        started.append(TPServer(tmp_path, *flags, **kw))
        return started[-1]

    yield go
    for srv in started:
        srv.kill()


def test_tp2_answers_as_one_rank_survives_idle_and_stops_on_sigterm(start: Any,
                                                                     solo: dict[str, str]) -> None:
    srv = start("--target-pages", str(TARGET_PAGES))
    assert srv.metric("blockdraft_tp_size") == 2
    assert "tensor parallel over 2 ranks (gloo)" in srv.output()
    assert srv.complete(PROMPTS[0], stream=False) == solo[PROMPTS[0]]

    # Refused by rank 0's engine after it drew a request id: every rank makes that call, so
    # the next request gets the same id everywhere (a rank that did not would stop the group).
    r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 16 * TARGET_PAGES, "temperature": 0})
    assert r.status_code == 400 and "can never run" in r.json()["error"]["message"], r.text
    assert srv.complete(PROMPTS[1], stream=True) == solo[PROMPTS[1]]
    # A grammar is refused before any rank sees it (a compiled grammar cannot travel).
    r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[0], "response_format": {"type": "json_object"}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format" and err["code"] == "unsupported", r.text

    # Side by side: their submissions reach the ranks in one or several ticks, one batch.
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(
        i, srv.complete(PROMPTS[i], stream=i % 2 == 1))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {i: solo[p] for i, p in enumerate(PROMPTS)}

    # A client that leaves mid-stream: rank 0 cancels its request and rank 1 must too, or the
    # ranks' next steps would run different batches.
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
        assert isinstance(next(sse_events(r)), dict)
    wait_until(lambda: srv.metric('blockdraft_pool_pages_used{pool="target"}') == 0
               and srv.metric("blockdraft_requests_running") == 0, "the left request cancelled")
    assert srv.complete(PROMPTS[0], stream=True) == solo[PROMPTS[0]]

    # Idle past the collective timeout: rank 1 waits in a broadcast all along, and only rank
    # 0's heartbeats keep that wait short of the timeout.
    assert heartbeat_s(TP_TIMEOUT_S) < TP_TIMEOUT_S / 4
    time.sleep(TP_TIMEOUT_S + 3)
    assert srv.proc.poll() is None, srv.output()
    assert srv.complete(PROMPTS[2], stream=False) == solo[PROMPTS[2]]
    assert srv.metric('blockdraft_pool_pages_used{pool="target"}') == 0

    srv.proc.send_signal(signal.SIGTERM)
    assert srv.wait(60) == 0, srv.output()
    out = srv.output()
    assert "stopped by SIGTERM" in out and "every page back" in out, out
    assert "Traceback" not in out, out
    wait_until(lambda: not any(pid_alive(pid) for pid in srv.ranks), "both ranks to exit", 10)


@pytest.mark.skipif(not Path(sys.executable).with_name("torchrun").exists(), reason="needs torchrun")
def test_under_torchrun_sigterm_on_rank_0_stops_every_rank(start: Any, solo: dict[str, str]) -> None:
    """The same command under ``torchrun --nproc-per-node 2``: rank 0 stopped by SIGTERM
    drains, tells rank 1 to stop, and torchrun ends with 0."""
    srv = start(torchrun=True)
    assert srv.metric("blockdraft_tp_size") == 2
    assert srv.complete(PROMPTS[0], stream=True) == solo[PROMPTS[0]]
    os.kill(srv.ranks[0], signal.SIGTERM)
    assert srv.wait(60) == 0, srv.output()
    out = srv.output()
    assert "stopped by SIGTERM" in out and "every page back" in out, out
    assert not any(pid_alive(pid) for pid in srv.ranks)


def test_killed_rank_ends_the_command_with_one_line(start: Any) -> None:
    """SIGKILL rank 1 while rank 0 streams: the stream ends (no hang), the command exits 2 in
    bounded time with one error line naming rank 1, and rank 0 is gone too."""
    srv = start()
    ended: list[str] = []

    def stream() -> None:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0,
                "stream": True}
        try:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
                for _ in sse_events(r):
                    if not ended:
                        ended.append("first")
        except httpx.TransportError:
            pass
        ended.append("ended")

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    wait_until(lambda: bool(ended), "the stream's first event")
    killed_at = time.monotonic()
    os.kill(srv.ranks[1], signal.SIGKILL)
    rc = srv.wait(HANG_BOUND_S)
    assert time.monotonic() - killed_at < HANG_BOUND_S
    assert rc == 2
    last = srv.output().strip().splitlines()[-1]
    assert last == ("blockdraft: error: tensor-parallel rank 1 was killed by signal SIGKILL; "
                    "the other ranks were stopped"), srv.output()
    client.join(HANG_BOUND_S)
    assert ended[-1] == "ended"
    assert not pid_alive(srv.ranks[0])
    score.fault_points += 1


@pytest.mark.parametrize("flags, words", [
    (["--tp", "0"], "--tp must be >= 1"),
    # The built-in target: 6 heads, 2 K/V heads.
    (["--tp", "3"], "tensor parallelism 3 does not split Qwen3ForCausalLM: num_key_value_heads=2 "
                    "is not divisible by 3"),
    (["--tp", "4"], "tensor parallelism 4 does not split Qwen3ForCausalLM: num_attention_heads=6 "
                    "and num_key_value_heads=2 are not divisible by 4"),
    (["--tp", "2", "--tp-timeout", "0"], "--tp-timeout must be > 0 seconds"),
])
def test_bad_tp_flags_are_one_line(flags: list[str], words: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("blockdraft: error: ") and words in err[0], err
    score.bad_inputs += 1
    score.clear_errors += 1
