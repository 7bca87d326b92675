"""The server's Prometheus metrics, in a registry of their own (one per app, so several servers
can live in one process, as tests start them).

| metric | kind | meaning |
| --- | --- | --- |
| ``blockdraft_requests_total{status}`` | counter | answered requests by outcome (see :data:`STATUSES`) |
| ``blockdraft_refused_requests_total{reason}`` | counter | requests refused before any route (see :data:`REFUSALS`) |
| ``blockdraft_requests_running`` / ``_waiting`` | gauge | requests in the batch / queued for pages |
| ``blockdraft_pool_pages_used{pool}`` / ``_total{pool}`` | gauge | pages of the ``target`` and ``drafter`` pools |
| ``blockdraft_kv_cache_usage_ratio{pool}`` | gauge | used / total pages of each pool, in [0, 1] (for routers) |
| ``blockdraft_generated_tokens_total`` | counter | tokens the engine generated |
| ``blockdraft_spec_steps_total`` | counter | speculative steps, summed over requests |
| ``blockdraft_spec_accepted_tokens_total`` | counter | accepted drafts (each step's tokens minus its bonus token) |
| ``blockdraft_time_to_first_token_seconds`` | histogram | arrival of a request to its first token |
| ``blockdraft_time_per_output_token_seconds`` | histogram | per request: (end - first token) / (tokens - 1) |
| ``blockdraft_tp_size`` | gauge | tensor-parallel ranks the target is split over (1: none) |
| ``blockdraft_warmup_seconds`` | gauge | how long the start-up warm-up took (0: none ran) |
| ``blockdraft_compiles_after_warmup_total`` | counter | Triton kernels compiled after warm-up (each delays requests) |
| ``blockdraft_graph_captures_after_warmup_total`` | counter | CUDA graphs captured after warm-up (same) |
| ``blockdraft_speculation`` | gauge | 1: speculative decoding; 0: target-only (``--no-speculation``) |

With tensor parallelism rank 0 serves the metrics, and they describe rank 0's engine (the
other ranks hold the same pools and requests).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STATUSES = ("stop", "length", "cancelled", "error", "invalid", "rejected", "unavailable")
"""``stop``/``length``: finished as OpenAI reports it; ``cancelled``: the client went away or
the server shut down first; ``error``: generation failed (500); ``invalid``: refused input
(400/404); ``rejected``: the queue was full (429); ``unavailable``: shutting down (503)."""

REFUSALS = ("unauthorized", "too_large")
"""Why a request was refused before any route saw it: ``unauthorized``: no or a wrong API key
(401); ``too_large``: its body was past the size limit (413)."""

POOLS = ("target", "drafter")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServeMetrics:
    """Every metric of one server (thread-safe: the engine loop and the handlers update them)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("blockdraft_requests", "Answered requests by outcome.",
                                ["status"], registry=reg)
        for status in STATUSES:
            self.requests.labels(status)
        self.refused = Counter("blockdraft_refused_requests",
                               "Requests refused before any route ran, by reason.", ["reason"],
                               registry=reg)
        for reason in REFUSALS:
            self.refused.labels(reason)
        self.running = Gauge("blockdraft_requests_running", "Requests in the running batch.",
                             registry=reg)
        self.waiting = Gauge("blockdraft_requests_waiting", "Requests waiting for pages or a slot.",
                             registry=reg)
        self.pages_used = Gauge("blockdraft_pool_pages_used", "Pages in use, per pool.", ["pool"],
                                registry=reg)
        self.pages_total = Gauge("blockdraft_pool_pages_total", "Pages of each pool.", ["pool"],
                                 registry=reg)
        self.kv_usage = Gauge("blockdraft_kv_cache_usage_ratio",
                              "Fraction of each pool's pages in use (0 to 1).", ["pool"], registry=reg)
        self.generated = Counter("blockdraft_generated_tokens", "Tokens generated.", registry=reg)
        self.spec_steps = Counter("blockdraft_spec_steps", "Speculative steps, over all requests.",
                                  registry=reg)
        self.accepted = Counter("blockdraft_spec_accepted_tokens",
                                "Accepted draft tokens (bonus tokens excluded).", registry=reg)
        self.ttft = Histogram("blockdraft_time_to_first_token_seconds",
                              "Time from a request's arrival to its first token.",
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("blockdraft_time_per_output_token_seconds",
                              "Per request, time per output token after the first.",
                              buckets=_TPOT_BUCKETS, registry=reg)
        self.tp_size = Gauge("blockdraft_tp_size",
                             "Tensor-parallel ranks the target is split over (1: none).",
                             registry=reg)
        self.tp_size.set(1)
        self.warmup_seconds = Gauge("blockdraft_warmup_seconds",
                                    "Seconds the start-up warm-up took (0: none ran).",
                                    registry=reg)
        self.compiles_after_warmup = Counter(
            "blockdraft_compiles_after_warmup",
            "Triton kernels compiled after warm-up (a request waited for each).", registry=reg)
        self.captures_after_warmup = Counter(
            "blockdraft_graph_captures_after_warmup",
            "CUDA graphs captured after warm-up (a request waited for each).", registry=reg)
        self._after_warmup = (0, 0)
        self.speculation = Gauge("blockdraft_speculation",
                                 "1: speculative decoding; 0: target-only decoding.", registry=reg)
        self.speculation.set(1)

    def count(self, status: str) -> None:
        self.requests.labels(status).inc()

    def refuse(self, reason: str) -> None:
        """Count a request refused before any route ran (``reason`` one of :data:`REFUSALS`)."""
        self.refused.labels(reason).inc()

    def set_pools(self, used: dict[str, int], total: dict[str, int]) -> None:
        for pool in POOLS:
            self.pages_used.labels(pool).set(used.get(pool, 0))
            self.pages_total.labels(pool).set(total.get(pool, 0))
            pages = total.get(pool, 0)
            self.kv_usage.labels(pool).set(used.get(pool, 0) / pages if pages else 0.0)

    def set_after_warmup(self, compiles: int, captures: int) -> None:
        """Bring the after-warm-up counters up to the engine's totals."""
        c0, g0 = self._after_warmup
        if compiles > c0:
            self.compiles_after_warmup.inc(compiles - c0)
        if captures > g0:
            self.captures_after_warmup.inc(captures - g0)
        self._after_warmup = (max(c0, compiles), max(g0, captures))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


__all__ = ["POOLS", "REFUSALS", "STATUSES", "ServeMetrics"]
