"""The model card generator: the committed card is its output on the committed build report."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from blockdraft import pretrained
from blockdraft.training.builtin.model_card import write_model_card


def _committed_report() -> dict[str, Any]:
    report: dict[str, Any] = json.loads((pretrained.ROOT / "build_report.json").read_text(encoding="utf-8"))
    return report


def test_the_committed_card_is_the_generators_output_on_the_committed_report(tmp_path: Path) -> None:
    write_model_card(tmp_path, _committed_report())
    assert (tmp_path / "MODEL_CARD.md").read_bytes() == (pretrained.ROOT / "MODEL_CARD.md").read_bytes()


def test_the_card_links_speed_instead_of_restating_the_evaluations_rates(tmp_path: Path) -> None:
    report = _committed_report()
    for key in ("machines", "speed", "notes"):
        del report[key]
    write_model_card(tmp_path, report)
    card = (tmp_path / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert "Made from scratch, offline, on NVIDIA H200 (cuda), Python 3.12.3" in card
    assert "Speed: `benchmarks/builtin_pair.py` (every path warmed up) once the pair is installed" in card
    assert "tok/s" not in card and "output identical to target-only decoding on 16/16 prompts." in card


def test_a_report_without_sizes_gives_a_card_without_them(tmp_path: Path) -> None:
    report = copy.deepcopy(_committed_report())
    del report["target"]["mb"]
    del report["drafters"]["b8"]["mb"]
    write_model_card(tmp_path, report)
    card = (tmp_path / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert "tied embeddings: 16.92 M parameters.\n" in card
    assert ("selector_top_k 8, distillation weight 0.5, trained on greedy rollouts + sampled rollouts, "
            "continued from") in card
    assert card.count("MB in bf16") == 1  # the B = 16 drafter's, which the report still sizes
