"""The OpenAI request fields beyond the basics, through the official ``openai`` client and
plain HTTP on a live server (the built-in pair, CPU, fp32): log-probabilities in chat's and
completions' shapes (equal to a plain forward of the target), ``n`` choices (each equal to a
one-choice request with its derived seed), several prompts per request, penalties,
``stop_token_ids``, ``ignore_eos``, ``min_tokens``, and the 400 of every limit."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

import blockdraft
from blockdraft.sampling import SamplingParams

from support.serve_support import MODEL, LiveServer, Pair, live_server, sse_chunks

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "def fibonacci(n):"
SERVER_KW = {"max_active": 8}
OTHER = "import numpy as np\n\n\ndef"
EOF_PROMPT = 'if __name__ == "__main__":\n    main()\n'  # the pair ends the file here (EOS)


def post(server: LiveServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, **body}, timeout=120)


def reference_logprobs(pair: Pair, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The target's log-softmax at each generated token's position: ``[len(out), V]``."""
    with torch.no_grad():
        logits = pair.target(torch.tensor([prompt + out])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(out)], dim=-1)


def test_chat_logprobs_are_the_targets(server: LiveServer, pair: Pair) -> None:
    tok = pair.tokenizer
    ids = tok.encode(PROMPT)
    out = pair.solo_ids(ids, 12)
    client = server.openai()
    messages = [{"role": "user", "content": PROMPT}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in out]
    assert b"".join(bytes(c.bytes) for c in content).decode() == got.choices[0].message.content
    want = reference_logprobs(pair, ids, out)
    for row, t, c in zip(want, out, content):
        assert c.logprob == pytest.approx(float(row[t]), abs=1e-3)
        top = torch.topk(row, 3)
        assert [a.token for a in c.top_logprobs] == [tok.decode([i]) for i in top.indices.tolist()]
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-3)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the likeliest

    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                   temperature=0, logprobs=True, top_logprobs=3,
                                                   stream=True))
    entries = [e for ch in streamed if ch.choices and ch.choices[0].logprobs
               for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in entries] == [(c.token, c.bytes) for c in content]
    assert [e.logprob for e in entries] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(server: LiveServer, pair: Pair) -> None:
    tok = pair.tokenizer
    ids = tok.encode(PROMPT)
    out = pair.solo_ids(ids, 10)
    client = server.openai()
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    text = got.choices[0].text
    assert lp.tokens == [tok.decode([t]) for t in out] and "".join(lp.tokens) == text
    assert lp.text_offset == [len(tok.decode(out[:k])) for k in range(len(out))]
    want = reference_logprobs(pair, ids, out)
    assert lp.token_logprobs == pytest.approx([float(want[k, t]) for k, t in enumerate(out)], abs=1e-3)
    for k, top in enumerate(lp.top_logprobs):
        best = torch.topk(want[k], 2)
        assert set(top) == {tok.decode([i]) for i in best.indices.tolist()}  # greedy: the chosen is one
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                              logprobs=2, stream=True))
    joined = [t for ch in streamed if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in streamed if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert joined == lp.tokens and offsets == lp.text_offset
    zero = post(server, "completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                        "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert zero["top_logprobs"] == [{t: v} for t, v in zip(zero["tokens"], zero["token_logprobs"])]


def test_n_choices_equal_their_solo_runs_under_derived_seeds(server: LiveServer) -> None:
    client = server.openai()
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.9}
    got = client.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in got.choices] == [0, 1, 2]
    solo = [client.completions.create(seed=40 + j, **kw) for j in range(3)]
    assert [c.text for c in got.choices] == [s.choices[0].text for s in solo]
    assert len({c.text for c in got.choices}) > 1  # the premise: the seeds differ
    assert got.usage.completion_tokens == sum(s.usage.completion_tokens for s in solo)
    assert got.usage.prompt_tokens == solo[0].usage.prompt_tokens  # the prompt counts once

    streamed = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0.9,
        n=2, seed=40, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in got.choices[:2]]
    assert sorted(finish) == [0, 1] and streamed[-1].usage.completion_tokens == sum(
        s.usage.completion_tokens for s in solo[:2])


