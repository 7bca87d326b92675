"""The benchmark tool on the tiny shape (CPU) and the CUDA-graph path's bookkeeping.

The bench's figures are not checked here (timings belong in benchmarks): its records, its
report, where it writes, how it logs, and the helpers through which it reaches the proposer.

The graph path (``graphs="static"``: the captured path's buffers run eagerly) must give the
plain path's drafts through batch-size changes, bucket padding, slides and aborted plans.
"""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from blockdraft import ConfigError, DFlashProposer
from blockdraft import bench as bd_bench
from blockdraft import pair as bd_pair
from blockdraft.bench.host import stub_launch
from blockdraft.cli import main as cli_main
from blockdraft.cuda_graphs import default_buckets, resolve_mode

from support.tinypair import drafter_config, tiny_drafter, tiny_target


def _drive(mode: str, budget: int, seed: int) -> tuple[list[Any], list[list[int]]]:
    """A scripted run over 4 sequences: batches of 1..4 in changing order, 1..3 new rows per
    step; returns every proposal and each state's final device page table."""
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(block=4, layers=2))
    prop = DFlashProposer(
        drafter, target, max_seq_len=200, num_pages=80, max_batch=4, graphs=mode,
        page_size=4,
    )
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(400, 64, generator=gen)
    states = [prop.alloc_state_for(budget) for _ in range(4)]
    pos = [9, 14, 6, 21]
    for i, st in enumerate(states):
        prop.commit_ctx(st, rows[: pos[i]], range(pos[i]))
    order = torch.randperm(400, generator=gen).tolist()
    got: list[Any] = []
    for step in range(24):
        n = 1 + step % 4
        idx = sorted({order[(step * 4 + j) % 400] % 4 for j in range(n)})
        toks = [(step * 7 + i) % 60 for i in idx]
        if len(idx) == 1:
            got.append([prop.propose(states[idx[0]], toks[0], pos[idx[0]], 3)])
        else:
            got.append(prop.propose_batch([states[i] for i in idx], toks, [pos[i] for i in idx], 3))
        for i in idx:
            prop.after_verify(states[i], 0)
            k = 1 + (step + i) % 3
            prop.commit_ctx(states[i], rows[pos[i] : pos[i] + k], range(pos[i], pos[i] + k))
            pos[i] += k
    tables = []
    for st in states:
        assert st.page_table_dev is None or st.page_table_dev.tolist() == st.page_table or (
            st.ctx_committed < st.ctx_len
        )
        tables.append(st.page_table)
        prop.free_state(st)
    assert prop.pool.num_free == prop.pool.num_pages
    return got, tables


@pytest.mark.parametrize("budget", [60, 12])  # 12: windows of 17 rows, so the windows slide
def test_static_graph_path_gives_the_plain_drafts(budget: int) -> None:
    plain, _ = _drive("off", budget, seed=budget)
    static, _ = _drive("static", budget, seed=budget)
    assert static == plain
    assert any(len(batch) > 1 for batch in plain)


def test_static_graph_path_after_an_aborted_plan_rereads_the_table() -> None:
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(block=4))
    page = {"page_size": 4}
    prop = DFlashProposer(
        drafter, target, max_seq_len=64, num_pages=40, max_batch=2, graphs="static", **page
    )
    plain = DFlashProposer(
        drafter, target, max_seq_len=64, num_pages=40, max_batch=2, graphs="off", **page
    )
    rows = torch.randn(30, 64, generator=torch.Generator().manual_seed(3))
    outs = []
    for p in (prop, plain):
        st = p.alloc_state()
        p.commit_ctx(st, rows[:10], range(10))
        first = p.propose(st, 5, 10, 3)
        p.after_verify(st, 0)
        p.commit_ctx(st, rows[10:17], range(10, 17))
        # A failing forward aborts the plan: its new blocks go back to the pool.
        runner = p.graph_runner
        boom = RuntimeError("injected")
        original = p.drafter.forward_block

        def fail(*a: Any, boom: RuntimeError = boom, **k: Any) -> Any:
            raise boom

        p.drafter.forward_block = fail  # type: ignore[method-assign]
        # The graph path drafts through the drafter's fused view (same math, stacked weights).
        fast = p.forward.fused_view() if p.graph_runner is not None else None
        if fast is not None:
            fast.forward_block = fail  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected"):
            p.propose(st, 6, 17, 3)
        del p.drafter.forward_block
        if fast is not None:
            del fast.forward_block
        assert p.drafter.forward_block == original
        second = p.propose(st, 6, 17, 3)
        outs.append((first, second, st.page_table))
        if runner is not None:
            assert st.page_table_dev is not None
            assert st.page_table_dev.tolist() == st.page_table
        p.free_state(st)
    assert outs[0] == outs[1]


