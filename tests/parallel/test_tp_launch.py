"""Launching tensor-parallel ranks: a rank killed mid-run or raising ends the whole group with
an error naming it (no hang), and ``blockdraft generate --tp 2`` works end to end, started by
itself and under ``torchrun``, printing what ``--tp 1`` prints."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from blockdraft import ConfigError
from blockdraft.cli import main
from blockdraft.parallel import RankFailedError, TPGroup, init_tp, launch, launched_by_torchrun

from support.scorecard import expect_clear_error, score
from support.tp_support import decode_until_killed, fail_on_rank, pid_alive, save_pair, symptom_before_cause

ROOT = Path(__file__).resolve().parents[2]
HANG_BOUND_S = 60.0
"""A dead rank must end the run well before this (the launcher's watchdog acts within about a
second; without it the survivors would wait for the group's collective timeout)."""


def test_killed_rank_ends_the_group(tmp_path: Path) -> None:
    """SIGKILL rank 1 while both ranks decode: the launch raises naming rank 1 and the
    signal, and rank 0 is gone too."""
    killed: dict[str, float] = {}

    def kill_rank1() -> None:
        files = [tmp_path / f"rank{r}" for r in range(2)]
        while not all(f.exists() for f in files):
            time.sleep(0.05)
        killed["at"] = time.monotonic()
        os.kill(int(files[1].read_text()), signal.SIGKILL)

    threading.Thread(target=kill_rank1, daemon=True).start()
    with pytest.raises(RankFailedError) as info:
        launch(decode_until_killed, 2, (str(tmp_path),), device="cpu", timeout_s=HANG_BOUND_S)
    assert "at" in killed
    assert time.monotonic() - killed["at"] < HANG_BOUND_S
    err = info.value
    assert err.rank == 1 and err.exitcode == -signal.SIGKILL
    assert str(err) == "tensor-parallel rank 1 was killed by signal SIGKILL; the other ranks were stopped"
    assert not pid_alive(int((tmp_path / "rank0").read_text()))
    score.fault_points += 1


def test_raising_rank_is_named_not_the_rank_waiting_on_it() -> None:
    with pytest.raises(RankFailedError) as info:
        launch(fail_on_rank, 2, (1,), device="cpu", timeout_s=HANG_BOUND_S)
    err = info.value
    assert err.rank == 1 and err.error == "ValueError: boom on rank 1"
    assert err.remote_traceback is not None and "boom on rank 1" in err.remote_traceback
    assert "rank 1 failed: ValueError: boom on rank 1" in str(err)
    score.fault_points += 1


@pytest.mark.parametrize(("cause", "words"), [
    ("kill", "rank 1 was killed by signal SIGKILL"),
    ("raise", "rank 1 failed: ValueError: the cause, on rank 1"),
])
def test_the_cause_is_named_when_its_symptom_arrives_first(cause: str, words: str) -> None:
    """A rank whose collective lost its peer reports before the peer has visibly ended: the
    launcher still names the peer, the cause."""
    with pytest.raises(RankFailedError) as info:
        launch(symptom_before_cause, 2, (cause,), device="cpu", timeout_s=HANG_BOUND_S)
    assert info.value.rank == 1
    assert words in str(info.value)
    score.fault_points += 1


def _argv(tdir: Path, ddir: Path, *extra: str) -> list[str]:
    return ["generate", "w1 w2 w3 w4", "--target", str(tdir), "--drafter", str(ddir),
            "--max-new-tokens", "12", "--device", "cpu", *extra]


def _text(out: str) -> list[str]:
    """The decoded text and the tau line's token count (the timings, and the warm-up line
    with them, vary)."""
    lines = [line for line in out.splitlines() if not line.startswith("warm-up:")]
    spec = next(line for line in lines if line.startswith("speculative:"))
    return [lines[1], spec.split(",")[0]]


def test_cli_generate_tp2_equals_tp1(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``--tp 2`` starts two ranks itself; only rank 0 prints; the text equals ``--tp 1``'s
    and target-only decoding on the TP runtime agrees with it."""
    tdir, ddir = save_pair(tmp_path)
    capfd.readouterr()
    assert main(_argv(tdir, ddir)) == 0
    one = capfd.readouterr().out
    assert main(_argv(tdir, ddir, "--tp", "2", "--compare")) == 0
    two = capfd.readouterr().out
    assert _text(two) == _text(one)
    assert two.count("blockdraft generate:") == 1
    assert "tensor parallel over 2 ranks (gloo)" in two
    assert "target only, blockdraft runtime: 12 tokens" in two and "output identical" in two


def test_cli_tp_that_does_not_split_is_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    tdir, ddir = save_pair(tmp_path)
    capfd.readouterr()
    assert main(_argv(tdir, ddir, "--tp", "3")) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["blockdraft: error: tensor parallelism 3 does not split Qwen3ForCausalLM: "
                   "num_attention_heads=4, num_key_value_heads=2 and intermediate_size=64 are "
                   "not divisible by 3"]
    assert main(_argv(tdir, ddir, "--tp", "0")) == 2
    assert "--tp must be >= 1" in capfd.readouterr().err
    score.bad_inputs += 2
    score.clear_errors += 2


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    return env


def test_cli_under_torchrun(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The same command under ``torchrun --nproc-per-node 2``: the ranks come from its
    environment; the text equals ``--tp 1``'s."""
    tdir, ddir = save_pair(tmp_path)
    capfd.readouterr()
    assert main(_argv(tdir, ddir)) == 0
    one = capfd.readouterr().out
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "blockdraft.cli",
         *_argv(tdir, ddir)],
        capture_output=True, text=True, env=_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _text(proc.stdout) == _text(one)
    assert "tensor parallel over 2 ranks (gloo)" in proc.stdout
    assert proc.stdout.count("blockdraft generate:") == 1


def _rank_pids(parent: int) -> list[int]:
    """The launcher's rank processes (its spawned children, not the resource tracker)."""
    out = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                out.append(int(pid))
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_cli_killed_rank_is_one_line_exit_2(tmp_path: Path) -> None:
    """``blockdraft generate --tp 2`` with one rank killed mid-run: exit code 2, the last line
    of stderr is one error line naming that rank, and no rank outlives the command."""
    tdir, ddir = save_pair(tmp_path)
    argv = [sys.executable, "-m", "blockdraft.cli", *_argv(tdir, ddir, "--tp", "2", "--no-progress")]
    argv[argv.index("12")] = "480"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    assert proc.stdout is not None
    header = proc.stdout.readline()  # rank 0 prints it once the engine is built
    assert header.startswith("blockdraft generate:"), header
    ranks = _rank_pids(proc.pid)
    assert len(ranks) == 2
    killed_at = time.monotonic()
    os.kill(ranks[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=HANG_BOUND_S)
    assert time.monotonic() - killed_at < HANG_BOUND_S
    assert proc.returncode == 2
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"blockdraft: error: tensor-parallel rank [01] was killed by signal SIGKILL; "
                        r"the other ranks were stopped", last), err
    assert "Traceback" not in err
    assert not any(pid_alive(pid) for pid in ranks)
    score.fault_points += 1


def _rank_and_size(group: TPGroup, k: int) -> tuple[int, int, int]:
    return group.rank, group.size, k * 2


def test_one_rank_runs_here_and_bad_sizes() -> None:
    assert launch(_rank_and_size, 1, (3,), device="cpu") == [(0, 1, 6)]
    for bad in (0, -1, True, 1.5):
        with expect_clear_error(ValueError, "nprocs"):
            launch(_rank_and_size, bad, (3,))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"WORLD_SIZE": "2"}, "RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is outside 0..1"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR is not set"),
    ],
)
def test_init_tp_names_what_the_environment_lacks(env: dict[str, str], words: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with expect_clear_error(ConfigError, re.escape(words)):
        init_tp(device="cpu")


def test_without_torchrun_a_group_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert not launched_by_torchrun()
    group = init_tp(device="cpu")
    assert (group.rank, group.size, group.backend) == (0, 1, None)
    t = torch.ones(3)
    assert group.all_reduce_(t) is t and group.agree_min(7) == 7 and group.gather("x") == ["x"]
    assert group.broadcast({"a": 1}) == {"a": 1}
    group.close()
