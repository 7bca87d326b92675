"""Load on `blockdraft serve`: closed-loop clients, or Poisson traffic with and without speculation.

    python benchmarks/bench_serve.py URL [--clients N] [--requests M] [--max-tokens T]
        [--temperature X] [--model NAME] [--json PATH]
    python benchmarks/bench_serve.py --poisson URL [URL ...] [--rate R] [--duration S]
        [--tokenizer DIR] [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--json PATH]
    python benchmarks/bench_serve.py --poisson --serve "SERVE FLAGS" [...]

Every request is a streamed ``/v1/completions`` call with ``stream_options.include_usage``
and SGLang's ``return_meta_info``, so each answer reports its token counts and its tau.

Closed loop (the default): N clients send M requests each, one after another (prompts:
beginnings of common Python code, one per request in turn). Printed: one Markdown table row of

- throughput: completion tokens of all requests / wall time of the whole run;
- TTFT p50/p99: request sent -> first text chunk, over all requests;
- TPOT p50/p99: per request, (last chunk - first chunk) / (completion tokens - 1);
- inter-chunk p50/p99: gaps between consecutive text chunks (a chunk carries every token one
  speculative step accepted, so this is the latency of a step as a client sees it);
- tau: mean of the requests' ``meta_info.spec_accept_length`` (tokens per verify step).

Poisson (``--poisson``): requests arrive as a Poisson process of ``--rate`` per second for
``--duration`` seconds (or ``--num-requests`` arrivals), each with a prompt of a length drawn
uniformly from ``--min-prompt``..``--max-prompt`` tokens, cut at a random place from the
held-out files of the built-in pair's corpus (the standard-library files its build holds out by
content hash; files are joined where one is too short), and ``max_tokens`` drawn uniformly from
``--min-output``..``--max-output``. With ``--tokenizer`` (the served target's) prompts are cut
in its tokens and sent as token ids, so their lengths are exact; without it they are cut in
whitespace-separated words and sent as text (exact for a word-level tokenizer such as
``random_pair.py``'s). The server stops an answer at its end-of-text token: the achieved
lengths are reported beside the asked ones. Every server (each URL in turn, or with ``--serve``
a ``blockdraft serve FLAGS`` server and then a ``FLAGS --no-speculation`` one, each started,
warmed up and stopped here) gets the same arrivals, prompts and lengths (``--seed``). Before
the timed traffic, ``--warmup`` requests are sent at once (prompt lengths spread over the
range, outputs of different lengths) so that kernel compiles and graph captures of the batch
sizes they pass through stay out of the figures. One table, one row per server:

- req/s and tok/s: completed requests and their completion tokens / (first send -> last end);
- TTFT, TPOT as above; ITL: gaps between consecutive text chunks (with speculation a chunk
  holds every token a step accepted; without, one token);
- goodput: completed requests with TTFT <= ``--slo-ttft-ms`` and TPOT <= ``--slo-tpot-ms``
  (a one-token answer has no TPOT and meets that part) / the same wall time.

Needs httpx (part of the ``serve`` test tools). Loopback or your own hosts only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("bench_serve")

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    '"""Utilities for reading configuration files."""\n\nimport json\n',
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "for i in range(10):\n    if i % 2 == 0:",
    "def read_lines(path):\n    with open(path) as f:",
    "class Point:\n    def __init__(self, x, y):",
]


@dataclass
class Sample:
    ttft_s: float
    tokens: int
    gaps_s: list[float] = field(default_factory=list)
    tpot_s: float | None = None
    tau: float | None = None
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    sent_s: float = 0.0  # send time after the start of the traffic
    end_s: float = 0.0
    error: str | None = None


async def one(client: httpx.AsyncClient, model: str | None, prompt: str | list[int], max_tokens: int,
              temperature: float, t0: float | None = None) -> Sample:
    """One streamed completion; a failure is the sample's ``error`` (times then mean nothing)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True},
                            "return_meta_info": True}
    if model is not None:
        body["model"] = model
    start = time.perf_counter()
    t0 = start if t0 is None else t0
    times: list[float] = []
    tokens, tau, prompt_tokens = 0, None, None
    error = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("meta_info"):
                    tau = chunk["meta_info"]["spec_accept_length"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
        if not times:
            raise RuntimeError("the answer had no text")
    except (RuntimeError, httpx.HTTPError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(times, times[1:])]
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and times else None
    return Sample(times[0] - start if times else 0.0, tokens, gaps, tpot, tau, prompt_tokens, max_tokens,
                  start - t0, end - t0, error)


async def run(url: str, clients: int, requests: int, max_tokens: int, temperature: float,
              model: str | None) -> tuple[list[Sample], float]:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker(c: int) -> list[Sample]:
            out = []
            for r in range(requests):
                s = await one(client, model, PROMPTS[(c * requests + r) % len(PROMPTS)], max_tokens,
                              temperature)
                if s.error is not None:
                    raise RuntimeError(s.error)
                out.append(s)
            return out

        start = time.perf_counter()
        per_client = await asyncio.gather(*(worker(c) for c in range(clients)))
        return [s for samples in per_client for s in samples], time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def _pcts(values: list[float], name: str) -> dict[str, float | None]:
    return {f"{name}_p50": pct(values, 50) if values else None, f"{name}_p99": pct(values, 99) if values else None}


def ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


# Poisson traffic ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One request of the traffic: when it is sent (seconds after the start), its prompt (token
    ids, or text of ``prompt_len`` words) and its ``max_tokens``."""

    at_s: float
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int


def heldout_files() -> list[str]:
    """The texts of the built-in pair's held-out corpus files found in this interpreter's
    standard library (those its build holds out by content hash), in path order."""
    from blockdraft.training.builtin.licences import permissive_python_sources
    from blockdraft.training.builtin.presets import PRESETS
    from blockdraft.training.data import split_heldout

    files, _ = permissive_python_sources(max_chars=1 << 30, site_roots=[])
    _, held = split_heldout(files, PRESETS["h200"].heldout_every)
    if not held:
        raise RuntimeError("no held-out corpus file in this interpreter's standard library")
    return [f.text for f in held]


def token_stream(texts: list[str], tokenizer: Any | None) -> tuple[list[int] | list[str], list[int]]:
    """The held-out files one after another, in the tokenizer's ids (else in words), and where
    each file starts in it."""
    stream: list[Any] = []
    starts = []
    for text in texts:
        starts.append(len(stream))
        stream.extend(tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None
                      else text.split())
    return stream, starts


def plan_traffic(stream: list[int] | list[str], starts: list[int], *, rate: float, duration_s: float,
                 num_requests: int | None, prompt_range: tuple[int, int], output_range: tuple[int, int],
                 seed: int) -> list[Planned]:
    """Poisson arrivals at ``rate`` per second (exponential gaps) for ``duration_s`` seconds, or
    exactly ``num_requests`` of them; each prompt a random cut of ``stream`` starting inside a
    random file and running on into the next files when that one is short."""
    rng = random.Random(seed)
    out: list[Planned] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if (num_requests is None and t >= duration_s) or (num_requests is not None and len(out) >= num_requests):
            return out
        length = rng.randint(*prompt_range)
        f = rng.randrange(len(starts))
        end_f = starts[f + 1] if f + 1 < len(starts) else len(stream)
        at = starts[f] + rng.randrange(max(1, end_f - starts[f]))
        cut = [stream[(at + i) % len(stream)] for i in range(length)]
        prompt: str | list[int] = " ".join(str(w) for w in cut) if cut and isinstance(cut[0], str) else cut
        out.append(Planned(t, prompt, length, rng.randint(*output_range)))


def warmup_plan(n: int, stream: list[int] | list[str], prompt_range: tuple[int, int],
                output_range: tuple[int, int]) -> list[Planned]:
    """``n`` requests sent at once: prompt lengths spread over the range, outputs of distinct
    lengths (so the batch passes through every size from ``n`` down to 1)."""
    lo, hi = prompt_range
    out = []
    for i in range(n):
        length = lo + (hi - lo) * i // max(1, n - 1)
        cut = [stream[(i * 997 + k) % len(stream)] for k in range(length)]
        prompt: str | list[int] = " ".join(str(w) for w in cut) if isinstance(cut[0], str) else cut
        out.append(Planned(0.0, prompt, length, min(output_range[1], output_range[0] + 4 * i)))
    return out


def probe_plan(n: int, stream: list[int] | list[str], length: int) -> list[Planned]:
    """``n`` requests of ``length``-token prompts (consecutive cuts of ``stream`` from its
    start), 16 new tokens each, all at time 0 (each is sent alone)."""
    out = []
    for i in range(n):
        cut = stream[(i * length) % max(1, len(stream) - length):][:length]
        prompt: str | list[int] = cut if not cut or isinstance(cut[0], int) else " ".join(cut)  # type: ignore[arg-type]
        out.append(Planned(0.0, prompt, length, 16))
    return out


async def send_traffic(url: str, plan: list[Planned], model: str | None,
                       temperature: float) -> tuple[list[Sample], float]:
    """Send every planned request at its time; ``(samples in plan order, first send -> last end)``."""
    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()

        async def at(p: Planned) -> Sample:
            await asyncio.sleep(max(0.0, t0 + p.at_s - time.perf_counter()))
            return await one(client, model, p.prompt, p.max_tokens, temperature, t0)

        samples = list(await asyncio.gather(*(at(p) for p in plan)))
    first = min((s.sent_s for s in samples), default=0.0)
    return samples, max((s.end_s for s in samples), default=0.0) - first


def speculation_of(url: str) -> bool | None:
    """The server's ``blockdraft_speculation`` gauge (``None``: it does not export one)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("blockdraft_speculation "):
            return float(line.split()[1]) == 1.0
    return None


