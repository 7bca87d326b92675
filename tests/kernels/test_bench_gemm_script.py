"""``kernels/bench_gemm.py`` without a GPU: its argument parsing, its ``--dry-run`` plan, and
that the config table it prints at the end is Python that builds ``DEFAULT_CONFIGS`` entries
(the timings themselves need the GPU: ``kernels/run_gpu.sh``)."""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from support.kernel_support import K, need_triton

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(KERNELS_DIR))  # the script imports its sibling common.py
    return importlib.import_module("bench_gemm")


def test_arguments(bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    a = bench.parse_args(["--rows", "1, 16", "--shapes", "o,lm_head+argmax", "--quick"])
    assert a.rows == [1, 16] and a.shapes == ["o", "lm_head+argmax"] and a.quick
    assert a.out == tmp_path and not a.dry_run
    for bad in (["--rows", "17"], ["--rows", "x"], ["--shapes", "o,mlp"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_dry_run_plans_every_cell(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--dry-run", "--rows", "1,16", "--shapes", "down,gate_up+swiglu,lm_head+argmax"])
    out = capsys.readouterr().out
    for shape in ("down", "gate_up+swiglu", "lm_head+argmax"):
        for rows in (1, 16):
            assert f"{shape} M={rows}:" in out
    sg = importlib.import_module("blockdraft.kernels.skinny_gemm")
    # every swept config is a valid one; the argmax is never split
    for line in out.splitlines()[1:]:
        cfgs = [eval(c, {"GemmConfig": sg.GemmConfig}) for c in line.split(": ", 2)[2].split("; ")]
        assert cfgs and all(isinstance(c, sg.GemmConfig) for c in cfgs)
        if line.startswith("lm_head+argmax"):
            assert all(c.split_k == 1 for c in cfgs)


def test_suggested_table_is_pasteable(bench: Any) -> None:
    sg = importlib.import_module("blockdraft.kernels.skinny_gemm")
    best = sg.GemmConfig(block_n=128, block_k=64, split_k=3, num_warps=8, num_stages=3, dot=False)
    cell = {"shape": "o", "kind": "linear", "rows": 3, "n": 4096, "k": 4096, "torch_ms": 0.02,
            "torch_pct_copy": 50.0, "speedup_vs_torch": 1.5,
            "default": {"config": vars(best), "ms": 0.015},
            "best": {"config": dict(vars(best)), "ms": 0.01, "gb_per_s": 3355.4, "pct_copy": 78.6}}
    src = bench.suggested(sg, [cell])
    scope: dict[str, Any] = {"GemmConfig": sg.GemmConfig, "Kind": str}
    exec(src, scope)
    assert scope["DEFAULT_CONFIGS"] == {("linear", 4, 4096, 4096): best}
    assert "| o | 3 |" in bench.table([cell])
    assert K.SKINNY_MAX_ROWS == sg.MAX_ROWS == 16


def test_a_run_on_the_cpu_writes_its_table(bench: Any, monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole run at toy shapes in fp32 under the interpreter, eager calls timed instead of
    graph replays: every cell has a best config whose output was checked, and the files and
    the printed table are written."""
    need_triton(torch.device("cpu"))
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    monkeypatch.setattr(bench, "SHAPES", {"toy": ("linear", 40, 300), "toy+swiglu": ("swiglu", 80, 300),
                                          "toy+argmax": ("argmax", 150, 64)})
    monkeypatch.setattr(bench, "L2_BYTES", 40_000)  # a few copies of each toy weight
    monkeypatch.setattr(bench, "copy_bandwidth_gbs", lambda: 100.0)
    monkeypatch.setattr(bench, "record", lambda out, entry: None)  # no device name to log

    def eager_ms(calls: list[Any], reps: int) -> float:
        start = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - start) * 1e3 / len(calls) + 1e-6

    monkeypatch.setattr(bench, "replay_ms", eager_ms)
    bench.main(["--out", str(tmp_path), "--rows", "1,3", "--calls", "1", "--reps", "1", "--quick"])
    cells = json.loads((tmp_path / "gemm.json").read_text())["cells"]
    assert [(c["shape"], c["rows"]) for c in cells] == [
        (s, r) for s in ("toy", "toy+swiglu", "toy+argmax") for r in (1, 3)]
    for c in cells:
        assert c["best"] is not None and c["best"]["ms"] > 0, c
        assert all("error" not in r for r in c["sweep"]), c["sweep"]
        if c["kind"] == "argmax":
            assert c["best"]["argmax_mismatches"] == 0
        else:
            assert c["best"]["rel_err"] < 1e-5
    out = capsys.readouterr().out
    assert "| toy+swiglu | 3 |" in out and "DEFAULT_CONFIGS" in out
    assert "| toy | 1 |" in (tmp_path / "gemm.md").read_text()