def test_graph_modes_and_buckets() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(16) == [1, 2, 4, 8, 16]
    assert default_buckets(24) == [1, 2, 4, 8, 16, 24]
    cpu = torch.device("cpu")
    assert resolve_mode("auto", cpu) is None
    assert resolve_mode("off", cpu) is None
    assert resolve_mode("static", cpu) == "static"
    with pytest.raises(ConfigError, match="CUDA"):
        resolve_mode("capture", cpu)
    with pytest.raises(ConfigError, match="graphs must be"):
        resolve_mode("sometimes", cpu)


def test_memory_report_matches_the_formula_to_the_byte() -> None:
    shape = bd_pair.SHAPES["tiny"]
    dtype = torch.float32
    target, drafter = bd_pair.random_pair(shape, torch.device("cpu"), dtype)
    prop = bd_bench.make_proposer(drafter, target, shape, 37, 2, "off", 20)
    st = prop.alloc_state()
    prop.commit_ctx(st, torch.randn(37, shape.ctx_row_width), range(37))
    prop.propose(st, 3, 37, shape.block_size - 1)
    mem = bd_bench.state_memory(prop, st)
    # Independent arithmetic: window x k x H x 4 bytes; ceil(37 / 16) pages of 16 rows, each
    # row L x (K, V) x Hkv x D x 4 bytes.
    window = 37 + 20
    assert mem["window"] == window == st.window
    assert mem["acc_bytes"] == window * 2 * 64 * 4
    assert mem["kv_bytes"] == math.ceil(37 / 16) * 16 * (2 * 2 * 2 * 16 * 4)
    assert mem["pages"] == 3 and mem["pages_within_bound"] and mem["equal_to_formula"]
    prop.free_state(st)


def test_bench_tiny_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="blockdraft.bench")
    out = tmp_path / "b"
    rc = cli_main(
        [
            "bench", "--shape", "tiny", "--contexts", "16", "--batches", "1,2", "--reps", "2",
            "--warmup", "1", "--loop-reps", "1", "--e2e-steps", "2", "--e2e-repeats", "3",
            "--out", str(out),
            "--sections", "propose,reference,host,kernels,e2e",
        ]
    )
    assert rc == 0, capsys.readouterr()
    result = json.loads((out / "bench.json").read_text())
    assert result["schema"] == bd_bench.SCHEMA_VERSION
    assert result["errors"] == {}
    assert result["shape"]["name"] == "tiny"
    sec = result["sections"]
    assert sorted(sec) == ["e2e", "host", "kernels", "propose", "reference"]
    cells = {(r["context"], r["batch"]) for r in sec["propose"]}
    assert cells == {(16, 1), (16, 2)}
    for r in sec["propose"]:
        for key in ("latency_ms", "loop_ms", "precompute_ms", "memory_per_seq", "speedup_vs_loop"):
            assert key in r
        assert r["latency_ms"]["n"] == 2 and r["latency_ms"]["median"] > 0
        assert r["latency_ms"]["p90"] >= r["latency_ms"]["median"]
        assert r["memory_per_seq"]["equal_to_formula"] and r["pool_check"]
        assert set(r["precompute_ms"]) == {"rows_1", f"rows_{bd_pair.SHAPES['tiny'].block_size}"}
    ref = sec["reference"]
    assert [r["backend"] for r in ref] == ["default"] and ref[0]["forward_ms"]["median"] > 0
    host = sec["host"]
    assert host[-1]["kind"] == "core_bookkeeping" and host[-1]["us_per_seq_step"] > 0
    assert {r["batch"] for r in host[:-1]} == {1, 2}
    for r in host[:-1]:
        assert r["profile_us_per_call"].get("rust_core", 0) > 0
        assert r["profile_us_per_call"].get("blockdraft_python", 0) > 0
        # the unprofiled glue (graph-path bookkeeping, device work stubbed) is measured too
        assert 0 < r["glue_us_per_seq"] <= r["glue_us_per_call"]
    assert sec["kernels"] == []  # CUDA only
    for r in sec["e2e"]:
        assert r["blockdraft"]["ms_per_step"] > 0 and r["reference"]["ms_per_step"] > 0
        for key in ("blockdraft", "reference"):  # the median of 3 alternating runs
            runs = r[key]["runs_ms_per_step"]
            assert len(runs) == 3 and runs == sorted(runs)
            assert r[key]["ms_per_step"] == runs[1]
        assert r["blockdraft"]["steps"] >= 1 and r["reference"]["steps"] >= 1
    md = (out / "bench.md").read_text()
    assert "## Propose latency" in md and "## End to end" in md
    assert md in capsys.readouterr().out
    _assert_rounded_logs(caplog, {"propose", "reference", "host", "e2e"})


