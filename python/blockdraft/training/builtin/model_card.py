"""MODEL_CARD.md of a built pair, written from its build report (``build_report.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _metrics(m: dict[str, Any]) -> str:
    return (f"loss {m['loss']:.3f} nats/token (perplexity {m['perplexity']:.2f}), next-token accuracy "
            f"{100 * m['accuracy']:.1f} %, {m['bits_per_char']:.3f} bits/character")


def _corpus_lines(c: dict[str, Any]) -> list[str]:
    names = ", ".join(" ".join(filter(None, (x["distribution"], x["version"]))) + f" ({x['licence']})"
                      for x in c.get("licences", []))
    return [
        "## Data",
        f"- Python source: the build interpreter's standard library, then {c.get('site', 'site-packages')}; "
        f"{c['files']} files after de-duplication by content, {c['chars'] / 1e6:.1f} M characters.",
        "- Only permissively licensed source (licence read from each distribution's metadata, "
        "`blockdraft.training.builtin.licences`). Distributions and licences: " + (names or "none") + ".",
        f"- Held out by content hash (whole files): {c['heldout_files']} files ({c['heldout_tokens']} tokens); "
        f"training: {c['train_files']} files, {c['train_tokens'] / 1e6:.2f} M tokens.",
        f"- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {c['vocab']}, trained on "
        f"{c['tokenizer_chars'] / 1e6:.1f} M characters; `<|endoftext|>` = eos, `<|mask|>` = the drafters' MASK.",
        "",
    ]


def _target_lines(report: dict[str, Any]) -> list[str]:
    tg = report["target"]
    lines = ["## Target (`target/`)"]
    if "config" in tg:
        cfg = tg["config"]
        lines.append(
            f"- Qwen3 architecture, {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads "
            f"({cfg['kv_heads']} K/V), MLP {cfg['intermediate']}, tied embeddings: {tg['params'] / 1e6:.2f} M "
            f"parameters{_size(tg)}.")
    if "steps" in tg:
        lines.append(
            f"- Trained {tg['steps']} steps ({tg['tokens_seen'] / 1e6:.1f} M tokens seen) in {tg['seconds']:.0f} s "
            f"({tg['s_per_1m_tokens']:.2f} s per 1M tokens); final train loss {tg['final_loss']:.3f}.")
    tuning = tg.get("tuning")
    if tuning:
        cfg = tuning["config"]
        before = tuning["before"]
        lines.append(
            f"- Then fine-tuned {tuning['steps']} steps in {tuning['seconds']:.0f} s"
            + (f" on {tuning['device']}" if tuning.get("device") else "")
            + " with the sequence-level unlikelihood objective (`blockdraft.training.builtin.unlikelihood`: "
            f"tokens that complete a repeated {cfg['ngram']}-gram of its own greedy continuations are negatives, "
            f"weight {cfg['ul_weight']:g}, beside the next-token loss{_tuning_terms(cfg)}). Before "
            f"it, on the held-out files: {_metrics(before['heldout'])}; greedy continuations "
            f"({cfg['new_tokens']} tokens): mean distinct 4-gram ratio {_loops(before['distinct_4gram'])}.")
    if "heldout" in tg:
        lines.append(f"- Held-out files: {_metrics(tg['heldout'])}.")
    if "distinct_4gram" in tg:
        lines.append(f"- Greedy continuations: mean distinct 4-gram ratio {_loops(tg['distinct_4gram'])}.")
    other = report.get("compare_target")
    if other:
        lines.append(f"- The earlier built-in target ({other['params'] / 1e6:.2f} M parameters, its own tokenizer) "
                     f"on the same held-out files: {_metrics(other)}.")
    if "reused_from" in tg:
        lines.append(f"- Reused from an earlier build ({tg['reused_from']}).")
    return lines + [""]


def _tuning_terms(cfg: dict[str, Any]) -> str:
    """The tuning's optional terms, as a clause of the model card's sentence."""
    terms = []
    if cfg.get("own_weight"):
        terms.append(f"the cross-entropy of the continuations' other tokens, its own greedy choices, weight "
                     f"{cfg['own_weight']:g}")
    if cfg.get("kl_weight"):
        terms.append(f"KL to the untuned target on the corpus windows, weight {cfg['kl_weight']:g}")
    return "".join(f"; {t}" for t in terms)


def _size(entry: dict[str, Any]) -> str:
    """The size clause of a target's or drafter's line; empty where the report has no size (``mb``),
    as for a directory whose weights were not measured."""
    return f", {entry['mb']:.1f} MB in bf16" if entry.get("mb") is not None else ""


def _loops(d: dict[str, float]) -> str:
    return f"{d['heldout']:.2f} on the held-out prompts, {d['default_prompt']:.2f} on the default prompt"


def _rollout_lines(report: dict[str, Any]) -> list[str]:
    rollouts = report.get("rollouts", {})
    if not rollouts:
        return []
    lines = ["## Drafter training data (`blockdraft.training.rollouts`)"]
    for kind, r in rollouts.items():
        how = "greedy" if kind == "greedy" else "sampled at T = 1"
        lines.append(f"- {kind}: {r['num']} continuations by the target ({how}), each {r['prompt_len']} corpus "
                     f"tokens then {r['new_tokens']} of the target's; {r['tokens'] / 1e6:.2f} M tokens in "
                     f"{r['seconds']:.0f} s.")
    return lines + [""]


def _drafter_lines(name: str, d: dict[str, Any]) -> list[str]:
    if "skipped" in d:
        return [f"- `drafter-{name}`: not trained ({d['skipped']})."]
    cfg = d.get("train_config", {})
    extra = ""
    if cfg.get("dflash2"):
        extra += ", " + ", ".join(f"{k} {v}" for k, v in cfg["dflash2"].items())
    if cfg.get("distill_weight"):
        extra += f", distillation weight {cfg['distill_weight']:g}"
    if d.get("data"):
        extra += ", trained on " + " + ".join(d["data"])
    if cfg.get("init_from"):
        extra += f", continued from {cfg['init_from']}"
    lines = [
        f"- `drafter-{name}/`: {d.get('architecture', 'DFlash')}, B = {d['block_size']}, {d['layers']} layers, "
        f"target layers {d['target_layer_ids']}{extra}{_size(d)}; {d['steps']} steps in "
        f"{d['seconds']:.0f} s ({d['s_per_1m_context_tokens']:.2f} s per 1M context tokens), final loss "
        f"{d['final_loss']:.3f}."
    ]
    evals = [d[k] for k in sorted(d) if k.startswith("eval")]
    if not evals:
        return lines + ["  Not measured (built with --skip-eval)."]
    for ev in evals:
        lines += _eval_lines(ev)
    return lines


def _eval_lines(ev: dict[str, Any]) -> list[str]:
    if "tau" not in ev:
        return [f"  Evaluation failed: {ev}"]
    taus = ", ".join(f"{k.replace(' sampled', ' (sampled drafts)')} tau = {v:.2f}" for k, v in ev["tau"].items())
    identical = "" if ev.get("identical") is None else (
        f"; output identical to target-only decoding on {ev['identical']}/{ev['num_prompts']} prompts")
    # Rates timed here (one round per path) stay in build_report.json: the card's speed figures are
    # the warmed-up benchmark's, which the "Speed" paragraph points to.
    return [f"  Held-out ({ev['num_prompts']} prompts x {ev['max_new_tokens']} new tokens, {ev['device']}, "
            f"{ev['dtype']}, backend {ev['backend']}): {taus}; distinct 4-gram ratio of the greedy "
            f"continuations {ev['distinct_4gram']:.2f}{identical}.",
            *_default_prompt_lines(ev)]


def _default_prompt_lines(ev: dict[str, Any]) -> list[str]:
    default = ev.get("default_prompt")
    if not default:
        return []
    return [f"  Default prompt `{default['prompt']}`: tau {default['tau']:.2f}, distinct 4-gram ratio "
            f"{default['distinct_4gram']:.2f}."]


def _made_lines(report: dict[str, Any]) -> list[str]:
    """Where the pair was made: the build's own machine, or each machine of ``report["machines"]`` and
    what it made, for a pair put together from builds on several."""
    machines = report.get("machines")
    if not machines:
        return [
            f"Made from scratch, offline, on {report['device_name']} ({report['device']}), Python "
            f"{report['python']}, torch {report['torch']}" + (" (see \"How it was made\")." if report.get("notes") else
                                                             f", by `{report['command']}` in "
                                                             f"{report['total_seconds']:.0f} s."),
            "",
        ]
    count = _COUNTS.get(len(machines), str(len(machines)))
    return [
        f"Made from scratch, offline, on {count} machines (see \"How it was made\"): "
        + "; ".join(f"{m['name']} ({m['setup']}) {m['made']}" for m in machines) + ".",
        "",
    ]


_COUNTS = {2: "two", 3: "three", 4: "four"}


def _speed_lines(report: dict[str, Any]) -> list[str]:
    """Where the pair's speed is measured; the evaluation's one-round rates stay in the report."""
    timed = any(k.startswith("eval") and isinstance(ev, dict) and ev.get("tokens_per_s")
                for d in report.get("drafters", {}).values() for k, ev in d.items())
    if not timed:
        return []
    speed = report.get("speed")
    where = (f"{speed['where']} ({speed['how']})" if speed else
             "`benchmarks/builtin_pair.py` (every path warmed up) once the pair is installed as "
             "`python/blockdraft/pretrained`")
    return [f"Speed: {where}. The evaluation below times one round per path; its rates are in "
            "`build_report.json`.", ""]


def write_model_card(pair: Path, report: dict[str, Any]) -> None:
    """``pair/MODEL_CARD.md`` from ``report``."""
    lines = [
        "# blockdraft built-in pair: a small Python code model and its DFlash drafters",
        "",
        *_made_lines(report),
        *_speed_lines(report),
        *_corpus_lines(report["corpus"]),
        *_target_lines(report),
        *_rollout_lines(report),
        "## Drafters",
    ]
    for name, d in report.get("drafters", {}).items():
        lines += _drafter_lines(name, d)
    notes = report.get("notes", [])
    if notes:
        lines += ["", "## How it was made", "", *notes]
    lines += [
        "",
        "Full numbers: `build_report.json`. Held-out prompts (token ids and text): `heldout_prompts.json`.",
        "Training recipe: see `docs/training.md` in the repository.",
        "",
    ]
    (pair / "MODEL_CARD.md").write_text("\n".join(lines), encoding="utf-8")


__all__ = ["write_model_card"]
