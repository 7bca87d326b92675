"""The shipped trained pair (blockdraft/pretrained): held-out greedy tau, exactness, sizes, CLI."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from safetensors import safe_open

import blockdraft
from blockdraft import pretrained
from blockdraft.cli import main
from blockdraft.models import DFlash2Drafter
from blockdraft.training.evaluate import distinct_ngram_ratio, target_only_greedy

pytestmark = pytest.mark.skipif(not pretrained.available(), reason="built-in pair not installed")

# Floors: what the shipped pair measures on the CPU (fp32, 16 held-out prompts x 64 new
# tokens: tau 4.62 for B = 8, 5.83 for B = 16), minus a margin. The loop floor is the pair's
# target; its 128-token greedy continuations measure 0.89 on the held-out prompts and 0.86 on
# the default prompt.
TAU_FLOOR_B8 = 4.3
TAU_FLOOR_B16 = 5.4
DISTINCT_4GRAM_FLOOR = 0.6


@pytest.mark.parametrize(("block", "tau_floor"), [(8, TAU_FLOOR_B8), (16, TAU_FLOOR_B16)])
def test_heldout_greedy_tau_and_output_identical_to_the_target(block: int, tau_floor: float) -> None:
    target, drafter, tokenizer = pretrained.builtin_pair(device="cpu", block_size=block)
    prompts = pretrained.heldout_prompts()
    assert len(prompts) == 16
    stops = [tokenizer.eos_token_id]
    # Every draft the block holds, each step: tau measures the drafter, not the scheduler.
    res = blockdraft.generate(target, drafter, prompts, max_new_tokens=64, stop_token_ids=stops,
                              draft_length=block - 1)
    assert res.stats.mean_tau >= tau_floor, res.stats.acceptance_lengths
    for prompt, out in zip(prompts, res.tokens):
        assert out == target_only_greedy(target, prompt, 64, stops)


def test_greedy_continuations_do_not_collapse_into_loops() -> None:
    """The target's 128-token greedy continuations of the held-out prompts and of the default
    prompt keep a floor of distinct 4-grams (a looping continuation repeats a few and scores
    near 0; the files' own next 128 tokens score 0.91)."""
    target, _, tokenizer = pretrained.builtin_pair(device="cpu")
    prompts = pretrained.heldout_prompts() + [tokenizer.encode(pretrained.DEFAULT_PROMPT)]
    ratios = [distinct_ngram_ratio(target_only_greedy(target, p, 128, [tokenizer.eos_token_id]))
              for p in prompts]
    assert statistics.fmean(ratios[:-1]) >= DISTINCT_4GRAM_FLOOR, ratios
    assert ratios[-1] >= DISTINCT_4GRAM_FLOOR, ratios


def test_pair_files_are_bf16_and_within_60_mb() -> None:
    files = [p for p in pretrained.ROOT.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 60_000_000
    for p in files:
        if p.suffix == ".safetensors":
            with safe_open(str(p), framework="pt") as f:
                assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    report = json.loads((pretrained.ROOT / "build_report.json").read_text())
    # The build's record of the H200 in fp32: output identical to the target's on every prompt.
    for name, floor in (("b8", TAU_FLOOR_B8), ("b16", TAU_FLOOR_B16)):
        assert report["drafters"][name]["eval_cuda_float32"]["identical"] == 16
        assert report["drafters"][name]["eval_cuda_float32"]["tau"]["greedy"] >= floor
    for block in (8, 16):
        d = blockdraft.load_drafter(pretrained.drafter_dir(block))
        assert d.config.block_size == block and d.config.mask_token_id == 1
        assert type(d) is DFlash2Drafter


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


def test_eval_drafter_repeats_report_paired_medians() -> None:
    """--repeats N: N paired rounds (engine, then target alone); the rates are the medians of
    the rounds and the speed-up is the median of the per-round ratios."""
    import statistics

    from blockdraft import pretrained
    from blockdraft.training.evaluate import evaluate_drafter

    target, drafter, _ = pretrained.builtin_pair(device=torch.device("cpu"), dtype=torch.float32,
                                                  block_size=8)
    prompts = pretrained.heldout_prompts()[:2]
    rep = evaluate_drafter(target, drafter, prompts, max_new_tokens=8, temperatures=(0.0,),
                           repeats=3)
    assert len(rep.speedup_runs) == len(rep.greedy_tokens_per_s_runs) == 3
    assert rep.speedup == statistics.median(rep.speedup_runs)
    assert rep.tokens_per_s["greedy"] == statistics.median(rep.greedy_tokens_per_s_runs)
    assert rep.target_tokens_per_s == statistics.median(rep.target_tokens_per_s_runs)
    for e, t, r in zip(rep.greedy_tokens_per_s_runs, rep.target_tokens_per_s_runs, rep.speedup_runs):
        assert r == pytest.approx(e / t)
    assert rep.identical == 2
    assert any("per repeat" in line for line in rep.lines())
    with pytest.raises(ValueError, match="repeats"):
        evaluate_drafter(target, drafter, prompts, max_new_tokens=4, repeats=0)


def test_eval_drafter_rejects_bad_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["eval-drafter", "--repeats", "0", "--device", "cpu"])
    assert rc == 2 and "--repeats" in capsys.readouterr().err
