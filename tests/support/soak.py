"""A traffic soak of ``blockdraft serve``: a day of traffic, compressed, with faults.

An in-process server on the built-in pair (small ``max_active`` and ``max_queue``) takes
rounds of seeded Poisson arrivals; each round also holds one burst of more requests than
``max_active + max_queue``, so some are refused with 429. The mix of clients:

| kind | what the client does | what it must get |
| --- | --- | --- |
| ``plain``, ``chat`` | a greedy completion / chat completion | the solo answer (or 429, or an injected fault's 5xx) |
| ``stream``, ``chat_stream`` | the same, streamed | the solo answer (or 429, or an injected fault's error event) |
| ``disconnect`` | a stream it closes after a few chunks | a prefix of the solo answer |
| ``leave`` | a plain request it drops before the first byte (mostly while queued) | nothing; it is cancelled |
| ``bad`` | malformed JSON, bad fields, an unknown model, a body past the limit | 400/404/413 in OpenAI's error shape |

Each round arms one fault of :mod:`blockdraft.faults` inside the engine's step (the sites of
:data:`FAULT_STATUS`, in turn) partway through its arrivals; the request or step it hits is
answered 500 (``internal_error``) or, for device memory, 503 (``out_of_memory``), on a stream
as the error event. The solo answers (``blockdraft.generate`` on the same pair, greedy) are
computed once per distinct prompt before the server starts, so no armed fault reaches them.

After every round (a checkpoint) the soak waits for the server to be idle and checks: pages
used back to 0 in both pools, ``/health`` ok and the engine loop alive, every request the app
saw counted once in ``blockdraft_requests_total`` (the 400/404s as ``invalid``, the 429s as
``rejected``) and each 413 once in ``blockdraft_refused_requests_total``, and records the
process's resident memory (the server runs in this process).
Anything that breaks a rule is one line of :attr:`SoakFigures.problems`.

The CI test runs a fixed number of rounds; its long profile runs rounds for a given time
(``tests/reliability/test_serve_soak.py`` says how).
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx

from blockdraft import faults
from blockdraft.serve.chat import ChatFormat
from blockdraft.serve.metrics import STATUSES

from support.scorecard import score
from support.serve_support import MODEL, LiveServer, Pair, live_server, refused_total, requests_total, wait_until
from support.words import random_words

FAULT_STATUS: dict[str, tuple[int, str]] = {
    "target_pages": (500, "internal_error"),  # a new request's target pages: that request fails
    "prefill": (503, "out_of_memory"),  # a prefill alone fails its request (a batch is retried alone)
    "target_forward": (503, "out_of_memory"),  # a verify: every request of the step fails
    "accumulator": (503, "out_of_memory"),  # at admission one request, in a commit the whole step
    "forward": (500, "internal_error"),  # a drafter forward: its request fails (a batch may fall back)
    "kv_cache": (503, "out_of_memory"),  # a context K/V write: its request or its step
}
"""The fault sites the soak arms, each with the status and error code a client hit by it gets
(500 for a failure, 503 ``out_of_memory`` for device memory)."""

KINDS: tuple[tuple[str, float], ...] = (
    ("plain", 0.2), ("stream", 0.2), ("chat", 0.12), ("chat_stream", 0.12),
    ("disconnect", 0.12), ("leave", 0.08), ("bad", 0.16),
)
"""The share of each kind of client among the Poisson arrivals."""

MAX_TOKENS = (4, 40)
"""The range of a request's ``max_tokens`` (the solo answers are this long at most)."""
LEAVE_S = 0.05
"""How long a ``leave`` client waits for its answer's first byte before closing."""
MAX_BODY_BYTES = 16 * 1024
"""The soak server's body limit (a ``bad`` body past it is a 413)."""

# Python source the built-in pair continues well: the prompts are pieces of it.
CODE = '''import json
import os
from dataclasses import dataclass


@dataclass
class Config:
    name: str
    size: int = 0
    tags: list[str] | None = None


def load_config(path):
    """Read a config file and return a Config."""
    with open(path) as f:
        data = json.load(f)
    return Config(name=data["name"], size=int(data.get("size", 0)), tags=data.get("tags"))


def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()


def read_lines(path):
    with open(path) as f:
        for line in f:
            yield line.rstrip("\\n")


def count_words(text):
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts


def main():
    config = load_config(os.environ.get("CONFIG", "config.json"))
    print(config.name, fibonacci(config.size))
'''


