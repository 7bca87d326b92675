"""`blockdraft generate`: the demo pair, a real checkpoint pair, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tinypair import HIDDEN, drafter_config, drafter_config_dict, tiny_drafter, tiny_target

from blockdraft.cli import build_demo_pair, main


def _save_pair(root: Path, drafter_hidden: int = HIDDEN) -> tuple[Path, Path]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tdir, ddir = root / "target", root / "drafter"
    target = tiny_target()
    target.save_pretrained(tdir)
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(tdir)
    cfg = drafter_config_dict(hidden=drafter_hidden)
    drafter = tiny_drafter(drafter_config(hidden=drafter_hidden))
    ddir.mkdir()
    (ddir / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(ddir / "model.safetensors"))
    return tdir, ddir


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
    with pytest.raises(Exception, match="hidden size"):
        main([*argv, "--debug"])


def test_demo_subcommand_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "2"]) == 0
    assert "freed twice" in capsys.readouterr().out