def summarize(samples: list[Sample], wall: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    ttft = [s.ttft_s * 1000 for s in ok]
    tpot = [s.tpot_s * 1000 for s in ok if s.tpot_s is not None]
    gaps = [g * 1000 for s in ok for g in s.gaps_s]
    good = [s for s in ok if s.ttft_s * 1000 <= slo_ttft_ms
            and (s.tpot_s is None or s.tpot_s * 1000 <= slo_tpot_ms)]
    taus = [s.tau for s in ok if s.tau is not None]
    tokens = sum(s.tokens for s in ok)
    return {
        "requests_sent": len(samples), "requests_completed": len(ok), "requests_failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if s.error is not None}),
        "wall_s": wall, "completion_tokens": tokens,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "goodput_requests_per_s": len(good) / wall if wall > 0 else 0.0, "requests_meeting_slo": len(good),
        **_pcts(ttft, "ttft_ms"), **_pcts(tpot, "tpot_ms"), **_pcts(gaps, "itl_ms"),
        "prompt_tokens_mean": statistics.fmean(s.prompt_tokens for s in ok if s.prompt_tokens is not None)
        if any(s.prompt_tokens is not None for s in ok) else None,
        "completion_tokens_mean": statistics.fmean(s.tokens for s in ok) if ok else None,
        "max_tokens_mean": statistics.fmean(s.max_tokens or 0 for s in ok) if ok else None,
        "tau": statistics.fmean(taus) if taus else None,
    }


class Server:
    """``blockdraft serve FLAGS`` on a free loopback port, its output in ``log_path``, ready
    once ``/health`` answers; :meth:`stop` sends SIGINT and waits."""

    def __init__(self, flags: list[str], log_path: Path, start_timeout_s: float) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        cmd = [sys.executable, "-m", "blockdraft.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
        log.info("starting %s", shlex.join(cmd))
        started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = started + start_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
                raise RuntimeError(f"the server did not become healthy (log {log_path}):\n{tail}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - started
        """Seconds from the launch to the first healthy ``/health`` (load, warm-up, bind)."""

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.proc.returncode != 0:
            log.warning("the server at %s exited with %s (log %s)", self.url, self.proc.returncode, self.log_path)


def poisson(args: argparse.Namespace) -> int:
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    stream, starts = token_stream(heldout_files(), tokenizer)
    prompts = (args.min_prompt, args.max_prompt)
    outputs = (args.min_output, args.max_output)
    plan = plan_traffic(stream, starts, rate=args.rate, duration_s=args.duration, num_requests=args.num_requests,
                        prompt_range=prompts, output_range=outputs, seed=args.seed)
    warm = warmup_plan(args.warmup, stream, prompts, outputs) if args.warmup else []
    log.info("%d requests over %.1f s at %.2f/s (seed %d); %d warm-up requests", len(plan),
             plan[-1].at_s if plan else 0.0, args.rate, args.seed, len(warm))
    targets: list[tuple[str, list[str] | None]] = [(u.rstrip("/"), None) for u in args.url]
    if args.serve is not None:
        flags = shlex.split(args.serve)
        targets += [("speculation on", flags), ("speculation off", [*flags, "--no-speculation"])]
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_serve-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, (label, flags_i) in enumerate(targets):
        server = None if flags_i is None else Server(flags_i, logs / f"serve{i}.log", args.start_timeout)
        url = label if server is None else server.url
        try:
            if warm:
                got, _ = asyncio.run(send_traffic(url, warm, args.model, args.temperature))
                failed = [s.error for s in got if s.error is not None]
                if failed:
                    raise RuntimeError(f"{label}: warm-up request failed: {failed[0]}")
            speculation = speculation_of(url)
            probes = [asyncio.run(send_traffic(url, [p], args.model, args.temperature))[0][0]
                      for p in probe_plan(args.probe, stream, args.probe_len)]
            samples, wall = asyncio.run(send_traffic(url, plan, args.model, args.temperature))
        finally:
            if server is not None:
                server.stop()
        summary = summarize(samples, wall, args.slo_ttft_ms, args.slo_tpot_ms)
        summary["ready_s"] = None if server is None else server.ready_s
        probe_ttft = [p.ttft_s * 1000 for p in probes if p.error is None]
        summary.update(_pcts(probe_ttft, "probe_ttft_ms"))
        runs.append({"label": label, "speculation": speculation, "summary": summary,
                     "samples": [asdict(s) for s in samples]})
    print(f"Poisson traffic: {args.rate:g} req/s, {len(plan)} requests, prompts {prompts[0]}..{prompts[1]} "
          f"tokens, max_tokens {outputs[0]}..{outputs[1]}, seed {args.seed}; goodput SLO: TTFT <= "
          f"{args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print(f"Before the traffic: {args.probe} requests one at a time, {args.probe_len}-token prompts, "
          "16 new tokens (\"probe TTFT\"); \"ready\": seconds from a --serve server's launch to /health 200")
    print("| server | speculation | completed / sent | req/s | tok/s "
          "| goodput req/s | TTFT p50 / p99 ms "
          "| TPOT p50 / p99 ms | ITL p50 / p99 ms | prompt / output tokens (asked) | tau | ready s "
          "| probe TTFT p50 / p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        s = r["summary"]
        spec = {True: "on", False: "off", None: "?"}[r["speculation"]]
        ready = "—" if s["ready_s"] is None else f"{s['ready_s']:.1f}"
        print(f"| {r['label']} | {spec} | {s['requests_completed']} / {s['requests_sent']} "
              f"| {s['requests_per_s']:.2f} | {s['tokens_per_s']:.1f} | {s['goodput_requests_per_s']:.2f} "
              f"| {ms(s['ttft_ms_p50'])} / {ms(s['ttft_ms_p99'])} | {ms(s['tpot_ms_p50'])} / {ms(s['tpot_ms_p99'])} "
              f"| {ms(s['itl_ms_p50'])} / {ms(s['itl_ms_p99'])} | {ms(s['prompt_tokens_mean'])} / "
              f"{ms(s['completion_tokens_mean'])} ({ms(s['max_tokens_mean'])}) "
              f"| {'—' if s['tau'] is None else format(s['tau'], '.2f')} | {ready} "
              f"| {ms(s['probe_ttft_ms_p50'])} / {ms(s['probe_ttft_ms_p99'])} |")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json",)}
        Path(args.json).write_text(json.dumps({"config": config, "runs": runs}, indent=1), encoding="utf-8")
    return 0 if all(r["summary"]["requests_failed"] == 0 for r in runs) else 1


def closed_loop(args: argparse.Namespace) -> int:
    samples, wall = asyncio.run(run(args.url[0].rstrip("/"), args.clients, args.requests,
                                    args.max_tokens, args.temperature, args.model))
    tokens = sum(s.tokens for s in samples)
    ttft = [s.ttft_s * 1000 for s in samples]
    tpot = [s.tpot_s * 1000 for s in samples if s.tpot_s is not None]
    gaps = [g * 1000 for s in samples for g in s.gaps_s]
    taus = [s.tau for s in samples if s.tau is not None]
    summary = {
        "clients": args.clients, "requests": len(samples), "max_tokens": args.max_tokens,
        "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50) if tpot else None, "tpot_ms_p99": pct(tpot, 99) if tpot else None,
        "chunk_gap_ms_p50": pct(gaps, 50) if gaps else None,
        "chunk_gap_ms_p99": pct(gaps, 99) if gaps else None,
        "tau": statistics.fmean(taus) if taus else None,
    }
    print("| clients x requests | max tokens | tokens | wall s | tokens/s | TTFT p50 / p99 ms "
          "| TPOT p50 / p99 ms | inter-chunk p50 / p99 ms | tau |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {args.clients} x {args.requests} | {args.max_tokens} | {tokens} | {wall:.2f} "
          f"| {summary['tokens_per_s']:.1f} | {ms(summary['ttft_ms_p50'])} / {ms(summary['ttft_ms_p99'])} "
          f"| {ms(summary['tpot_ms_p50'])} / {ms(summary['tpot_ms_p99'])} "
          f"| {ms(summary['chunk_gap_ms_p50'])} / {ms(summary['chunk_gap_ms_p99'])} "
          f"| {'—' if summary['tau'] is None else format(summary['tau'], '.2f')} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "samples": [asdict(s) for s in samples]}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("url", nargs="*", help="the server's base URL, e.g. http://127.0.0.1:8000 "
                                           "(--poisson: one or more, measured in turn)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--model", default=None, help="model id to send (default: none, the served one)")
    ap.add_argument("--json", default=None, help="also write every sample and the summary here")
    po = ap.add_argument_group("Poisson traffic")
    po.add_argument("--poisson", action="store_true", help="Poisson arrivals instead of closed-loop clients")
    po.add_argument("--serve", default=None, metavar="FLAGS",
                    help="start `blockdraft serve FLAGS`, then `FLAGS --no-speculation`, and measure each")
    po.add_argument("--rate", type=float, default=4.0, help="arrivals per second (default 4)")
    po.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (default 60)")
    po.add_argument("--num-requests", type=int, default=None, help="this many arrivals instead of --duration")
    po.add_argument("--seed", type=int, default=0)
    po.add_argument("--min-prompt", type=int, default=16)
    po.add_argument("--max-prompt", type=int, default=2048)
    po.add_argument("--min-output", type=int, default=32)
    po.add_argument("--max-output", type=int, default=512)
    po.add_argument("--tokenizer", default=None, help="the served target's tokenizer (directory or hub id): "
                                                      "prompts cut in its tokens, sent as ids")
    po.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    po.add_argument("--slo-tpot-ms", type=float, default=50.0)
    po.add_argument("--probe", type=int, default=8, help="requests sent one at a time before the traffic, "
                    "each a --probe-len token prompt (their TTFT: a short prompt at one client)")
    po.add_argument("--probe-len", type=int, default=32)
    po.add_argument("--warmup", type=int, default=32, help="requests sent at once before the timed traffic")
    po.add_argument("--start-timeout", type=float, default=900.0, help="seconds a --serve server may take to start")
    po.add_argument("--log-dir", default=None, help="where --serve servers write their logs (default: a new "
                                                    "temporary directory)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if not args.poisson:
        if len(args.url) != 1 or args.serve is not None:
            ap.error("give one URL (--serve needs --poisson)")
        return closed_loop(args)
    if not args.url and args.serve is None:
        ap.error("--poisson needs a URL or --serve FLAGS")
    if not (args.rate > 0 and 1 <= args.min_prompt <= args.max_prompt and 1 <= args.min_output <= args.max_output):
        ap.error("need --rate > 0, 1 <= --min-prompt <= --max-prompt, 1 <= --min-output <= --max-output")
    if args.num_requests is not None and args.num_requests < 1:
        ap.error("--num-requests must be >= 1")
    try:
        return poisson(args)
    except RuntimeError as exc:  # a server that did not start, a warm-up request that failed
        print(f"bench_serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
