"""``blockdraft serve``: an OpenAI-compatible HTTP server on the continuous-batching engine.

Needs the ``serve`` extra (``pip install blockdraft[serve]``: fastapi, uvicorn,
prometheus-client, llguidance). User guide: ``docs/serve.md``.

| module | concept |
| --- | --- |
| ``app`` | :func:`create_app`: the routes, the lifespan that owns the engine loop |
| ``generation`` | one request from its body to a JSON answer or a stream |
| ``choices`` | one choice of an answer: its engine request's text, logprobs and end |
| ``logprobs`` | log-probabilities in OpenAI's chat and completions shapes |
| ``protocol`` | request bodies: fields, types, ranges |
| ``structured`` | ``response_format`` and ``structured_outputs`` to a grammar spec |
| ``chat`` | chat messages to prompt tokens (templates) |
| ``text`` | tokens to text, released piece by piece, stop strings |
| ``loop`` | the engine thread and the queues that cross to asyncio |
| ``tp`` | tensor parallelism: rank 0's engine calls broadcast, :func:`follow` on the other ranks |
| ``responses`` / ``sse`` | OpenAI's JSON shapes; server-sent events |
| ``metrics`` | the Prometheus metrics |
| ``access`` | the API key and the body-size limit, before any route |
| ``errors`` | OpenAI-style errors |
| ``server`` | building the engine; uvicorn and graceful shutdown |
| ``ray_app`` / ``ray_tp`` | replicas on Ray Serve (``--replicas``; the ``ray`` extra), a TP group inside a replica |
"""

from __future__ import annotations

from blockdraft.serve.app import ServeConfig, create_app
from blockdraft.serve.errors import APIError
from blockdraft.serve.loop import EngineLoop, FinalState
from blockdraft.serve.metrics import ServeMetrics
from blockdraft.serve.server import build_engine, serve
from blockdraft.serve.tp import follow

__all__ = ["APIError", "EngineLoop", "FinalState", "ServeConfig", "ServeMetrics", "build_engine",
           "create_app", "follow", "serve"]
