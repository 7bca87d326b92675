"""The ``blockdraft`` command line: the demo pair, a real checkpoint pair, ``--debug`` on every
subcommand, and one-line errors (exit code 2) that name the flag, checked before models load."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import blockdraft
from blockdraft.cli import main
from blockdraft.cli.app import build_parser
from blockdraft.cli.common import CliError, check_lengths
from blockdraft.cli.demo import OPTIONS as DEMO_OPTIONS
from blockdraft.pair import DEMO_SHAPE
from blockdraft.pair.load import build_demo_pair
from blockdraft.training.evaluate import EvalReport

from support.tinypair import HIDDEN, drafter_config, tiny_drafter, tiny_drafter_shape, tiny_target
from support.words import word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY_MAX_POSITIONS = 512  # tiny_target's max_position_embeddings


def _save_pair(root: Path, drafter_hidden: int = HIDDEN) -> tuple[Path, Path]:
    tdir, ddir = root / "target", root / "drafter"
    target = tiny_target()
    target.save_pretrained(tdir)
    word_tokenizer(64).save_pretrained(tdir)
    cfg = tiny_drafter_shape(hidden=drafter_hidden).config_dict()
    drafter = tiny_drafter(drafter_config(hidden=drafter_hidden))
    ddir.mkdir()
    (ddir / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(ddir / "model.safetensors"))
    return tdir, ddir


@pytest.fixture
def model_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every attempt to load weights (none is made: each attempt fails)."""
    calls: list[str] = []

    def refuse(what: str) -> Any:
        def load(*args: Any, **kwargs: Any) -> Any:
            calls.append(what)
            raise RuntimeError(f"{what} should not load")

        return load

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", refuse("target"))
    monkeypatch.setattr("blockdraft.checkpoint.load_drafter", refuse("drafter"))
    monkeypatch.setattr("blockdraft.pretrained.builtin_pair", refuse("built-in pair"))
    monkeypatch.setattr("blockdraft.pair.load.build_demo_pair", refuse("demo pair"))
    return calls


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``argv``; assert exit code 2 and one ``blockdraft: error:`` line; return it."""
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith("blockdraft: error: "), err
    return err[0]


def test_demo_pair_runs_and_says_random(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # The random demo pair is the fallback when the built-in trained pair is not installed.
    monkeypatch.setattr("blockdraft.pretrained.available", lambda block_size=8: False)
    rc = main(["generate", "hello", "--max-new-tokens", "6", "--compare", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "RANDOM weights" in out and "tau" in out and "tok/s" in out
    assert "speed-up" in out and "output identical" in out


def test_demo_pair_is_deterministic() -> None:
    t1, d1 = build_demo_pair()
    t2, d2 = build_demo_pair()
    for a, b in zip(list(t1.parameters()) + list(d1.parameters()), list(t2.parameters()) + list(d2.parameters())):
        assert torch.equal(a, b)


def test_real_pair_from_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tdir, ddir = _save_pair(tmp_path)
    capsys.readouterr()
    rc = main(["generate", "w1 w2 w3", "--target", str(tdir), "--drafter", str(ddir),
               "--max-new-tokens", "5", "--compare"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "RANDOM" not in out and "output identical" in out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--target", "/nonexistent/t", "--drafter", "/nonexistent/d"], "not a directory"),
        (["--target", "/tmp"], "both"),
        (["--device", "tpu:7"], "device"),
        (["--device", "cuda:0"], "cuda"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--temperature", "-1"], "--temperature"),
    ],
)
def test_one_line_errors_exit_2(args: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("CUDA present: cuda:0 is a valid device here")
    rc = main(["generate", "x", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert words.lower() in err.lower()


def test_mismatched_pair_is_one_line_and_debug_shows_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tdir, ddir = _save_pair(tmp_path, drafter_hidden=16)
    capsys.readouterr()  # drop the progress output of saving the pair
    argv: list[str] = ["generate", "w1", "--target", str(tdir), "--drafter", str(ddir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "hidden size" in err
    assert main([*argv, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "hidden size" in err.strip().splitlines()[-1]


def test_demo_subcommand_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "2"]) == 0
    assert "freed twice" in capsys.readouterr().out


# --debug on every subcommand

REQUIRED = {
    "demo": [],
    "generate": [],
    "bench": [],
    "train-drafter": ["--target", "t", "--corpus", "c", "--out", "o"],
    "eval-drafter": [],
    "serve": [],
}


def test_every_subcommand_is_covered() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices or ()) == set(REQUIRED)


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_debug_before_or_after_the_subcommand(command: str) -> None:
    parser = build_parser()
    rest = REQUIRED[command]
    assert parser.parse_args([command, *rest]).debug is False
    assert parser.parse_args(["--debug", command, *rest]).debug is True
    assert parser.parse_args([command, *rest, "--debug"]).debug is True


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_and_still_exits_2(where: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--sequences", "-1"]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("Traceback") and "CliError" in err[-2]
    assert err[-1] == "blockdraft: error: --sequences must be >= 1, not -1"


# the parser: usage errors, --version, help

@pytest.mark.parametrize(("argv", "words"), [
    (["generate", "--max-new-tokens", "abc"], "argument --max-new-tokens: invalid int value: 'abc'"),
    (["bench", "--shape", "nope"], "argument --shape: invalid choice: 'nope'"),
    (["train-drafter"], "the following arguments are required: --target, --corpus, --out"),
    ([], "the following arguments are required: command"),
    (["serve", "--port"], "argument --port: expected one argument"),
])
def test_usage_errors_are_one_line(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("blockdraft: error: ") and words in err[0], err
    assert err[0].endswith(" --help)")


def test_version_prints_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"blockdraft {blockdraft.__version__}"


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_every_flag_has_help_and_shows_its_default(command: str) -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = (sub.choices or {})[command]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        assert action.help, (command, action.option_strings or action.dest)
        if action.option_strings and isinstance(action.default, (int, float, str)) and not isinstance(
                action.default, bool) and action.default != argparse.SUPPRESS:
            assert "default" in action.help or f"(default: {action.default})" in text, (command, action.dest)


# generate: checks before loading


def test_non_utf8_prompt_is_named_before_loading(
    capsys: pytest.CaptureFixture[str], model_loads: list[str]
) -> None:
    # What Python makes of the argv bytes b"abc\xff" (surrogateescape).
    line = _one_line_error(capsys, ["generate", b"abc\xff".decode("utf-8", "surrogateescape")])
    assert line == "blockdraft: error: the prompt is not valid UTF-8 (byte 0xff at character 3)"
    line = _one_line_error(capsys, ["generate", "ok \ud800"])
    assert "U+D800" in line
    assert model_loads == []


def test_empty_prompt_is_refused_before_loading(
    capsys: pytest.CaptureFixture[str], model_loads: list[str]
) -> None:
    line = _one_line_error(capsys, ["generate", ""])
    assert line.startswith("blockdraft: error: the prompt is empty")
    assert model_loads == []


def test_swapped_target_and_drafter_are_named_from_config_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model_loads: list[str]
) -> None:
    tdir, ddir = _save_pair(tmp_path)
    capsys.readouterr()
    line = _one_line_error(capsys, ["generate", "w1", "--target", str(ddir), "--drafter", str(tdir)])
    assert "--target and --drafter are swapped" in line and "DFlashDraftModel" in line
    line = _one_line_error(capsys, ["generate", "w1", "--target", str(ddir), "--drafter", str(ddir)])
    assert f"--target {ddir} is a DFlash drafter" in line
    line = _one_line_error(capsys, ["generate", "w1", "--target", str(tdir), "--drafter", str(tdir)])
    assert f"--drafter {tdir} is not a DFlash drafter" in line and "Qwen3ForCausalLM" in line
    # A drafter is also recognised by its dflash_config alone.
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["Custom"], "dflash_config": {}}))
    line = _one_line_error(capsys, ["generate", "w1", "--target", str(other), "--drafter", str(ddir)])
    assert "--target" in line and "dflash_config" in line
    assert model_loads == []


def test_swapped_target_is_named_by_train_and_eval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model_loads: list[str]
) -> None:
    tdir, ddir = _save_pair(tmp_path)
    capsys.readouterr()
    line = _one_line_error(capsys, ["train-drafter", "--target", str(ddir), "--corpus", "c", "--out",
                                    str(tmp_path / "o")])
    assert f"--target {ddir} is a DFlash drafter" in line
    line = _one_line_error(capsys, ["eval-drafter", "--target", str(ddir), "--drafter", str(tdir)])
    assert "swapped" in line
    assert model_loads == []


def test_max_new_tokens_must_fit_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, model_loads: list[str]
) -> None:
    tdir, ddir = _save_pair(tmp_path)
    capsys.readouterr()
    pair = ["--target", str(tdir), "--drafter", str(ddir)]
    line = _one_line_error(capsys, ["generate", "w1 w2 w3", *pair, "--max-new-tokens", str(10**12)])
    assert line == (f"blockdraft: error: --max-new-tokens {10**12} does not fit: the target's "
                    f"max_position_embeddings is {TINY_MAX_POSITIONS} and the prompt takes 3 tokens "
                    f"(at most {TINY_MAX_POSITIONS - 3})")
    line = _one_line_error(capsys, ["generate", "w1 w2 w3", *pair, "--max-new-tokens",
                                    str(TINY_MAX_POSITIONS - 2)])
    assert "--max-new-tokens" in line and f"at most {TINY_MAX_POSITIONS - 3}" in line
    monkeypatch.setattr("blockdraft.pretrained.available", lambda block_size=8: False)
    line = _one_line_error(capsys, ["generate", "hello", "--max-new-tokens", str(10**12)])
    assert f"max_position_embeddings is {DEMO_SHAPE.max_positions}" in line and "takes 5 tokens" in line
    assert model_loads == []


def test_length_check_boundaries() -> None:
    check_lengths(5, DEMO_SHAPE.max_positions - 5, DEMO_SHAPE.max_positions)  # exactly full
    check_lengths(10**6, 10**9, None)  # no known limit
    with pytest.raises(CliError, match="at most 4091"):
        check_lengths(5, DEMO_SHAPE.max_positions - 4, DEMO_SHAPE.max_positions)
    with pytest.raises(CliError, match="is 4096 tokens"):
        check_lengths(DEMO_SHAPE.max_positions, 1, DEMO_SHAPE.max_positions)


def test_prompt_longer_than_the_target_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, model_loads: list[str]
) -> None:
    tdir, ddir = _save_pair(tmp_path)
    capsys.readouterr()
    words = " ".join(f"w{i % 60}" for i in range(600))
    line = _one_line_error(capsys, ["generate", words, "--target", str(tdir), "--drafter", str(ddir)])
    assert line == ("blockdraft: error: the prompt is 600 tokens; the target's max_position_embeddings "
                    f"is {TINY_MAX_POSITIONS}, which must hold the prompt and at least one new token")
    monkeypatch.setattr("blockdraft.pretrained.available", lambda block_size=8: False)
    line = _one_line_error(capsys, ["generate", "x" * 5000])
    assert "5000 tokens" in line and str(DEMO_SHAPE.max_positions) in line
    assert model_loads == []


# demo options


@pytest.mark.parametrize("flag", [flag for flag, _, _ in DEMO_OPTIONS])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_demo_refuses_counts_below_one(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, ["demo", flag, value])
    assert line == f"blockdraft: error: {flag} must be >= 1, not {value}"


def test_demo_page_size_and_block_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--page-size", "4", "--block-size", "3", "--budget", "10", "--steps", "2",
                 "--prefill", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    # window = budget + B + 1 rows (no cap reached), a slide leaving floor(14 / 8) = 1 row free;
    # 5 prefill rows take 2 pages of 4.
    assert out[0].startswith("pool: 64 pages x 4 tokens;")
    assert out[0].endswith("B=3: 14 rows; a slide leaves 1 free (env BLOCKDRAFT_DFLASH_SLIDE)")
    assert out[1] == "step 0 seq 0: +5 rows -> ctx_len 5, positions 0..4, 2 pages; pool 2/64 used"
    with pytest.raises(SystemExit):
        main(["demo", "--gamma", "8"])
    capsys.readouterr()


# train-drafter corpus lines

BAD_LINES = [
    (b'{"text": "a"}\n{"text": "b",\n', 2, "not valid JSON"),
    (b'{"text": "a"}\n\n[1, 2]\n', 3, "found an array"),
    (b'{"txt": "a"}\n', 1, "no 'text' field (keys: 'txt')"),
    (b'{"text": "a"}\n{"text": 5}\n', 2, "'text' must be a string, found a number"),
    (b'{"text": "a\xff"}\n', 1, "not UTF-8 (byte 0xff at column 12)"),
]


@pytest.mark.parametrize(("data", "lineno", "words"), BAD_LINES, ids=[w for _, _, w in BAD_LINES])
def test_bad_corpus_line_names_path_and_line(
    data: bytes, lineno: int, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    model_loads: list[str],
) -> None:
    tdir, _ = _save_pair(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(data)
    capsys.readouterr()
    line = _one_line_error(capsys, ["train-drafter", "--target", str(tdir), "--corpus", str(corpus),
                                    "--out", str(tmp_path / "run"), "--device", "cpu"])
    assert f"--corpus: {corpus}:{lineno}: " in line and words in line
    assert model_loads == [] and not (tmp_path / "run").exists()


# eval-drafter: each rate once


def test_eval_report_prints_each_rate_once_and_says_what_it_times() -> None:
    rep = EvalReport(2, 16, "cpu", "torch.float32", tau={"greedy": 3.0, "T=1": 2.5},
                     tokens_per_s={"greedy": 110.0, "T=1": 222.0}, target_tokens_per_s=55.0,
                     speedup=2.0, greedy_tokens_per_s_runs=[100.0, 110.0, 120.0],
                     target_tokens_per_s_runs=[50.0, 55.0, 60.0], identical=2,
                     runtime_tokens_per_s=44.0, runtime_speedup=2.5,
                     runtime_tokens_per_s_runs=[40.0, 44.0, 48.0])
    rates = [line for line in rep.lines() if "tok/s" in line]
    assert rates == [
        "   greedy: tau 3.00  engine 110.0 tok/s (median of 3 timed rounds)",
        "      T=1: tau 2.50  engine 222.0 tok/s (one pass over the prompts)",
        "  target only, blockdraft runtime (greedy): 44.0 tok/s (median of 3 timed rounds)",
        "  target only, Hugging Face generate (greedy): 55.0 tok/s (median of 3 timed rounds)",
    ]
    text = "\n".join(rep.lines())
    assert ("speed-up over target-only decoding on the same runtime (median of the per-round "
            "ratios): 2.50x") in text
    assert "speed-up over Hugging Face generate (median of the per-round ratios): 2.00x" in text
    assert text.count("speed-up over") == 2
    assert "identical output on 2/2 prompts" in text and "speed-up per repeat (median above): 2.00, 2.00, 2.00" in text
    no_compare = EvalReport(1, 8, "cpu", "torch.float32", tau={"greedy": 2.0}, tokens_per_s={"greedy": 9.0})
    assert no_compare.lines()[1:] == ["   greedy: tau 2.00  engine 9.0 tok/s (one pass over the prompts)"]


def test_eval_drafter_prints_each_rate_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    tdir, ddir = _save_pair(tmp_path)
    texts = tmp_path / "heldout.jsonl"
    texts.write_text(json.dumps({"text": " ".join(f"w{i}" for i in range(1, 13))}) + "\n")
    capsys.readouterr()
    caplog.set_level("INFO")
    rc = main(["eval-drafter", "--target", str(tdir), "--drafter", str(ddir), "--texts", str(texts),
               "--num-prompts", "1", "--prompt-tokens", "4", "--max-new-tokens", "4", "--device", "cpu",
               "--repeats", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rates = [line for line in out.splitlines() if "tok/s" in line]
    assert len(rates) == 4, out
    assert "greedy: tau" in rates[0] and "median of 2 timed rounds" in rates[0]
    assert "T=1: tau" in rates[1] and "one pass" in rates[1]
    assert rates[2].startswith("  target only, blockdraft runtime (greedy): ")
    assert rates[3].startswith("  target only, Hugging Face generate (greedy): ")
    assert out.count("speed-up over") == 2
    # No other rate reaches the user through the log (INFO is the CLI's level).
    assert not [r for r in caplog.records if r.levelno >= 20 and "tok/s" in r.getMessage()]


# the package and its entry points


def _python(code_or_args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_training_cli_imports_first_then_the_parser() -> None:
    """blockdraft.cli.train uses blockdraft.cli.common; importing it first must not need
    the parser (the parser imports blockdraft.cli.train)."""
    code = ("import blockdraft.cli.train\n"
            "from blockdraft.cli import main\n"
            "raise SystemExit(main(['demo', '--steps', '1']))\n")
    res = _python(["-c", code])
    assert res.returncode == 0, res.stderr
    assert "freed twice" in res.stdout


def test_python_dash_m_runs_the_cli() -> None:
    res = _python(["-m", "blockdraft.cli", "demo", "--sequences", "0"])
    assert res.returncode == 2
    assert res.stderr.strip() == "blockdraft: error: --sequences must be >= 1, not 0"