@dataclass(frozen=True)
class SoakConfig:
    """One soak's traffic.

    Attributes:
        rounds: rounds to run (each ends in a checkpoint); with ``duration_s`` at least this many.
        duration_s: run rounds until this much time has passed (``None``: ``rounds`` only).
        per_round: Poisson arrivals per round (the burst comes on top).
        rate: arrivals per second.
        seed: starts the random draws of prompts, arrivals, kinds, lengths and fault positions.
        max_active: the server's ``max_active``.
        max_queue: the server's ``max_queue``.
        prompts: distinct prompts (pieces of :data:`CODE`).
    """

    rounds: int = 6
    duration_s: float | None = None
    per_round: int = 24
    rate: float = 10.0
    seed: int = 0
    max_active: int = 2
    max_queue: int = 2
    prompts: int = 12
    words: int = 0
    """A random pair's word vocabulary (:func:`support.words.word_tokenizer`) to draw prompts
    from; 0: the built-in pair's, pieces of :data:`CODE`."""
    max_seq_len: int = 1024

    @property
    def burst(self) -> int:
        """Requests of one round's burst: enough that some find the queue full."""
        return self.max_active + self.max_queue + 3


@dataclass(frozen=True)
class Planned:
    """One client: when it arrives (seconds into its round), what it does, with what."""

    at: float
    kind: str
    prompt: int
    max_tokens: int
    cut: int = 0  # chunks a ``disconnect`` reads before it closes
    bad: int = 0  # which of :func:`bad_requests` a ``bad`` sends


@dataclass
class SoakFigures:
    """What a soak did and found (every count from the clients' side)."""

    rounds: int = 0
    requests: int = 0
    served: int = 0
    streamed: int = 0
    disconnects: int = 0
    left_early: int = 0
    rejected: int = 0
    bad_requests: int = 0
    clear_errors: int = 0
    faults_armed: int = 0
    faults_fired: int = 0
    fault_errors: int = 0
    wrong_answers: int = 0
    pages_leaked: int = 0
    checks: int = 0
    fault_sites: Counter[str] = field(default_factory=Counter)
    rss_mib: list[float] = field(default_factory=list)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def rss_growth_mib(self) -> float:
        """Resident memory growth from the first checkpoint (after the first round, which
        warms up) to the last."""
        return self.rss_mib[-1] - self.rss_mib[0] if len(self.rss_mib) > 1 else 0.0

    def line(self) -> str:
        rss = (f"RSS {self.rss_mib[0]:.0f} -> {self.rss_mib[-1]:.0f} MiB "
               f"({self.rss_growth_mib:+.1f} MiB)" if self.rss_mib else "RSS not measured")
        return (
            f"serve soak: {self.rounds} rounds, {self.requests:,} requests in {self.seconds:.0f} s: "
            f"{self.served:,} served = solo ({self.streamed:,} streamed), "
            f"{self.disconnects:,} mid-stream disconnects, {self.left_early:,} left before the first byte, "
            f"{self.rejected:,} 429, {self.bad_requests:,} bad requests -> {self.clear_errors:,} clear errors, "
            f"{self.faults_fired}/{self.faults_armed} injected faults fired -> {self.fault_errors:,} "
            f"fault errors, {len(self.problems)} other problems, {self.wrong_answers} wrong answers, "
            f"{self.pages_leaked} pages leaked, {self.checks:,} checks, {rss}"
        )


def bad_requests(max_seq_len: int) -> list[tuple[str, bytes, int, str | None, str]]:
    """The ``bad`` clients' requests: (endpoint, body, status, param, code)."""
    def body(**fields: Any) -> bytes:
        return json.dumps({"model": MODEL, "prompt": "def f(", "max_tokens": 4, **fields}).encode()

    return [
        ("completions", b'{"prompt": "def f(",', 400, None, "invalid_json"),
        ("completions", body(temperature=-1), 400, "temperature", "invalid_value"),
        ("completions", body(max_tokens=0), 400, "max_tokens", "invalid_value"),
        ("completions", body(max_tokens="8"), 400, "max_tokens", "invalid_type"),
        ("completions", body(model="gpt-4"), 404, "model", "model_not_found"),
        ("completions", body(prompt=[5] * max_seq_len), 400, "prompt", "context_length_exceeded"),
        ("chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages",
         "invalid_value"),
        ("completions", body(prompt="x" * MAX_BODY_BYTES), 413, None, "request_too_large"),
    ]