def test_bench_rejects_bad_configs() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        bd_bench.run(bd_bench.BenchConfig(shape="qwen9"))
    with pytest.raises(ValueError, match="unknown sections"):
        bd_bench.run(bd_bench.BenchConfig(sections=["propose", "nope"]))
    with pytest.raises(ValueError, match="positive"):
        bd_bench.run(bd_bench.BenchConfig(batches=[0]))
    with pytest.raises(ValueError, match="e2e backends"):
        bd_bench.run(bd_bench.BenchConfig(e2e_backends=["cudnn"]))
    with pytest.raises(ValueError, match="e2e_repeats"):
        bd_bench.run(bd_bench.BenchConfig(e2e_repeats=0))
    for caps in ([], [None, -1]):
        with pytest.raises(ValueError, match="spec caps"):
            bd_bench.run(bd_bench.BenchConfig(spec_caps=caps))


def test_spec_caps_option() -> None:
    """``--spec-caps``: ``env`` (the environment's cap) and token counts, in order; anything
    else is a clear error naming the option."""
    import argparse

    from blockdraft.bench.command import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).spec_caps == [None]
    assert config_from_args(parser.parse_args(["--spec-caps", "0, env,4096"])).spec_caps == [0, None, 4096]
    for bad in ("lots", "-1"):
        with pytest.raises(ValueError, match="--spec-caps"):
            config_from_args(parser.parse_args(["--spec-caps", bad]))


_UNROUNDED = re.compile(r"\d\.\d{4,}|\d[eE][-+]?\d")


def _assert_rounded_logs(caplog: pytest.LogCaptureFixture, kinds: set[str]) -> None:
    """Every bench log line has its figures rounded (at most 3 decimals, no exponents), and
    each of ``kinds`` (the first word of a section's lines) logged at least once."""
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("blockdraft.bench")]
    assert kinds <= {m.split(" ", 1)[0].rstrip(":") for m in msgs}, msgs
    unrounded = [m for m in msgs if _UNROUNDED.search(m)]
    assert not unrounded, unrounded


def _tiny_run(argv: list[str]) -> int:
    return cli_main(
        ["bench", "--shape", "tiny", "--contexts", "16", "--batches", "1", "--reps", "2",
         "--warmup", "1", "--loop-reps", "1", "--sections", "propose", *argv]
    )


