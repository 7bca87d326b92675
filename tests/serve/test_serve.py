"""``blockdraft serve`` through the official ``openai`` client: completions and chat, streamed
and not, equal to ``blockdraft.generate``'s greedy output; stop strings; usage and meta_info;
/v1/models, /health, /metrics; 16 concurrent streaming clients. Loopback only, the built-in
pair on the CPU in fp32; after every test every page is back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from support.serve_support import (
    MODEL,
    LiveServer,
    Pair,
    counter,
    requests_total,
    wait_until,
)

PROMPT = "def fibonacci(n):"


def test_completion_equals_generate(server: LiveServer, pair: Pair) -> None:
    want = pair.solo_text(PROMPT, 24)
    client = server.openai()
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"return_meta_info": True})
    choice = got.choices[0]
    assert choice.text == want and choice.finish_reason == "length"
    assert got.model == MODEL and got.object == "text_completion"
    n_prompt = len(pair.tokenizer.encode(PROMPT))
    usage = got.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n_prompt, 24, n_prompt + 24)
    meta = got.model_extra["meta_info"]
    # The first token comes from the prefill; every later one from a verify step.
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] * meta["spec_verify_ct"] == pytest.approx(23)
    assert 1.0 <= meta["spec_accept_length"] <= 8.0

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_generate(server: LiveServer, pair: Pair) -> None:
    """The built-in model's chat continues the last user message as code."""
    want = pair.solo_text(PROMPT, 20)
    client = server.openai()
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "ignored: not the last user message"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": PROMPT}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 20

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == got.usage.prompt_tokens
    # Content as a list of text parts is the same message.
    parts = [{"role": "user", "content": [{"type": "text", "text": PROMPT[:5]}, {"type": "text", "text": PROMPT[5:]}]}]
    again = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=20, temperature=0)
    assert again.choices[0].message.content == want


def test_prompt_forms_token_ids_and_one_string(server: LiveServer, pair: Pair) -> None:
    ids = pair.tokenizer.encode(PROMPT)
    want = pair.solo_text(ids, 12)
    client = server.openai()
    for prompt in (ids, [PROMPT], [ids]):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want, prompt
    # No model named: the served one.
    body = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 12,
                                                             "temperature": 0}, timeout=60).json()
    assert body["choices"][0]["text"] == want and body["model"] == MODEL


def test_stop_strings_cut_the_text(server: LiveServer, pair: Pair) -> None:
    full = pair.solo_text(PROMPT, 40)
    # A stop string that first appears well inside the text, and one that never appears.
    stop = next(full[i:i + 4] for i in range(6, len(full) - 4) if full[i:i + 4].strip()
                and full.find(full[i:i + 4]) == i)
    want = full[: full.find(stop)]
    client = server.openai()
    for stops in (stop, [stop, "\x00never"]):
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stops)
        assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
        assert 0 < got.usage.completion_tokens <= 40
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                                temperature=0, stop=stops, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=40, temperature=0, stop=[stop])
    assert chat.choices[0].message.content == want and chat.choices[0].finish_reason == "stop"


def test_eos_finishes_with_stop(server: LiveServer, pair: Pair) -> None:
    """The end of a file: the model's end token, finish_reason stop, counted but not in the text."""
    prompt = 'if __name__ == "__main__":\n    main()\n'
    ids = pair.solo_ids(pair.tokenizer.encode(prompt), 32)
    assert ids[-1] == pair.eos  # the premise: this pair ends the file here
    client = server.openai()
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == pair.tokenizer.decode(ids, skip_special_tokens=True)
    assert got.usage.completion_tokens == len(ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                            stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_health_and_metrics(server: LiveServer, pair: Pair) -> None:
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    before = server.metrics()
    got = server.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                             extra_body={"return_meta_info": True})
    server.wait_idle()
    after = server.metrics()
    meta = got.model_extra["meta_info"]
    assert requests_total(after, "length") - requests_total(before, "length") == 1
    assert (counter(after, "blockdraft_generated_tokens_total")
            - counter(before, "blockdraft_generated_tokens_total")) == 16
    steps = counter(after, "blockdraft_spec_steps_total") - counter(before, "blockdraft_spec_steps_total")
    accepted = (counter(after, "blockdraft_spec_accepted_tokens_total")
                - counter(before, "blockdraft_spec_accepted_tokens_total"))
    assert steps == meta["spec_verify_ct"] and accepted == 15 - steps  # 15 tokens from steps
    for hist in ("blockdraft_time_to_first_token_seconds", "blockdraft_time_per_output_token_seconds"):
        assert counter(after, f"{hist}_count") - counter(before, f"{hist}_count") == 1
    total = server.engine.pages_total()
    for pool in ("target", "drafter"):
        assert after[("blockdraft_pool_pages_total", (("pool", pool),))] == total[pool] > 0
        assert after[("blockdraft_pool_pages_used", (("pool", pool),))] == 0
    assert server.engine.request_ids() == []  # answered requests are forgotten


