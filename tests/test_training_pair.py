"""The shipped trained pair (blockdraft/pretrained): held-out greedy tau, exactness, sizes, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import blockdraft
from blockdraft import pretrained
from blockdraft.cli import main
from blockdraft.training.evaluate import target_only_greedy

pytestmark = pytest.mark.skipif(not pretrained.available(), reason="built-in pair not installed")


def test_heldout_greedy_tau_and_output_identical_to_the_target() -> None:
    target, drafter, tokenizer = pretrained.builtin_pair(device="cpu")
    prompts = pretrained.heldout_prompts()
    assert len(prompts) == 16
    stops = [tokenizer.eos_token_id]
    res = blockdraft.generate(target, drafter, prompts, max_new_tokens=64, stop_token_ids=stops)
    assert res.stats.mean_tau >= 2.5, res.stats.acceptance_lengths
    for prompt, out in zip(prompts, res.tokens):
        assert out == target_only_greedy(target, prompt, 64, stops)


def test_pair_files_are_bf16_and_within_25_mb() -> None:
    files = [p for p in pretrained.ROOT.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 25_000_000
    for p in files:
        if p.suffix == ".safetensors":
            with safe_open(str(p), framework="pt") as f:
                assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    report = json.loads((pretrained.ROOT / "build_report.json").read_text())
    assert report["drafters"]["b8"]["eval"]["tau"]["greedy"] >= 3.0
    for block in (8, 16):
        d = blockdraft.load_drafter(pretrained.drafter_dir(block))
        assert d.config.block_size == block and d.config.mask_token_id == 1


def test_generate_defaults_to_the_trained_pair(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "import os\n", "--max-new-tokens", "12", "--device", "cpu", "--compare"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "built-in trained pair" in out and "RANDOM" not in out and "output identical" in out


def test_eval_drafter_on_the_builtin_pair(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["eval-drafter", "--num-prompts", "2", "--max-new-tokens", "16", "--device", "cpu",
               "--temperatures", "0,1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "greedy: tau" in out and "T=1: tau" in out and "identical output on 2/2" in out