def test_bench_writes_under_the_system_temp_dir_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert _tiny_run(["--batches", "0"]) == 2  # a bad config leaves no directory behind
    assert list(system_tmp.rglob("*")) in ([], [system_tmp / "blockdraft-bench"])
    assert _tiny_run([]) == 0
    assert list(cwd.iterdir()) == []
    runs = list((system_tmp / "blockdraft-bench").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("tiny-")
    assert sorted(p.name for p in runs[0].iterdir()) == ["bench.json", "bench.md"]
    out = capsys.readouterr().out
    assert f"wrote {runs[0] / 'bench.json'}, {runs[0] / 'bench.md'}" in out
    # Every run gets a new, empty directory of its own, even within the same second.
    again = [bd_bench.default_out_dir("tiny") for _ in range(2)]
    assert len({runs[0], *again}) == 3 and all(list(d.iterdir()) == [] for d in again)


def test_bench_help_names_the_default_output_dir(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", "--shape", "tiny", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--out" in out and "system temp dir" in " ".join(out.split())
    # argparse may wrap the path at a hyphen
    assert "<tmp>/blockdraft-bench/<shape>-" in "".join(out.split())


def test_report_names_the_timing_method_of_the_device(tmp_path: Path) -> None:
    assert _tiny_run(["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["environment"]["device"] == "cpu"
    md = bd_bench.to_markdown(result)
    assert "## Propose latency (ms; wall clock around the call)" in md
    assert "CUDA" not in md
    result["environment"]["device"] = "cuda:0"
    md = bd_bench.to_markdown(result)
    assert "## Propose latency (ms; CUDA events around the call, which ends in a host sync)" in md
    assert bd_bench.timing_method("cpu") == "wall clock"
    assert bd_bench.timing_method(torch.device("cuda", 1)) == "CUDA events"


def test_quick_bench_logs_rounded_figures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="blockdraft.bench")
    shape = bd_pair.SHAPES["tiny"]
    cpu = torch.device("cpu")
    target, drafter = bd_pair.random_pair(shape, cpu, torch.float32)
    recs = bd_bench.bench_quick(shape, drafter, target, cpu, cells=[(24, 1), (24, 2)], reps=2,
                                warmup=1)
    assert [(r["context"], r["batch"]) for r in recs] == [(24, 1), (24, 2)]
    _assert_rounded_logs(caplog, {"quick"})


def test_memory_figures_read_the_cache() -> None:
    shape = bd_pair.SHAPES["tiny"]
    target, drafter = bd_pair.random_pair(shape, torch.device("cpu"), torch.float32)
    prop = bd_bench.make_proposer(drafter, target, shape, 20, 1, "off", 8)
    assert prop.page_size == 16
    # One block: every layer's K and V rows of 16 slots, fp32 (+ its slot positions).
    assert prop.cache.bytes_per_page == 16 * shape.drafter_layers * 2 * 2 * 16 * 4 + 4 * 16


def test_graphs_off_and_a_stubbed_launch_steer_the_graph_path() -> None:
    shape = bd_pair.SHAPES["tiny"]
    target, drafter = bd_pair.random_pair(shape, torch.device("cpu"), torch.float32)
    prop = bd_bench.make_proposer(drafter, target, shape, 20, 2, "static", 40)
    runner = prop.graph_runner
    assert runner is not None and runner.mode == "static"
    seqs = bd_bench.Seqs(prop, shape, 20, 2, torch.Generator().manual_seed(5))
    launches: list[int] = []
    ready = torch.full((2, shape.block_size - 1), 7, dtype=torch.int64)

    def launch(bucket: Any, n: int, cap: int) -> torch.Tensor:
        launches.append(n)
        return ready[:n]

    idx = [0, 1]
    with stub_launch(runner, launch):
        seqs.advance(idx)
        assert seqs.propose_batch(idx) == [[7] * (shape.block_size - 1)] * 2
        assert launches == [2]
        with prop.eager():
            seqs.advance(idx)
            plain = seqs.propose_batch(idx)
        assert launches == [2] and plain != [[7] * (shape.block_size - 1)] * 2
        assert prop.graph_runner is runner
    seqs.advance(idx)
    seqs.propose_batch(idx)  # the real launch is back
    assert launches == [2]
    seqs.free()
    assert prop.pool.num_free == prop.pool.num_pages
    bd_bench.release(prop)
    assert prop.graph_runner is None


def test_quick_bench_puts_a_dflash2_drafter_beside_dflash() -> None:
    """The ``*-dflash2`` shapes are the same pair with a DFlash2 drafter; the quick table shows
    its latency beside DFlash's, with their ratio."""
    cpu = torch.device("cpu")
    base, two = bd_pair.SHAPES["tiny"], bd_pair.SHAPES["tiny-dflash2"]
    assert bd_pair.SHAPES["qwen3-8b-dflash2"].dflash2 == (3, 32, 32, 8)
    target, drafter = bd_pair.random_pair(base, cpu, torch.float32)
    drafter2 = bd_pair.random_drafter(two, cpu, torch.float32)
    assert type(drafter2).__name__ == "DFlash2Drafter" and drafter2.config.selector_top_k == 4
    recs = [*bd_bench.bench_quick(base, drafter, target, cpu, cells=[(24, 2)], reps=2, warmup=1),
            *bd_bench.bench_quick(two, drafter2, target, cpu, cells=[(24, 2)], reps=2, warmup=1)]
    assert [r["shape"] for r in recs] == ["tiny", "tiny-dflash2"]
    rows = bd_bench.quick_markdown(recs).splitlines()[2:]
    ratio = recs[1]["latency_ms"]["median"] / recs[0]["latency_ms"]["median"]
    assert rows[0].startswith("| tiny | 24 | 2 |") and "target ≤" not in rows[0]
    assert rows[1].startswith("| tiny-dflash2 | 24 | 2 |")
    assert f"| {ratio:.2f}x (target ≤ 1.15x) |" in rows[1]
