"""Load on a running `blockdraft serve`: N concurrent clients x M streaming requests each.

    python benchmarks/bench_serve.py URL [--clients N] [--requests M] [--max-tokens T]
        [--temperature X] [--model NAME] [--json PATH]

Every request is a streamed ``/v1/completions`` call (prompts: beginnings of common Python
code, one per request in turn) with ``stream_options.include_usage`` and SGLang's
``return_meta_info``, so each answer reports its token count and its tau. Printed: one
Markdown table row of

- throughput: completion tokens of all requests / wall time of the whole run;
- TTFT p50/p99: request sent -> first text chunk, over all requests;
- TPOT p50/p99: per request, (last chunk - first chunk) / (completion tokens - 1);
- inter-chunk p50/p99: gaps between consecutive text chunks (a chunk carries every token one
  speculative step accepted, so this is the latency of a step as a client sees it);
- tau: mean of the requests' ``meta_info.spec_accept_length`` (tokens per verify step).

Needs httpx (part of the ``serve`` test tools). Loopback or your own hosts only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

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


async def one(client: httpx.AsyncClient, model: str | None, prompt: str, max_tokens: int,
              temperature: float) -> Sample:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "return_meta_info": True}
    if model is not None:
        body["model"] = model
    start = time.perf_counter()
    times: list[float] = []
    tokens, tau = 0, None
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
            if chunk.get("meta_info"):
                tau = chunk["meta_info"]["spec_accept_length"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("the answer had no text")
    gaps = [b - a for a, b in zip(times, times[1:])]
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
    return Sample(times[0] - start, tokens, gaps, tpot, tau)


async def run(url: str, clients: int, requests: int, max_tokens: int, temperature: float,
              model: str | None) -> tuple[list[Sample], float]:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker(c: int) -> list[Sample]:
            return [await one(client, model, PROMPTS[(c * requests + r) % len(PROMPTS)], max_tokens,
                              temperature) for r in range(requests)]

        start = time.perf_counter()
        per_client = await asyncio.gather(*(worker(c) for c in range(clients)))
        return [s for samples in per_client for s in samples], time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--model", default=None, help="model id to send (default: none, the served one)")
    ap.add_argument("--json", default=None, help="also write every sample and the summary here")
    args = ap.parse_args(argv)
    samples, wall = asyncio.run(run(args.url.rstrip("/"), args.clients, args.requests,
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

    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v:.1f}"

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


if __name__ == "__main__":
    sys.exit(main())
