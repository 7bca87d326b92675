"""``benchmarks/bench_serve.py --poisson``: the traffic it plans, the report it makes of what it
measured, and a short run against a speculative and a speculation-off server (the built-in pair
on the CPU). Its figures are not checked (timings belong in benchmarks): its counts and their
consistency are."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

import blockdraft.pretrained

from support.serve_support import builtin_pair, live_server

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_poisson_plan_follows_rate_lengths_and_seed() -> None:
    stream = list(range(1000))
    starts = [0, 10, 400, 990]  # the last file is short: cuts from it run on into the first
    kw = dict(rate=4.0, duration_s=500.0, num_requests=None, prompt_range=(16, 64),
              output_range=(32, 40), seed=7)
    plan = bench.plan_traffic(stream, starts, **kw)
    assert plan == bench.plan_traffic(stream, starts, **kw)
    assert plan != bench.plan_traffic(stream, starts, **{**kw, "seed": 8})
    times = [p.at_s for p in plan]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 500.0
    # 2000 arrivals expected; exponential gaps of mean 1/rate (a loose bound on a fixed seed).
    assert 1800 <= len(plan) <= 2200
    assert statistics.fmean(b - a for a, b in zip(times, times[1:])) == pytest.approx(0.25, rel=0.1)
    for p in plan:
        assert 16 <= p.prompt_len <= 64 and len(p.prompt) == p.prompt_len and 32 <= p.max_tokens <= 40
        first = p.prompt[0]
        assert p.prompt == [(first + i) % 1000 for i in range(p.prompt_len)]  # one contiguous cut
    assert {p.prompt_len for p in plan} == set(range(16, 65))
    fixed = bench.plan_traffic(stream, starts, **{**kw, "num_requests": 5})
    assert fixed == plan[:5]


def test_word_prompts_are_text_of_that_many_words() -> None:
    stream, starts = bench.token_stream(["a b c d e", "f g\nh"], None)
    assert stream == list("abcdefgh") and starts == [0, 5]
    plan = bench.plan_traffic(stream, starts, rate=1.0, duration_s=1.0, num_requests=20,
                              prompt_range=(3, 6), output_range=(1, 2), seed=0)
    assert all(isinstance(p.prompt, str) and len(p.prompt.split()) == p.prompt_len for p in plan)


def _sample(ttft_ms: float, tpot_ms: float | None, tokens: int, error: str | None = None) -> object:
    return bench.Sample(ttft_s=ttft_ms / 1000, tokens=tokens, tpot_s=None if tpot_ms is None else tpot_ms / 1000,
                        gaps_s=[0.01, 0.03], error=error)


def test_goodput_counts_requests_meeting_both_slos() -> None:
    samples = [_sample(100, 10, 20), _sample(900, 10, 20), _sample(100, 60, 20), _sample(50, None, 1),
               _sample(0, None, 0, error="RuntimeError: HTTP 500")]
    s = bench.summarize(samples, 2.0, slo_ttft_ms=500, slo_tpot_ms=50)
    assert (s["requests_sent"], s["requests_completed"], s["requests_failed"]) == (5, 4, 1)
    assert s["requests_meeting_slo"] == 2  # the first and the one-token answer
    assert s["goodput_requests_per_s"] == pytest.approx(1.0) and s["requests_per_s"] == pytest.approx(2.0)
    assert s["tokens_per_s"] == pytest.approx(61 / 2.0)
    assert s["errors"] == ["RuntimeError: HTTP 500"]
    assert (s["ttft_ms_p50"], s["ttft_ms_p99"]) == (pytest.approx(100), pytest.approx(900))
    assert (s["itl_ms_p50"], s["itl_ms_p99"]) == (pytest.approx(10), pytest.approx(30))


def test_poisson_run_against_speculation_on_and_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pair = builtin_pair()
    out = tmp_path / "poisson.json"
    with live_server(pair, max_active=4) as on, live_server(pair, max_active=4, speculate=False) as off:
        rc = bench.main(["--poisson", on.url, off.url, "--rate", "40", "--num-requests", "5", "--seed", "3",
                         "--min-prompt", "16", "--max-prompt", "40", "--min-output", "4", "--max-output", "12",
                         "--warmup", "2", "--tokenizer", str(blockdraft.pretrained.TARGET_DIR),
                         "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9", "--json", str(out)])
        # The closed-loop mode is still the default.
        closed = tmp_path / "closed.json"
        assert bench.main([off.url, "--clients", "2", "--requests", "1", "--max-tokens", "4",
                           "--json", str(closed)]) == 0
        on.wait_idle()
        off.wait_idle()
    assert rc == 0
    loop = json.loads(closed.read_text())["summary"]
    assert loop["requests"] == 2 and 2 <= loop["completion_tokens"] <= 8 and loop["tau"] == pytest.approx(1.0)
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| http")]
    assert len(table) == 2 and "| on |" in table[0] and "| off |" in table[1]
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [r["speculation"] for r in runs] == [True, False]
    for r in runs:
        s = r["summary"]
        assert s["requests_sent"] == s["requests_completed"] == len(r["samples"]) == 5
        assert s["requests_failed"] == 0 and s["errors"] == []
        for name in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert s[f"{name}_p50"] is not None and 0 <= s[f"{name}_p50"] <= s[f"{name}_p99"]
        # Every request meets an SLO this loose: goodput is the throughput.
        assert s["requests_per_s"] > 0 and s["goodput_requests_per_s"] == pytest.approx(s["requests_per_s"])
        assert s["completion_tokens"] == sum(x["tokens"] for x in r["samples"])
        for x in r["samples"]:
            assert 1 <= x["tokens"] <= x["max_tokens"] and x["error"] is None
            assert x["sent_s"] <= x["end_s"] and x["ttft_s"] <= x["end_s"] - x["sent_s"]
    # The same traffic for both, prompts cut to exact token counts; greedy answers of the same length.
    plans = [[(x["prompt_tokens"], x["max_tokens"]) for x in r["samples"]] for r in runs]
    assert plans[0] == plans[1]
    assert all(16 <= p <= 40 and 4 <= m <= 12 for p, m in plans[0])
    assert [x["tokens"] for x in runs[0]["samples"]] == [x["tokens"] for x in runs[1]["samples"]]
    assert runs[1]["summary"]["tau"] == pytest.approx(1.0)


def test_serve_starts_a_speculative_then_a_target_only_server(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``--serve FLAGS`` runs ``blockdraft serve FLAGS`` and then ``FLAGS --no-speculation``
    (the built-in pair on the CPU), each stopped afterwards with its log kept."""
    out = tmp_path / "poisson.json"
    rc = bench.main(["--poisson", "--serve", "--device cpu --max-seq-len 256 --max-active 2",
                     "--rate", "20", "--num-requests", "2", "--min-prompt", "8", "--max-prompt", "24",
                     "--min-output", "4", "--max-output", "8", "--warmup", "0", "--start-timeout", "300",
                     "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["label"], r["speculation"]) for r in runs] == [("speculation on", True), ("speculation off", False)]
    assert all(r["summary"]["requests_completed"] == r["summary"]["requests_sent"] == 2 for r in runs)
    assert [x["tokens"] for x in runs[0]["samples"]] == [x["tokens"] for x in runs[1]["samples"]]
    logs = sorted((tmp_path / "logs").glob("serve*.log"))
    assert len(logs) == 2 and "speculation off" in logs[1].read_text()
    assert "speculation off" not in logs[0].read_text()
    assert "| speculation off | off |" in capsys.readouterr().out