def prompts(cfg: SoakConfig) -> list[str]:
    """``cfg.prompts`` distinct pieces of :data:`CODE`, from a line start, of random length;
    with ``cfg.words``, random words of that word vocabulary instead."""
    rng = random.Random(cfg.seed)
    if cfg.words:
        return [random_words(rng, cfg.words, rng.randint(4, 400)) for _ in range(cfg.prompts)]
    starts = [0] + [i + 1 for i, ch in enumerate(CODE) if ch == "\n" and CODE[i + 1:i + 2].strip()]
    out: list[str] = []
    while len(out) < cfg.prompts:
        start = rng.choice(starts)
        end = min(len(CODE), start + rng.randint(12, len(CODE)))
        piece = CODE[start:end]
        if piece.strip() and piece not in out:
            out.append(piece)
    return out


def plan_round(cfg: SoakConfig, index: int) -> tuple[list[Planned], int]:
    """Round ``index``'s clients in arrival order, and after which of them its fault is armed."""
    rng = random.Random(cfg.seed * 1_000_003 + index)
    kinds, weights = zip(*KINDS)
    bad_count = len(bad_requests(1))

    def client(at: float, kind: str) -> Planned:
        return Planned(at, kind, rng.randrange(cfg.prompts), rng.randint(*MAX_TOKENS),
                       cut=rng.randint(1, 3), bad=rng.randrange(bad_count))

    plan: list[Planned] = []
    t = 0.0
    for _ in range(cfg.per_round):
        t += rng.expovariate(cfg.rate)
        plan.append(client(t, rng.choices(kinds, weights)[0]))
    burst_at = rng.uniform(0.0, t)
    plan += [client(burst_at, rng.choice(("plain", "stream", "chat_stream", "leave")))
             for _ in range(cfg.burst)]
    plan.sort(key=lambda p: p.at)
    return plan, rng.randrange(len(plan) // 2)


class References:
    """The solo greedy answers of the soak's prompts (one ``blockdraft.generate`` per distinct
    prompt, :data:`MAX_TOKENS` long; a shorter request's answer is its first tokens)."""

    def __init__(self, pair: Pair, texts: list[str]) -> None:
        self.tokenizer = pair.tokenizer
        chat = ChatFormat(pair.tokenizer, builtin=True)
        solo: dict[tuple[int, ...], list[int]] = {}
        self.ids: dict[tuple[bool, int], tuple[int, ...]] = {}
        for i, text in enumerate(texts):
            for is_chat in (False, True):
                ids = tuple(chat.render([{"role": "user", "content": text}]) if is_chat
                            else pair.tokenizer.encode(text))
                if ids not in solo:
                    solo[ids] = pair.solo_ids(list(ids), MAX_TOKENS[1])
                self.ids[is_chat, i] = ids
        self.solo = solo

    def text(self, is_chat: bool, prompt: int, max_tokens: int) -> str:
        out = self.solo[self.ids[is_chat, prompt]][:max_tokens]
        return str(self.tokenizer.decode(out, skip_special_tokens=True))


@dataclass
class _Seen:
    """What one client got: a status, the text, whether the answer ran to its end, an error."""

    status: int
    text: str = ""
    finished: bool = False
    error: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    left: bool = False


class Soak:
    """The soak against one running server (see the module's docstring)."""

    def __init__(self, server: LiveServer, refs: References, texts: list[str], cfg: SoakConfig) -> None:
        self.server = server
        self.refs = refs
        self.texts = texts
        self.cfg = cfg
        self.bad = bad_requests(server.engine.max_seq_len)
        self.figures = SoakFigures()

    def run(self) -> SoakFigures:
        fig = self.figures
        start = time.monotonic()
        sites = list(FAULT_STATUS)
        index = 0
        while index < self.cfg.rounds or (self.cfg.duration_s is not None
                                           and time.monotonic() - start < self.cfg.duration_s):
            plan, arm_after = plan_round(self.cfg, index)
            before = self.server.metrics()
            seen = asyncio.run(self._round(plan, arm_after, sites[index % len(sites)]))
            self._checkpoint(plan, seen, before)
            index += 1
            fig.rounds = index
        fig.seconds = time.monotonic() - start
        return fig

    async def _round(self, plan: list[Planned], arm_after: int, site: str) -> list[_Seen]:
        fig = self.figures
        loop = asyncio.get_running_loop()
        begin = loop.time()
        tasks = []
        with ExitStack() as armed:
            fault = None
            async with httpx.AsyncClient(base_url=self.server.url, timeout=120,
                                         limits=httpx.Limits(max_connections=128)) as client:
                for i, p in enumerate(plan):
                    await asyncio.sleep(max(0.0, begin + p.at - loop.time()))
                    tasks.append(asyncio.ensure_future(self._client(client, p)))
                    if i == arm_after:
                        fault = armed.enter_context(faults.inject(site, 1))
                        fig.faults_armed += 1
                seen = list(await asyncio.gather(*tasks))
            if fault is not None and fault.fired:
                fig.faults_fired += 1
                score.fault_points += 1
        for p, s in zip(plan, seen):
            self._judge(p, s)
        return seen

    async def _client(self, client: httpx.AsyncClient, p: Planned) -> _Seen:
        if p.kind == "bad":
            endpoint, content, *_ = self.bad[p.bad]
            r = await client.post(f"/v1/{endpoint}", content=content,
                                  headers={"Content-Type": "application/json"})
            return _Seen(r.status_code, error=_error_of(r))
        is_chat = p.kind.startswith("chat")
        body: dict[str, Any] = {"model": MODEL, "max_tokens": p.max_tokens, "temperature": 0}
        text = self.texts[p.prompt]
        if is_chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        endpoint = "/v1/chat/completions" if is_chat else "/v1/completions"
        if p.kind == "leave":
            try:
                r = await client.post(endpoint, json=body, timeout=httpx.Timeout(120, read=LEAVE_S))
            except httpx.ReadTimeout:
                return _Seen(0, left=True)
            return _plain(r, is_chat)
        if p.kind in ("plain", "chat"):
            return _plain(await client.post(endpoint, json=body), is_chat)
        return await _stream(client, endpoint, {**body, "stream": True}, is_chat,
                             p.cut if p.kind == "disconnect" else None)

    def _judge(self, p: Planned, s: _Seen) -> None:
        """Count what ``p`` saw; a rule broken is a problem (a wrong answer one of its own)."""
        fig = self.figures
        fig.requests += 1
        fig.checks += 1
        if p.kind == "bad":
            _, _, status, param, code = self.bad[p.bad]
            fig.bad_requests += 1
            score.bad_inputs += 1
            err = s.error or {}
            if (s.status, err.get("param"), err.get("code")) == (status, param, code) and _shaped(err):
                fig.clear_errors += 1
                score.clear_errors += 1
            else:
                fig.problems.append(f"{p}: expected {status} {code}, got {s.status} {s.error}")
            return
        if s.left:
            fig.left_early += 1
            score.disconnects += 1
            return
        if s.status == 429:
            err = s.error or {}
            if (err.get("type"), err.get("code")) == ("rate_limit_error", "queue_full") and \
                    _shaped(err) and int(s.headers.get("retry-after", "0")) >= 1:
                fig.rejected += 1
            else:
                fig.problems.append(f"{p}: a 429 without its shape: {s.error} {s.headers}")
            return
        if s.error is not None:
            self._judge_failure(p, s)
            return
        if s.status != 200:
            fig.problems.append(f"{p}: status {s.status} without an error body")
            return
        want = self.refs.text(p.kind.startswith("chat"), p.prompt, p.max_tokens)
        if s.finished:
            right = s.text == want
            fig.served += 1
            fig.streamed += p.kind in ("stream", "chat_stream", "disconnect")
            score.requests_served += 1
        else:  # a client that left mid-stream: what it read is the solo answer's start
            right = want.startswith(s.text)
            fig.disconnects += 1
            score.disconnects += 1
        if not right:
            fig.wrong_answers += 1
            score.wrong_answers += 1
            fig.problems.append(f"{p}: answered {s.text!r}, solo {want!r}")

    def _judge_failure(self, p: Planned, s: _Seen) -> None:
        """A 5xx (or a stream's error event) must be an injected fault's, with its status."""
        err = s.error or {}
        message = str(err.get("message", ""))
        site = next((x for x in FAULT_STATUS if f"fault injection: {x} #" in message), None)
        if site is None:
            self.figures.problems.append(f"{p}: an error not injected: {s.status} {err}")
            return
        status, code = FAULT_STATUS[site]
        # What a stream read before its error event is still the solo answer's start.
        before = self.refs.text(p.kind.startswith("chat"), p.prompt, p.max_tokens).startswith(s.text)
        if err.get("type") == "server_error" and err.get("code") == code and s.status in (200, status) \
                and _shaped(err) and before:
            self.figures.fault_errors += 1
            self.figures.fault_sites[site] += 1
        else:
            self.figures.problems.append(f"{p}: fault {site} answered {s.status} {err}, not {status} {code}")

    def _checkpoint(self, plan: list[Planned], seen: list[_Seen], before: Any) -> None:
        """Idle pools, the loop alive, every request counted once, resident memory noted."""
        fig, srv = self.figures, self.server
        try:
            srv.wait_idle()
        except AssertionError:
            used = srv.pages_used()
            leaked = int(sum(used.values()))
            fig.pages_leaked += leaked
            score.leaked_pages += leaked
            fig.problems.append(f"after round {fig.rounds}: not idle, pages used {used}")
        health = httpx.get(f"{srv.url}/health", timeout=10)
        if health.status_code != 200 or health.json() != {"status": "ok"} or not srv.loop.alive:
            fig.problems.append(f"after round {fig.rounds}: /health {health.status_code} {health.text}")
        # Every request that reached the app is counted once (a 413 is answered before it).
        reached = sum(1 for p in plan if not (p.kind == "bad" and self.bad[p.bad][2] == 413))
        invalid = sum(1 for p in plan if p.kind == "bad" and self.bad[p.bad][2] in (400, 404))

        def delta(status: str) -> float:
            return requests_total(srv.metrics(), status) - requests_total(before, status)

        def counted() -> bool:
            m = srv.metrics()
            return sum(requests_total(m, s) - requests_total(before, s) for s in STATUSES) >= reached

        try:
            wait_until(counted, "every request counted")
        except AssertionError as exc:
            fig.problems.append(f"after round {fig.rounds}: {exc}")
        after = srv.metrics()
        total = sum(requests_total(after, s) - requests_total(before, s) for s in STATUSES)
        rejected = sum(1 for s in seen if s.status == 429)
        left = sum(1 for s in seen if s.left)
        if total != reached or delta("invalid") != invalid or not rejected <= delta("rejected") <= rejected + left:
            fig.problems.append(f"after round {fig.rounds}: counted {total} (want {reached}), invalid "
                                f"{delta('invalid')} (want {invalid}), rejected {delta('rejected')} "
                                f"(clients saw {rejected}, {left} left early)")
        # ... and each 413 once as refused.
        too_large = len(plan) - reached
        refused = refused_total(after, "too_large") - refused_total(before, "too_large")
        if refused != too_large:
            fig.problems.append(f"after round {fig.rounds}: refused as too large {refused} (want {too_large})")
        fig.checks += 5
        score.invariant_checks += 5
        rss = rss_mib()
        if rss is not None:
            fig.rss_mib.append(rss)


def _error_of(r: httpx.Response) -> dict[str, Any] | None:
    try:
        body = r.json()
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else None


def _shaped(err: dict[str, Any]) -> bool:
    """OpenAI's error shape: exactly message (not empty), type, param, code."""
    return set(err) == {"message", "type", "param", "code"} and bool(err["message"])


def _plain(r: httpx.Response, is_chat: bool) -> _Seen:
    if r.status_code != 200:
        return _Seen(r.status_code, error=_error_of(r), headers=dict(r.headers))
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if is_chat else choice["text"]
    return _Seen(200, text or "", finished=choice["finish_reason"] in ("stop", "length"))


async def _stream(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], is_chat: bool,
                  cut: int | None) -> _Seen:
    """A streamed answer; with ``cut`` the client closes after that many text chunks."""
    async with client.stream("POST", endpoint, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return _Seen(r.status_code, error=_error_of(r), headers=dict(r.headers))
        seen = _Seen(200)
        pieces: list[str] = []
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                seen.error = event["error"]
                break
            for choice in event.get("choices", []):
                piece = choice["delta"].get("content") if is_chat else choice["text"]
                if piece:
                    pieces.append(piece)
                    chunks += 1
                if choice.get("finish_reason") in ("stop", "length"):
                    seen.finished = True
            if cut is not None and chunks >= cut and not seen.finished:
                break
        seen.text = "".join(pieces)
        return seen


def rss_mib() -> float | None:
    """This process's resident memory in MiB after a garbage collection (``None`` where
    ``/proc`` is not there)."""
    gc.collect()
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_soak(pair: Pair, cfg: SoakConfig) -> SoakFigures:
    """The soak of ``cfg`` against a fresh in-process server on ``pair`` (which, on the way
    out, must close with every page back)."""
    texts = prompts(cfg)
    refs = References(pair, texts)
    # On a GPU the server warms up before its first request, as `blockdraft serve` does: without
    # it the first rounds compile kernels and capture graphs for each new batch size while the
    # soak measures resident memory.
    on_gpu = next(pair.target.parameters()).device.type == "cuda"
    with live_server(pair, max_seq_len=cfg.max_seq_len, max_active=cfg.max_active, max_queue=cfg.max_queue,
                     max_body_bytes=MAX_BODY_BYTES, warmup=on_gpu) as server:
        return Soak(server, refs, texts, cfg).run()