def test_kv_cache_usage_is_pages_used_over_total(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``blockdraft_kv_cache_usage_ratio{pool}``: a fraction in [0, 1] equal to the pool's pages
    used / total, while a request runs and once it has ended."""
    # Each engine step waits a little first, with the GIL released: the request below then
    # runs for seconds whatever the host's speed, and the metrics route answers meanwhile.
    engine = server.engine
    step = engine.step

    def slow_step() -> Any:
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)

    def ratios() -> dict[str, tuple[float, float, float]]:
        m = server.metrics()
        return {p: (m[("blockdraft_kv_cache_usage_ratio", (("pool", p),))],
                    m[("blockdraft_pool_pages_used", (("pool", p),))],
                    m[("blockdraft_pool_pages_total", (("pool", p),))]) for p in ("target", "drafter")}

    # A request far longer than the polling needs (ignore_eos: all its tokens), so that a slow
    # machine still reads the gauges while it runs; leaving the stream cancels the rest.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1800, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        next(r.iter_lines())
        seen: list[dict[str, tuple[float, float, float]]] = []

        def running_and_consistent() -> bool:
            # The engine loop sets the gauges after each step: poll past the one being set.
            seen.append(ratios())
            return all(0 < used <= total and ratio == pytest.approx(used / total)
                       for ratio, used, total in seen[-1].values())

        try:
            wait_until(running_and_consistent, "the gauges of a running request")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last read (ratio, used, total) by pool: {seen[-1:]}") from None
    assert all(0 < ratio <= 1 for ratio, _, _ in seen[-1].values())
    server.wait_idle()
    assert all(ratio == used == 0 for ratio, used, _ in ratios().values())


def _heldout() -> list[list[int]]:
    import blockdraft.pretrained

    return blockdraft.pretrained.heldout_prompts()


def test_sixteen_concurrent_streaming_clients(server: LiveServer, pair: Pair) -> None:
    """16 clients x 4 streaming requests each, all at once; each output equals its solo run."""
    tok = pair.tokenizer
    prompts: list[str | list[int]] = []
    for i, ids in enumerate(_heldout()):
        head = ids[: 8 + 3 * i]
        prompts.append(head if i % 2 else tok.decode(head))
    lengths = (8, 12, 16, 10)
    solo = {i: pair.solo_ids(tok.encode(p) if isinstance(p, str) else p, max(lengths))
            for i, p in enumerate(prompts)}

    def want(i: int, n: int) -> str:
        return str(tok.decode(solo[i][:n], skip_special_tokens=True))

    batched_before = server.engine.batched_proposals

    async def client(c: int, api: Any) -> list[tuple[int, int, str, str | None]]:
        out = []
        for r in range(4):
            i, n = (c + 5 * r) % len(prompts), lengths[(c + r) % len(lengths)]
            chat = (c + r) % 3 == 0 and isinstance(prompts[i], str)
            if chat:
                stream = await api.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": prompts[i]}], max_tokens=n,
                    temperature=0, stream=True)
                text, reason = "", None
                async for ch in stream:
                    text += ch.choices[0].delta.content or ""
                    reason = ch.choices[0].finish_reason or reason
            else:
                stream = await api.completions.create(model=MODEL, prompt=prompts[i], max_tokens=n,
                                                      temperature=0, stream=True)
                text, reason = "", None
                async for ch in stream:
                    text += ch.choices[0].text
                    reason = ch.choices[0].finish_reason or reason
            out.append((i, n, text, reason))
        return out

    async def main() -> list[list[tuple[int, int, str, str | None]]]:
        api = server.async_openai(http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=32),
                                                                timeout=120))
        try:
            return await asyncio.gather(*(client(c, api) for c in range(16)))
        finally:
            await api.close()

    results = [r for per_client in asyncio.run(main()) for r in per_client]
    assert len(results) == 64
    for i, n, text, reason in results:
        assert text == want(i, n), (i, n)
        assert reason == ("stop" if pair.eos in solo[i][:n] else "length")
    assert server.engine.batched_proposals > batched_before  # they really shared steps


def test_readme_serve_example_runs(server: LiveServer, pair: Pair, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's "Serve" Python example, pointed at this test's server."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Serve\n"):]
    code = re.search(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert code is not None and "http://127.0.0.1:8000/v1" in code.group(1)
    exec(compile(code.group(1).replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), {})
    assert capsys.readouterr().out == pair.solo_text(PROMPT, 64) + "\n"

