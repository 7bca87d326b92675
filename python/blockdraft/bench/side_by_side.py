"""One table of a run's speculative steps beside target-only decoding on the same runtime and
beside the public reference, with tokens per second at a given acceptance derived from them.

Nothing here is measured: the table is built from the ``spec`` section (the engine's step and
the same sequences' target-only decode step, on blockdraft's runtime) and the ``e2e`` section
(the public reference ``dflash_generate`` at batch 1, ms per step) of one run, so every figure in
a row comes from the same process, pair and machine.

A random pair accepts nothing (τ = 1), so its steps cost what a step of a trained pair costs
when every draft is verified, which is what a fixed ``B - 1`` drafts per step gives
(``BLOCKDRAFT_DRAFT_LENGTH=15`` at B = 16). At the τ of a trained pair (:data:`PUBLIC_TAU`:
6.5 tokens per step at B = 16 for the public Qwen3-8B checkpoint on code) a step would emit
``τ`` tokens per sequence, so tokens/s = ``batch × τ / step``: derived, not measured, and only
from steps that drafted ``B - 1`` every time (an adaptive draft length drafts less at τ = 1, so
its steps would overstate a trained pair's rate). A step that accepts more also commits more
ctx rows to the drafter, which the derived figure leaves out.
"""

from __future__ import annotations

from typing import Any

from blockdraft.bench.figures import fmt

PUBLIC_TAU = 6.5
"""Mean tokens per speculative step of the public Qwen3-8B DFlash checkpoint at B = 16 on code
(the figure its authors report); the default of ``blockdraft bench --public-tau``."""


def _reference_ms(e2e: list[dict[str, Any]], context: int) -> float | None:
    """The reference's ms per step at ``context`` (the flash SDPA run when there is one)."""
    runs = [r for r in e2e if r["context"] == context and r.get("reference")]
    runs.sort(key=lambda r: r.get("backend") != "flash")
    return float(runs[0]["reference"]["ms_per_step"]) if runs else None


def side_by_side(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per ``spec`` cell of ``result`` (a ``blockdraft bench`` result): the step, the
    target-only decode step, the reference's step at batch 1, their ratios, and tokens/s at the
    run's public τ (``config["public_tau"]``); derived rates are ``None`` where the cell did
    not draft ``B - 1`` every step."""
    sec = result["sections"]
    tau = float(result["config"].get("public_tau", PUBLIC_TAU))
    e2e = sec.get("e2e") or []
    rows = []
    for r in sec.get("spec") or []:
        n, step, decode = r["batch"], r["step_ms"]["median"], r["decode_ms"]["median"]
        full = r.get("draft_length") == r["block"] - 1
        ref = _reference_ms(e2e, r["context"]) if n == 1 else None
        rows.append({
            "context": r["context"], "batch": n, "ctx_cap": r.get("ctx_cap"),
            "draft_length": r.get("draft_length"),
            "step_ms": step, "decode_ms": decode, "step_over_decode": step / decode,
            "reference_ms": ref, "reference_over_step": ref / step if ref else None,
            "public_tau": tau,
            "derived_tok_s": n * tau / step * 1e3 if full else None,
            "decode_tok_s": n / decode * 1e3,
            "reference_derived_tok_s": tau / ref * 1e3 if ref and full else None,
        })
    return rows


def side_by_side_markdown(result: dict[str, Any]) -> list[str]:
    """The :func:`side_by_side` rows as a markdown section (nothing without a ``spec`` section)."""
    rows = side_by_side(result)
    if not rows:
        return []
    tau = fmt(rows[0]["public_tau"], 2)
    lines = [
        "## Side by side (one run: ms per step, and tokens/s derived at a trained pair's tau)",
        "",
        f"Derived columns: batch x {tau} tokens / step time, only for cells that drafted B - 1 "
        "every step (a random pair accepts nothing, so its step is a trained pair's step that "
        "verifies every draft); not measured. The reference runs at batch 1 only.",
        "",
        "| context | batch | drafts per step | step ms | target-only decode ms | step / decode "
        f"| reference ms | reference / step | tok/s at tau {tau} (derived) "
        f"| target-only tok/s | reference tok/s at tau {tau} (derived) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['draft_length'] if r['draft_length'] is not None else '—'} "
            f"| {fmt(r['step_ms'])} | {fmt(r['decode_ms'])} | {fmt(r['step_over_decode'], 2)} "
            f"| {fmt(r['reference_ms'], 2)} | {fmt(r['reference_over_step'], 1)} "
            f"| {fmt(r['derived_tok_s'], 0)} | {fmt(r['decode_tok_s'], 0)} "
            f"| {fmt(r['reference_derived_tok_s'], 0)} |"
        )
    return [*lines, ""]


__all__ = ["PUBLIC_TAU", "side_by_side", "side_by_side_markdown"]
