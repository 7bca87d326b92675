"""The pieces of the built-in pair's build: the corpus package list and its archive, the
corpus site in place of the interpreter's site-packages, drafter specs, held-out LM metrics,
the loop metric, and a whole tiny build on the CPU."""

from __future__ import annotations

import dataclasses
import json
import math
import tarfile
from pathlib import Path

import pytest
import torch

from blockdraft.training.builtin import corpus_site
from blockdraft.training.builtin.licences import permissive_python_sources
from blockdraft.training.builtin.make_builtin_pair import DrafterSpec, main
from blockdraft.training.builtin.presets import PRESETS
from blockdraft.training.evaluate import distinct_ngram_ratio, heldout_metrics

from support.tinypair import tiny_target

BODY = "def f(x):\n    return x + 1\n" * 20


def _dist(site: Path, name: str, licence: str, files: dict[str, str]) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {name}\nVersion: 1.0\n"
                                   f"License-Expression: {licence}\n\n")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files) + f"{info.name}/METADATA,,\n")


def test_the_shipped_package_list_is_pinned_and_bad_lines_are_named(tmp_path: Path) -> None:
    pins = corpus_site.pinned_packages()
    assert len(pins) >= 40 and all("==" in p for p in pins)
    assert len({p.split("==")[0].lower() for p in pins}) == len(pins)
    bad = tmp_path / "list.txt"
    bad.write_text("# comment\nrequests==2.0\nflask>=3\n")
    with pytest.raises(ValueError, match=r"list.txt:3: expected name==version"):
        corpus_site.pinned_packages(bad)


def test_the_wide_list_adds_distributions_without_repeating_the_shipped_ones(tmp_path: Path) -> None:
    wide = corpus_site.pinned_packages(corpus_site.package_list(Path("corpus_packages_wide.txt")))
    names = {p.split("==")[0].lower().replace("_", "-") for p in wide}
    shipped = {p.split("==")[0].lower().replace("_", "-") for p in corpus_site.pinned_packages()}
    assert len(wide) >= 100 and len(names) == len(wide)
    assert not names & shipped
    with pytest.raises(FileNotFoundError, match="no package list"):
        corpus_site.package_list(tmp_path / "missing.txt")