def test_several_prompts_one_choice_each_times_n(server: LiveServer, pair: Pair) -> None:
    tok = pair.tokenizer
    client = server.openai()
    got = client.completions.create(model=MODEL, prompt=[PROMPT, OTHER], n=2, max_tokens=10, temperature=0)
    want = [pair.solo_text(PROMPT, 10), pair.solo_text(OTHER, 10)]
    assert [(c.index, c.text) for c in got.choices] == [(0, want[0]), (1, want[0]), (2, want[1]), (3, want[1])]
    assert got.usage.prompt_tokens == len(tok.encode(PROMPT)) + len(tok.encode(OTHER))
    ids = [tok.encode(OTHER), tok.encode(PROMPT)]
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert [c.text for c in as_ids.choices] == want[::-1]
    chunks = list(client.completions.create(model=MODEL, prompt=[PROMPT, OTHER], max_tokens=10,
                                            temperature=0, stream=True))
    texts = ["", ""]
    for ch in chunks:
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == want


def test_penalties_are_applied_as_in_generate(server: LiveServer, pair: Pair) -> None:
    ids = pair.tokenizer.encode(PROMPT)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3)
    want = blockdraft.generate(pair.target, pair.drafter, [ids], max_new_tokens=24, sampling=params,
                               stop_token_ids=[pair.eos]).tokens[0]
    assert want != pair.solo_ids(ids, 24)  # the premise: the penalties change the text
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "presence_penalty": 1.0,
            "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    got = post(server, "completions", body).json()
    assert got["choices"][0]["text"] == pair.tokenizer.decode(want, skip_special_tokens=True)


def test_stop_token_ids_ignore_eos_and_min_tokens(server: LiveServer, pair: Pair) -> None:
    tok = pair.tokenizer
    ids = tok.encode(EOF_PROMPT)
    free = pair.solo_ids(ids, 32)
    assert free[-1] == pair.eos and len(free) < 12  # the premise: it ends the file early
    base = {"prompt": EOF_PROMPT, "max_tokens": 24, "temperature": 0}

    ignored = post(server, "completions", {**base, "ignore_eos": True}).json()
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 24

    longer = post(server, "completions", {**base, "min_tokens": len(free) + 3}).json()
    assert longer["usage"]["completion_tokens"] >= len(free) + 3
    assert longer["choices"][0]["text"].startswith(tok.decode(free, skip_special_tokens=True))

    code = pair.solo_ids(tok.encode(PROMPT), 12)
    stop = code[3]
    first = code.index(stop)
    got = post(server, "chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                            "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop]}).json()
    assert got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == first + 1
    assert got["choices"][0]["message"]["content"] == tok.decode(code[: first + 1])  # its text included
    held = post(server, "completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                       "stop_token_ids": [stop], "min_tokens": first + 1}).json()
    assert held["usage"]["completion_tokens"] > first + 1


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": PROMPT, "n": 17}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "n": 0}, "n"),
    ("completions", {"prompt": [PROMPT] * 65}, "prompt"),
    ("completions", {"prompt": [PROMPT] * 33, "n": 2}, "n"),
    ("completions", {"prompt": PROMPT, "stop": ["a"] * 17}, "stop"),
    ("completions", {"prompt": PROMPT, "stop": "a" * 257}, "stop"),
    ("completions", {"prompt": PROMPT, "logprobs": 6}, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True,
                          "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"prompt": PROMPT, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("completions", {"prompt": PROMPT, "min_tokens": 17}, "min_tokens"),  # past the default 16
    ("completions", {"prompt": PROMPT, "best_of": 2}, "best_of"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"5": 1}}, "logit_bias"),
    ("completions", {"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": [PROMPT, ""]}, "prompt"),
])
def test_limits_and_refusals_are_400s_naming_the_field(server: LiveServer, route: str, body: dict[str, Any],
                                                       param: str) -> None:
    r = post(server, route, {"max_tokens": None, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert server.engine.num_waiting == server.engine.num_running == 0


def test_speculation_off_answers_the_same_fields(pair: Pair) -> None:
    """The target-only server honours the same fields with the same results."""
    body = {"prompt": [PROMPT, OTHER], "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "presence_penalty": 0.8, "stop_token_ids": [pair.eos]}
    answers = []
    for speculate in (True, False):
        with live_server(pair, max_active=4, speculate=speculate) as srv:
            r = post(srv, "completions", body).json()
            answers.append([(c["text"], c["logprobs"]["tokens"]) for c in r["choices"]])
            with httpx.stream("POST", f"{srv.url}/v1/completions",
                              json={"model": MODEL, **body, "stream": True}, timeout=120) as s:
                chunks = list(sse_chunks(s))
            texts = ["", ""]
            for ch in chunks:
                if ch["choices"]:
                    texts[ch["choices"][0]["index"]] += ch["choices"][0]["text"]
            assert texts == [t for t, _ in answers[-1]]
    assert answers[0] == answers[1]
