"""The side-by-side table of ``blockdraft bench``: built from the ``spec`` and ``e2e`` sections of
one run, with tokens/s derived at a trained pair's τ only from steps that drafted ``B - 1``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from blockdraft.bench import BenchConfig, resolve
from blockdraft.bench.side_by_side import PUBLIC_TAU, side_by_side, side_by_side_markdown
from blockdraft.cli import main as cli_main


def _spec(context: int, batch: int, step: float, decode: float, drafts: Any) -> dict[str, Any]:
    return {"context": context, "batch": batch, "block": 16, "ctx_cap": None, "draft_length": drafts,
            "step_ms": {"median": step}, "decode_ms": {"median": decode}}


def _e2e(context: int, backend: str, ref: float) -> dict[str, Any]:
    return {"context": context, "backend": backend, "reference": {"ms_per_step": ref}}


def _result(spec: list[dict[str, Any]], e2e: list[dict[str, Any]], tau: float = 6.5) -> dict[str, Any]:
    return {"config": {"public_tau": tau}, "sections": {"spec": spec, "e2e": e2e}}


def test_rows_put_each_step_beside_decode_and_the_reference() -> None:
    result = _result(
        [_spec(4096, 1, 6.5, 5.0, 15), _spec(4096, 32, 26.0, 10.0, 15), _spec(512, 1, 5.0, 4.0, "adaptive")],
        [_e2e(4096, "default", 90.0), _e2e(4096, "flash", 78.0), _e2e(512, "flash", 80.0)],
    )
    one, many, adaptive = side_by_side(result)
    # batch 1, 15 drafts: 6.5 tokens in 6.5 ms; the reference's flash run, 78 ms per step
    assert one["step_over_decode"] == pytest.approx(1.3)
    assert one["reference_ms"] == 78.0 and one["reference_over_step"] == pytest.approx(12.0)
    assert one["derived_tok_s"] == pytest.approx(1000.0)
    assert one["decode_tok_s"] == pytest.approx(200.0)
    assert one["reference_derived_tok_s"] == pytest.approx(6500 / 78)
    # 32 sequences: 32 x 6.5 tokens in 26 ms; the reference runs at batch 1 only
    assert many["derived_tok_s"] == pytest.approx(8000.0)
    assert many["decode_tok_s"] == pytest.approx(3200.0)
    assert many["reference_ms"] is None and many["reference_derived_tok_s"] is None
    # an adaptive draft length drafts less at tau 1: nothing derived from its steps
    assert adaptive["derived_tok_s"] is None and adaptive["reference_derived_tok_s"] is None
    assert adaptive["reference_ms"] == 80.0 and adaptive["step_over_decode"] == pytest.approx(1.25)


def test_the_derived_rate_follows_the_given_tau() -> None:
    rows = side_by_side(_result([_spec(4096, 2, 4.0, 5.0, 15)], [], tau=4.0))
    assert rows[0]["derived_tok_s"] == pytest.approx(2000.0) and rows[0]["public_tau"] == 4.0
    assert side_by_side({"config": {}, "sections": {"spec": [_spec(1, 1, 1.0, 1.0, 15)]}})[0][
        "public_tau"] == PUBLIC_TAU


def test_no_spec_section_no_table() -> None:
    assert side_by_side_markdown({"config": {}, "sections": {"e2e": [_e2e(1, "flash", 1.0)]}}) == []


def test_a_tiny_run_reports_its_steps_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU run of the spec and e2e sections with every draft verified (B - 1 = 7 on the tiny
    pair): the table's row is the run's own figures, and ``--public-tau`` sets the rate."""
    monkeypatch.setenv("BLOCKDRAFT_DRAFT_LENGTH", "7")
    out = tmp_path / "b"
    rc = cli_main(["bench", "--shape", "tiny", "--contexts", "16", "--batches", "1", "--reps", "2",
                   "--warmup", "1", "--e2e-steps", "2", "--sections", "spec,e2e", "--public-tau", "3",
                   "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["errors"] == {}
    (spec,) = result["sections"]["spec"]
    assert spec["draft_length"] == 7
    (row,) = side_by_side(result)
    assert row["derived_tok_s"] == pytest.approx(3 / spec["step_ms"]["median"] * 1e3)
    assert row["reference_ms"] == result["sections"]["e2e"][0]["reference"]["ms_per_step"]
    md = (out / "bench.md").read_text()
    assert "## Side by side" in md and "tok/s at tau 3.00 (derived)" in md


@pytest.mark.parametrize("tau", [0.5, float("nan")])
def test_public_tau_below_one_is_refused(tau: float) -> None:
    with pytest.raises(ValueError, match="public tau"):
        resolve(BenchConfig(public_tau=tau))


def test_max_seq_len_sizes_the_spec_engines(tmp_path: Path) -> None:
    """``--max-seq-len``: the spec section's engines take sequences that long (a server's
    tables); without it, each cell's context and steps (warm-up, then the reps one by one,
    back to back and host work alone, and 4 more, each up to a block of 8 tokens)."""
    for extra, want in (([], 16 + (1 + 3 * 2 + 4) * 8 + 8), (["--max-seq-len", "400"], 400)):
        out = tmp_path / f"b{len(extra)}"
        rc = cli_main(["bench", "--shape", "tiny", "--contexts", "16", "--batches", "1", "--reps", "2",
                       "--warmup", "1", "--sections", "spec", "--out", str(out), *extra])
        assert rc == 0
        (spec,) = json.loads((out / "bench.json").read_text())["sections"]["spec"]
        assert spec["max_seq_len"] == want
        assert spec["run_ms"]["median"] > 0  # the steps back to back
