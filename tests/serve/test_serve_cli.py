"""``blockdraft serve`` as a real process on loopback: graceful shutdown on SIGTERM (the running
request finishes) and on SIGINT past the shutdown timeout (it is cancelled), both exiting 0
with every page back; and the command's one-line errors."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from blockdraft.cli import main
from blockdraft.parallel import free_port

from support.serve_support import HOST, MODEL, ServerProcess, sse_events


class ServeProcess(ServerProcess):
    """``blockdraft serve`` on the built-in pair (CPU, small limits) plus ``flags``."""

    def __init__(self, tmp_path: Path, *flags: str) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "blockdraft.cli", "serve", "--host", HOST, "--port", str(port),
               "--device", "cpu", "--max-seq-len", "1024", "--max-active", "4", *flags]
        super().__init__(cmd, port, tmp_path / "serve.log", {**os.environ, "PYTHONUNBUFFERED": "1"},
                         deadline_s=120)


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Any]:
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        started.append(ServeProcess(tmp_path, *flags))
        return started[-1]

    yield start
    for p in started:
        p.kill()


def _body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def test_sigterm_lets_the_running_request_finish(launch: Any) -> None:
    srv = launch()
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{srv.url}/v1/completions", json=_body(200)) as r:
            assert r.status_code == 200
            events = sse_events(r)
            first = next(events)
            assert isinstance(first, dict) and first["choices"][0]["finish_reason"] is None
            srv.proc.send_signal(signal.SIGTERM)
            rest = list(events)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["usage"]["completion_tokens"] == 200  # type: ignore[index]
    assert [e["choices"][0]["finish_reason"] for e in rest if isinstance(e, dict) and e["choices"]][-1] == "length"
    assert srv.wait() == 0
    out = srv.output()
    assert "pools at exit: target 0/" in out and "drafter 0/" in out and "every page back" in out, out
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{srv.url}/health", timeout=5)


def test_sigint_past_the_timeout_cancels_and_exits_0(launch: Any) -> None:
    srv = launch("--shutdown-timeout", "1")
    got: list[dict[str, Any] | str] = []
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{srv.url}/v1/completions", json=_body(1000)) as r:
            assert r.status_code == 200
            events = sse_events(r)
            got.append(next(events))
            srv.proc.send_signal(signal.SIGINT)
            got.extend(events)
    # Cancelled after the timeout: an error event and [DONE], not a finish.
    assert got[-1] == "[DONE]"
    err = got[-2]["error"]  # type: ignore[index]
    assert err["code"] == "cancelled" and "shut down" in err["message"]
    finished = [e for e in got if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finished == []
    assert srv.wait() == 0
    out = srv.output()
    assert "every page back" in out and "stopped by SIGINT" in out, out
    assert "Exception in ASGI application" not in out and "Traceback" not in out, out


def test_missing_serve_extra_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install blockdraft[serve]" in err[0] and "uvicorn" in err[0]


@pytest.mark.parametrize("flags, words", [
    (["--max-active", "0"], "--max-active must be >= 1"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--port", "70000"], "--port must be <= 65535"),
    (["--max-seq-len", "1"], "--max-seq-len must be >= 2"),
    (["--shutdown-timeout", "-2"], "--shutdown-timeout"),
    (["--target", "/nonexistent"], "give both --target DIR and --drafter DIR"),
    (["--max-seq-len", "999999"], "past the target's max_position_embeddings"),
    (["--replicas", "0"], "--replicas must be a count N >= 1 or autoscaling bounds MIN:MAX"),
    (["--replicas", "two"], "--replicas must be a count N >= 1"),
    (["--replicas", "4:2"], "1 <= MIN <= MAX, not '4:2'"),
    (["--replicas", "1:2:3"], "--replicas must be"),
    (["--replicas", "-1"], "--replicas must be"),
    (["--ray-address", "auto"], "--ray-address needs --replicas N"),
    (["--replicas", "2", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "do not go with --replicas"),
    (["--replicas", "2", "--device", "cuda:1"], "its own GPU, which it sees as cuda:0"),
])
def test_bad_flags_are_one_line(flags: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("blockdraft: error: ") and words in err[0], err


def test_serve_takes_debug_before_or_after() -> None:
    from blockdraft.cli.app import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).debug is False
    assert parser.parse_args(["--debug", "serve"]).debug is True
    assert parser.parse_args(["serve", "--port", "9000", "--debug"]).debug is True


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_builtin_pair_is_served_in_fp32_on_every_device(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the main job: greedy answers from the built-in pair are exactly its target's, which
    needs fp32 also on CUDA (checked without one: the loader's choice is what is asserted)."""

    import torch

    from blockdraft import pretrained
    from blockdraft.pair.load import find_pair

    seen: dict[str, Any] = {}

    def fake_builtin_pair(**kwargs: Any) -> tuple[Any, Any, Any]:
        seen.update(kwargs)
        return None, None, None

    monkeypatch.setattr(pretrained, "builtin_pair", fake_builtin_pair)
    pair = find_pair(None, None)
    assert "B=16 drafter, fp32" in pair.description
    pair.load(torch.device(device))
    assert seen["device"] == torch.device(device)
    assert seen.get("dtype", torch.float32) == torch.float32


def test_a_port_in_use_fails_before_loading(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from blockdraft import pretrained

    loads: list[str] = []
    monkeypatch.setattr(pretrained, "builtin_pair", lambda **kw: loads.append("built-in pair"))
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **kw: loads.append("target"))
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--device", "cpu", "--host", HOST, "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"blockdraft: error: --port {port}: cannot listen on"), err
    assert loads == []


def test_serve_run_arguments_are_the_command_flags() -> None:
    """``serve run blockdraft.serve.ray_app:app_builder key=value ...``: the keys are the flags'
    names, checked as the command checks them."""
    from blockdraft.cli.common import CliError
    from blockdraft.cli.serve_setup import parse_replicas, parse_serve_args

    args = parse_serve_args({"max_active": "8", "replicas": "1:3", "no_warmup": "true", "device": "cpu",
                             "no_speculation": False})
    assert (args.max_active, args.no_warmup, args.no_speculation, args.device) == (8, True, False, "cpu")
    count = parse_replicas(args.replicas)
    assert (count.low, count.high, count.autoscaling) == (1, 3, True)
    assert parse_serve_args({}).replicas == "1"
    assert not parse_replicas("3").autoscaling
    for values, words in [({"max_actve": 8}, "unknown blockdraft serve settings: max_actve"),
                          ({"max_active": "eight"}, "--max-active"),
                          ({"max_active": 0}, "--max-active must be >= 1"),
                          ({"no_warmup": "maybe"}, "no_warmup must be true or false"),
                          ({"replicas": "0"}, "--replicas must be")]:
        with pytest.raises(CliError, match=words):
            parse_serve_args(values)