def test_a_corpus_site_replaces_site_packages_and_its_archive_keeps_what_the_corpus_reads(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _dist(site, "good", "MIT", {"good/a.py": BODY + "# a\n", "good/tiny.py": "x = 1\n",
                                "good/data.json": "{}"})
    _dist(site, "bad", "GPL-3.0-only", {"bad/b.py": BODY + "# b\n"})
    files, licences = permissive_python_sources(max_chars=10**9, site_roots=[site])
    from_site = sorted(Path(f.path).relative_to(site).as_posix() for f in files if Path(f.path).is_relative_to(site))
    assert from_site == ["good/a.py"]
    assert "good" in {lic.distribution for lic in licences} and "bad" not in {lic.distribution for lic in licences}
    # Nothing from the interpreter's own site-packages comes in with a corpus site.
    assert all("site-packages" not in Path(f.path).parts for f in files)

    archive = tmp_path / "site.tar.xz"
    assert corpus_site.pack(site, archive) == 6  # a.py, b.py, and METADATA + RECORD of both
    with tarfile.open(archive, "r:xz") as tar:
        names = set(tar.getnames())
    assert "good/a.py" in names and "good/tiny.py" not in names and "good/data.json" not in names
    assert "good-1.0.dist-info/RECORD" in names


@pytest.mark.parametrize(("text", "block", "dflash2", "name"),
                         [("8", 8, False, "b8"), ("16:dflash2", 16, True, "b16-dflash2"),
                          (" 4:dflash ", 4, False, "b4")])
def test_drafter_specs(text: str, block: int, dflash2: bool, name: str) -> None:
    spec = DrafterSpec.parse(text)
    assert (spec.block, spec.dflash2, spec.name) == (block, dflash2, name)


@pytest.mark.parametrize("text", ["", "1", "x", "8:eagle", "8:dflash2:more"])
def test_bad_drafter_specs_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected B or B:dflash2"):
        DrafterSpec.parse(text)


def test_distinct_ngram_ratio() -> None:
    assert distinct_ngram_ratio([1, 2, 3, 4, 5, 6]) == 1.0
    assert distinct_ngram_ratio([7] * 20) == 1 / 17
    assert distinct_ngram_ratio([1, 2, 1, 2, 1, 2], n=2) == 2 / 5
    assert distinct_ngram_ratio([1, 2]) == 1.0
    with pytest.raises(ValueError):
        distinct_ngram_ratio([1], n=0)


def test_heldout_metrics_equal_a_window_by_window_computation() -> None:
    model = tiny_target(vocab=64)
    stream = torch.randint(0, 64, (53,), generator=torch.Generator().manual_seed(0))
    got = heldout_metrics(model, stream, chars=200, seq_len=16, batch=2)
    total = correct = top = count = 0.0
    with torch.no_grad():
        for i in range(0, 53, 16):
            w = stream[i : i + 16]
            logits = model(input_ids=w[None]).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            correct += float((logits.argmax(-1) == w[1:]).sum())
            top += float(logits.softmax(-1).max(-1).values.sum())
            count += w.numel() - 1
    assert got["tokens"] == count == 49
    assert math.isclose(got["loss"], total / count, rel_tol=1e-5)
    assert math.isclose(got["accuracy"], correct / count)
    assert math.isclose(got["p_argmax"], top / count, rel_tol=1e-5)
    assert math.isclose(got["perplexity"], math.exp(total / count), rel_tol=1e-5)
    assert math.isclose(got["bits_per_char"], total / math.log(2) / 200, rel_tol=1e-5)


def test_tiny_build_end_to_end(tmp_path: Path) -> None:
    """The whole build on the CPU: corpus, tokenizer, target, a DFlash and a DFlash2 drafter,
    the evaluation and the model card."""
    out = tmp_path / "build"
    assert main(["--preset", "tiny", "--out", str(out), "--device", "cpu", "--drafters", "4,4:dflash2"]) == 0
    pair = out / "pair"
    report = json.loads((pair / "build_report.json").read_text())
    assert set(report["drafters"]) == {"b4", "b4-dflash2"}
    assert report["drafters"]["b4-dflash2"]["architecture"] == "DFlash2"
    for d in report["drafters"].values():
        ev = d["eval"]
        assert ev["identical"] == ev["num_prompts"]  # fp32: the output is exactly the target's
        assert set(ev["tau"]) == {"greedy", "T=1", "T=1 sampled"} and ev["tau"]["greedy"] >= 1.0
        assert 0.0 < ev["distinct_4gram"] <= 1.0 and ev["default_prompt"]["text"].startswith("def fibonacci")
    assert {"loss", "perplexity", "accuracy", "bits_per_char"} <= set(report["target"]["heldout"])
    # The target was fine-tuned against loops, measured before and after; the drafters trained
    # on its greedy rollouts (prompt 8 + 24 new tokens + eos, 48 of them).
    tuning = report["target"]["tuning"]
    assert tuning["steps"] == 6 and set(tuning["before"]) == {"heldout", "distinct_4gram"}
    assert tuning["config"]["own_weight"] == 1.0 and tuning["final_own_loss"] > 0
    assert 0.0 < report["target"]["distinct_4gram"]["heldout"] <= 1.0
    assert report["rollouts"]["greedy"]["tokens"] == 48 * (8 + 24 + 1) and "sampled" not in report["rollouts"]
    assert all(d["data"] == ["greedy rollouts"] for d in report["drafters"].values())
    card = (pair / "MODEL_CARD.md").read_text()
    assert "DFlash2, B = 4" in card and "Python standard library" in card and "distinct 4-gram" in card
    assert "unlikelihood" in card and "trained on greedy rollouts" in card and "own greedy choices, weight 1" in card
    assert json.loads((pair / "drafter-b4-dflash2" / "config.json").read_text())["architectures"] == [
        "DFlash2DraftModel"]
    # Measured again, greedy only: the evaluation takes its temperatures.
    assert main(["--out", str(tmp_path / "again"), "--evaluate", str(pair), "--device", "cpu",
                 "--eval-temperatures", "0"]) == 0
    again = json.loads((pair / "build_report.json").read_text())
    for d in again["drafters"].values():
        assert set(d["eval"]["tau"]) == {"greedy"} and d["eval"]["identical"] == d["eval"]["num_prompts"]
    # A later build grows the DFlash2 drafter to 2 layers with focused anchors, from this one's
    # target, rollouts and drafter.
    grown = tmp_path / "grown"
    assert main(["--preset", "tiny", "--out", str(grown), "--device", "cpu", "--drafters", "4:dflash2",
                 "--reuse-target", str(pair / "target"), "--tune-steps", "0", "--rollouts-from", str(out / "work"),
                 "--init-drafters", f"b4-dflash2={pair / 'drafter-b4-dflash2'}", "--drafter-layers", "2",
                 "--anchor-focus", "0.5", "--skip-eval"]) == 0
    entry = json.loads((grown / "pair" / "build_report.json").read_text())["drafters"]["b4-dflash2"]
    assert entry["layers"] == 2 and entry["train_config"]["anchor_focus"] == 0.5
    assert entry["train_config"]["init_from"] == str(pair / "drafter-b4-dflash2")
    assert json.loads((grown / "pair" / "drafter-b4-dflash2" / "config.json").read_text())["num_hidden_layers"] == 2


def test_target_training_through_a_failing_compiler_goes_on_eagerly_with_the_same_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from blockdraft.training.builtin.target import build_target, train_target

    p = dataclasses.replace(PRESETS["tiny"], target_steps=3)
    stream = torch.randint(2, p.vocab, (4000,), generator=torch.Generator().manual_seed(1))

    def broken(module: object) -> object:
        def fail(**kwargs: object) -> object:
            raise RuntimeError("compiler missing")
        return fail

    eager = build_target(p, 0, 0)
    eager_run = train_target(eager, stream, p, torch.device("cpu"), 0)
    monkeypatch.setattr(torch, "compile", broken)
    fallback = build_target(p, 0, 0)
    fallback_run = train_target(fallback, stream, dataclasses.replace(p, target_compile=True), torch.device("cpu"), 0)
    assert eager_run["compiled"] is False and fallback_run["compiled"] is False
    assert fallback_run["steps"] == eager_run["steps"] == 3
    for a, b in zip(eager.parameters(), fallback.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
