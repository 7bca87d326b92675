"""Make the built-in trained target + drafter pair from scratch, offline.

    python -m blockdraft.training.builtin.corpus_site SITE            # once, with network: the corpus packages
    python -m blockdraft.training.builtin.make_builtin_pair --preset h200 --corpus-site SITE --out DIR
    python -m blockdraft.training.builtin.make_builtin_pair --preset tiny --out DIR   # CPU smoke run

Steps: collect Python source (the interpreter's standard library, then the permissively
licensed packages under ``--corpus-site``, default the interpreter's own site-packages),
deduplicated, holding out whole files (by content hash) for evaluation; train a byte-level BPE
tokenizer; train a small Qwen3 causal LM from scratch (the target), tune it against greedy
loops (:mod:`blockdraft.training.builtin.unlikelihood`) and measure it on the held-out files
(:mod:`blockdraft.training.builtin.target`); let it write the rollouts its drafters train on
(:mod:`blockdraft.training.rollouts`); train the drafters (``--drafters``: DFlash or DFlash2, any
block sizes) with the recipe (:mod:`blockdraft.training.loop`), each with the same time
budget; measure tau on held-out prompts with the speculative engine; write everything (bf16)
with a model card under ``DIR/pair`` (the layout of ``blockdraft/pretrained``). Presets:
:mod:`blockdraft.training.builtin.presets`.

Stages run against one wall-clock deadline (``--deadline-s``) so a run on a rented GPU ends in
time: the target and each drafter get fixed time budgets (steps are fitted after a short
calibration and recorded); a drafter that no longer fits is skipped and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import platform
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

from blockdraft.devices import default_dtype, sync
from blockdraft.pretrained import DEFAULT_PROMPT
from blockdraft.training.builtin.model_card import write_model_card
from blockdraft.training.builtin.presets import PRESETS, DrafterSpec, Preset, rollout_kinds
from blockdraft.training.builtin.target import (
    Corpus,
    build_corpus,
    dir_mb,
    load_target,
    measure_other_target,
    train_and_save_target,
    tune_and_save_target,
)
from blockdraft.training.data import EOS_TOKEN, SourceFile
from blockdraft.training.evaluate import EvalReport, distinct_ngram_ratio, evaluate_drafter, heldout_metrics
from blockdraft.training.loop import DrafterTrainConfig, train_drafter
from blockdraft.training.rollouts import rollout_stream

log = logging.getLogger("blockdraft.make_builtin_pair")


def write_report(pair: Path, report: dict[str, Any]) -> None:
    """``pair/build_report.json``."""
    (pair / "build_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory (the pair goes to OUT/pair)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=0.0, help="wall-clock limit of the whole build (0: none)")
    ap.add_argument("--drafters", default=None,
                    help="drafters to train, e.g. 16,16:dflash2,8, or none (default: the preset's)")
    ap.add_argument("--corpus-site", type=Path, default=None,
                    help="site directory of the corpus packages (blockdraft.training.builtin.corpus_site); "
                         "default: the interpreter's own site-packages")
    ap.add_argument("--corpus-archive", type=Path, default=None,
                    help="a .tar.xz made by corpus_site --pack, unpacked under OUT/work and used as --corpus-site")
    ap.add_argument("--reuse-target", type=Path, default=None,
                    help="take the target and tokenizer from this directory instead of training them")
    ap.add_argument("--compare-target", type=Path, default=None,
                    help="another target directory (with its tokenizer) to measure on the same held-out files")
    ap.add_argument("--target-steps", type=int, default=0, help="fixed target steps (no time budget)")
    ap.add_argument("--target-budget-s", type=float, default=0.0, help="override the target's time budget")
    ap.add_argument("--compile-target", action="store_true",
                    help="train the target through torch.compile (eager if compiling fails)")
    ap.add_argument("--drafter-budget-s", type=float, default=0.0, help="override each drafter's time budget")
    ap.add_argument("--drafter-layers", type=int, default=0, metavar="L",
                    help="drafter layers (default: the preset's); with --init-drafters a deeper drafter "
                         "grows from the saved one (init_from_drafter)")
    ap.add_argument("--anchor-focus", type=float, default=-1.0, metavar="F",
                    help="the drafters' anchor focus (DrafterTrainConfig.anchor_focus; default: the preset's)")
    ap.add_argument("--drafter-steps", default="", help="fixed drafter steps by name, e.g. b8:4000,b16-dflash2:2861")
    ap.add_argument("--tune-steps", type=int, default=-1,
                    help="unlikelihood fine-tuning steps of the target (0: none; default: the preset's, "
                         "fitted to its time budget)")
    ap.add_argument("--tune-budget-s", type=float, default=0.0, help="override the tuning's time budget")
    ap.add_argument("--tune-kl-weight", type=float, default=-1.0, metavar="W",
                    help="weight of the tuning's KL term to the untuned target on corpus windows "
                         "(TuneConfig.kl_weight; default: the preset's)")
    ap.add_argument("--tune-own-weight", type=float, default=-1.0, metavar="W",
                    help="weight of the tuning's own-choice term, the cross-entropy of the target's greedy "
                         "continuations where they repeat nothing (TuneConfig.own_weight; default: the preset's)")
    ap.add_argument("--drafter-data", choices=("rollouts", "corpus"), default="rollouts",
                    help="train the drafters on the target's own rollouts (default, when the preset has "
                         "them) or on the corpus")
    ap.add_argument("--rollouts-from", type=Path, default=None, metavar="WORK",
                    help="an earlier build's work directory whose rollouts-*.pt to reuse")
    ap.add_argument("--rollouts", type=int, default=0, metavar="N",
                    help="rollouts per kind (default: the preset's)")
    ap.add_argument("--rollouts-only", action="store_true",
                    help="stop after the target and the drafters' rollouts (a later build takes them with "
                         "--reuse-target and --rollouts-from)")
    ap.add_argument("--init-drafters", default="", metavar="NAME=DIR,...",
                    help="start these drafters from saved ones (continued training), e.g. "
                         "b8=python/blockdraft/pretrained/drafter-b8")
    ap.add_argument("--skip-eval", action="store_true", help="train only; measure later with --evaluate")
    ap.add_argument("--evaluate", type=Path, default=None, metavar="PAIR",
                    help="measure the drafters of an existing pair directory (and rewrite its report and "
                         "model card) instead of building; --out takes the log")
    ap.add_argument("--eval-temperatures", default="0,1",
                    help="temperatures of the --evaluate run (0: greedy, with the target-only comparison)")
    ap.add_argument("--eval-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="dtype of the --evaluate run (auto: bf16 on CUDA, fp32 on the CPU)")
    args = ap.parse_args(argv)
    if args.corpus_site is not None and args.corpus_archive is not None:
        ap.error("give --corpus-site or --corpus-archive, not both")
    try:
        args.drafter_specs = [] if args.drafters == "none" else [
            DrafterSpec.parse(t) for t in (args.drafters or "").split(",") if t.strip()]
        args.fixed_steps = {k: int(v) for k, v in (kv.split(":") for kv in args.drafter_steps.split(",") if kv)}
        args.eval_temperatures = tuple(float(t) for t in args.eval_temperatures.split(",") if t.strip())
        args.init_drafters = {k.strip(): Path(v.strip()) for k, v in (
            kv.split("=") for kv in args.init_drafters.split(",") if kv.strip())}
    except ValueError as exc:
        ap.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # The build log goes to OUT/build.log as well, for the whole build only.
    file_log = logging.FileHandler(args.out / "build.log")
    file_log.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(file_log)
    level = root.level
    root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    try:
        if args.evaluate is not None:
            return evaluate_pair(args.evaluate, args.device, args.eval_dtype, args.eval_temperatures)
        return build(args, argv)
    finally:
        root.removeHandler(file_log)
        root.setLevel(level)
        file_log.close()


def build(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The build described in the module docstring, with parsed arguments."""
    start = time.perf_counter()
    out: Path = args.out
    p = PRESETS[args.preset]
    if args.target_steps > 0:
        p = dataclasses.replace(p, target_steps=args.target_steps, target_budget_s=0.0)
    elif args.target_budget_s > 0:
        p = dataclasses.replace(p, target_budget_s=args.target_budget_s)
    for key, value in (("kl_weight", args.tune_kl_weight), ("own_weight", args.tune_own_weight)):
        if value >= 0:
            p = dataclasses.replace(p, tune={**p.tune, key: value})
    if args.compile_target:
        p = dataclasses.replace(p, target_compile=True)
    if args.drafter_budget_s > 0:
        p = dataclasses.replace(p, drafter_budget_s=args.drafter_budget_s)
    if args.drafter_layers > 0:
        p = dataclasses.replace(p, drafter_layers=args.drafter_layers)
    if args.rollouts > 0 and p.rollout:
        p = dataclasses.replace(p, rollout={**p.rollout, "num": args.rollouts})
    specs = args.drafter_specs if args.drafters is not None else [DrafterSpec.parse(t) for t in p.drafters]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pair = out / "pair"
    work = out / "work"
    if pair.exists():
        shutil.rmtree(pair)
    pair.mkdir(parents=True)
    report: dict[str, Any] = {"preset": args.preset, "seed": args.seed, "device": str(device),
                              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
                              platform.processor() or platform.machine(),
                              "python": platform.python_version(), "torch": torch.__version__,
                              "command": "python -m blockdraft.training.builtin.make_builtin_pair " + " ".join(
                                  argv if argv is not None else sys.argv[1:])}

    def left() -> float:
        return math.inf if args.deadline_s <= 0 else args.deadline_s - (time.perf_counter() - start)

    site = args.corpus_site
    if args.corpus_archive is not None:
        site = work / "corpus_site"
        with tarfile.open(args.corpus_archive, "r:xz") as tar:
            tar.extractall(site, filter="data")
    corpus = build_corpus(p, site, args.reuse_target, report)
    write_report(pair, report)
    tokenizer, held_files = corpus.tokenizer, corpus.held_files

    # target
    target_dir = pair / "target"
    if args.reuse_target is not None:
        shutil.copytree(args.reuse_target, target_dir)
        earlier = args.reuse_target.parent / "build_report.json"
        report["target"] = {"reused_from": str(args.reuse_target)}
        if earlier.is_file():
            before = json.loads(earlier.read_text(encoding="utf-8"))
            report["target"].update(before.get("target", {}))
            if "compare_target" in before:
                report["compare_target"] = before["compare_target"]
        report["target"]["mb"] = dir_mb(target_dir)
    else:
        train_and_save_target(p, args.seed, corpus, device, target_dir, report)
    write_report(pair, report)
    if args.compare_target is not None:
        report["compare_target"] = measure_other_target(args.compare_target, held_files, p, device)
        write_report(pair, report)

    prompts = held_prompts(held_files, tokenizer, p)
    (pair / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n", encoding="utf-8")
    tune_steps = p.tune.get("steps", 0) if args.tune_steps < 0 else args.tune_steps
    if tune_steps > 0:
        budget = p.tune_budget_s if args.tune_budget_s <= 0 else args.tune_budget_s
        tune_and_save_target(dataclasses.replace(p, tune={**p.tune, "steps": tune_steps}, tune_budget_s=budget),
                             args.seed, corpus, device, target_dir, prompts, report)
        write_report(pair, report)
    elif args.reuse_target is not None:
        # A reused target is measured on this build's held-out files, as it is shipped (fp32).
        report["target"]["heldout"] = heldout_metrics(load_target(target_dir, device, torch.float32),
                                                      corpus.held_stream, corpus.held_chars, seq_len=p.target_seq_len)
        write_report(pair, report)

    target = load_target(target_dir, device, default_dtype(device))
    streams = drafter_streams(target, corpus, p, specs if args.drafter_data == "rollouts" else [], work,
                              args.rollouts_from, args.seed, report)
    write_report(pair, report)
    if args.rollouts_only:
        report["total_seconds"] = time.perf_counter() - start
        write_report(pair, report)
        log.info("target and rollouts written to %s and %s in %.0f s", pair, work, report["total_seconds"])
        return 0

    # drafters: each gets the same time budget (a fair comparison), time allowing
    report["drafters"] = {}
    reserve = 45.0 if device.type == "cuda" and not args.skip_eval else 5.0
    for spec in specs:
        budget = p.drafter_budget_s
        if budget > 0 and args.deadline_s > 0 and left() - reserve < budget:
            budget = left() - reserve
            if budget < 30:
                log.info("skipping drafter %s: %.0f s left", spec.name, left())
                report["drafters"][spec.name] = {"skipped": f"{left():.0f} s left before the deadline"}
                continue
        settings = {**p.drafter, **p.per_block.get(spec.block, {})}
        if args.anchor_focus >= 0:
            settings["anchor_focus"] = args.anchor_focus
        if spec.name in args.fixed_steps:
            settings["steps"], budget = args.fixed_steps[spec.name], 0.0
        if spec.name in args.init_drafters:
            settings["init_from"], settings["init_from_target"] = str(args.init_drafters[spec.name]), False
        cfg = DrafterTrainConfig(num_layers=p.drafter_layers, block_size=spec.block, mask_token_id=corpus.mask_id,
                                 target_layer_ids=list(p.target_layer_ids), time_budget_s=budget,
                                 seed=args.seed, dflash2=dict(p.dflash2) if spec.dflash2 else None, **settings)
        kinds = rollout_kinds(p, spec) if streams else []
        stream = torch.cat([streams[k] for k in kinds]) if kinds else corpus.stream
        res = train_drafter(target, stream, cfg, work / f"drafter-{spec.name}")
        dest = pair / f"drafter-{spec.name}"
        shutil.copytree(res.drafter_dir, dest)
        entry: dict[str, Any] = {
            "architecture": "DFlash2" if spec.dflash2 else "DFlash",
            "block_size": spec.block, "layers": p.drafter_layers, "target_layer_ids": p.target_layer_ids,
            "steps": res.steps, "seconds": res.seconds, "context_tokens": res.context_tokens,
            "s_per_1m_context_tokens": res.seconds / max(1, res.context_tokens) * 1e6,
            "final_loss": res.final_loss, "train_tau_estimate": res.final_tau, "mb": dir_mb(dest),
            "data": [f"{k} rollouts" for k in kinds] or ["corpus"],
            "train_config": dataclasses.asdict(cfg),
        }
        report["drafters"][spec.name] = entry
        write_report(pair, report)
        if not args.skip_eval:
            entry["eval"] = run_eval(target, dest, prompts, p, tokenizer, corpus.eos_id)
            write_report(pair, report)
    report["total_seconds"] = time.perf_counter() - start
    write_report(pair, report)
    write_model_card(pair, report)
    log.info("pair written to %s (%.1f MB) in %.0f s", pair, dir_mb(pair), report["total_seconds"])
    return 0


def evaluate_pair(pair: Path, device_name: str | None, dtype: str = "auto",
                  temperatures: tuple[float, ...] = (0.0, 1.0)) -> int:
    """Measure every drafter of a built pair (:func:`run_eval`) and rewrite its report and card.

    The measurements go to each drafter's ``eval`` entry; a run in another dtype or on another
    device than the build's also goes to ``eval_<device type>_<dtype>`` so both are kept.
    """
    from transformers import AutoTokenizer

    report = json.loads((pair / "build_report.json").read_text(encoding="utf-8"))
    p = PRESETS[report["preset"]]
    prompts = json.loads((pair / "heldout_prompts.json").read_text(encoding="utf-8"))
    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer: Any = AutoTokenizer.from_pretrained(pair / "target")
    auto = default_dtype(device)
    run_dtype = auto if dtype == "auto" else getattr(torch, dtype)
    target = load_target(pair / "target", device, run_dtype)
    eos_id = int(tokenizer.convert_tokens_to_ids(EOS_TOKEN))
    key = "eval" if run_dtype == auto and device.type == torch.device(report["device"]).type else (
        f"eval_{device.type}_{str(run_dtype).removeprefix('torch.')}")
    t0 = time.perf_counter()
    for name, entry in report.get("drafters", {}).items():
        if "skipped" not in entry and (pair / f"drafter-{name}").is_dir():
            entry[key] = run_eval(target, pair / f"drafter-{name}", prompts, p, tokenizer, eos_id, temperatures)
            write_report(pair, report)
    report["eval_seconds"] = time.perf_counter() - t0
    write_report(pair, report)
    write_model_card(pair, report)
    return 0


def drafter_streams(target: Any, corpus: Corpus, p: Preset, specs: list[DrafterSpec], work: Path,
                    reuse: Path | None, seed: int, report: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The rollout streams the ``specs`` train on (:func:`~blockdraft.training.rollouts.rollout_stream`),
    each written once and saved as ``work/rollouts-KIND.pt``; taken from ``reuse`` (an earlier
    build's work directory) when it holds them."""
    streams: dict[str, torch.Tensor] = {}
    work.mkdir(parents=True, exist_ok=True)
    for kind in sorted({k for spec in specs for k in rollout_kinds(p, spec)}):
        name = f"rollouts-{kind}.pt"
        about = work / f"rollouts-{kind}.json"
        if reuse is not None and (reuse / name).is_file():
            streams[kind] = torch.load(reuse / name, weights_only=True)
            log.info("%s rollouts: %d tokens from %s", kind, streams[kind].numel(), reuse / name)
            if (reuse / about.name).is_file():
                report.setdefault("rollouts", {})[kind] = json.loads((reuse / about.name).read_text(encoding="utf-8"))
            continue
        if kind not in ("greedy", "sampled"):
            raise ValueError(f"unknown rollout kind {kind!r} (greedy or sampled)")
        t = time.perf_counter()
        streams[kind] = rollout_stream(target, corpus.stream, corpus.eos_id,
                                       temperature=1.0 if kind == "sampled" else 0.0,
                                       seed=seed + (1 if kind == "sampled" else 0), **p.rollout)
        sync(next(target.parameters()).device)
        seconds = time.perf_counter() - t
        torch.save(streams[kind], work / name)
        report.setdefault("rollouts", {})[kind] = {**p.rollout, "tokens": int(streams[kind].numel()),
                                                   "seconds": seconds}
        about.write_text(json.dumps(report["rollouts"][kind]) + "\n", encoding="utf-8")
        log.info("%s rollouts: %d tokens in %.0f s", kind, streams[kind].numel(), seconds)
    return streams


def held_prompts(held: list[SourceFile], tokenizer: Any, p: Preset) -> dict[str, Any]:
    """Prompts from held-out files: the first tokens of files long enough to continue."""
    prompts = []
    for f in held:
        ids = list(tokenizer(f.text, add_special_tokens=False)["input_ids"])
        if len(ids) >= p.eval_prompt_tokens + p.eval_new_tokens:
            prompts.append({"file": f.path, "sha256": f.digest, "ids": ids[: p.eval_prompt_tokens],
                            "text": tokenizer.decode(ids[: p.eval_prompt_tokens])})
        if len(prompts) == p.eval_prompts:
            break
    return {"prompt_tokens": p.eval_prompt_tokens, "new_tokens": p.eval_new_tokens, "prompts": prompts}


def run_eval(target: Any, drafter_dir: Path, prompts: dict[str, Any], p: Preset, tokenizer: Any,
             eos_id: int, temperatures: tuple[float, ...] = (0.0, 1.0)) -> dict[str, Any]:
    """tau greedy / T=1 (argmax and sampled drafts), the loop check, the speed comparison, and
    the default prompt's continuation; the torch backend if the default one fails."""
    from blockdraft.checkpoint import load_drafter
    from blockdraft.engine.generate import generate

    device = next(target.parameters()).device
    drafter = load_drafter(drafter_dir, device=device, dtype=next(target.parameters()).dtype)
    ids = [q["ids"] for q in prompts["prompts"]]
    result: dict[str, Any] = {}
    for backend in ("auto", "torch"):
        try:
            rep: EvalReport = evaluate_drafter(target, drafter, ids, max_new_tokens=p.eval_new_tokens,
                                               stop_token_ids=[eos_id], backend=backend, sampled_drafts=True,
                                               temperatures=temperatures)
        except Exception as exc:  # noqa: BLE001 - recorded, then the plain-torch backend is tried
            log.exception("evaluation with backend %s failed", backend)
            result[f"error_{backend}"] = f"{type(exc).__name__}: {exc}"
            continue
        result.update(dataclasses.asdict(rep))
        result["backend"] = backend
        for line in rep.lines():
            log.info("%s", line)
        break
    prompt = list(tokenizer(DEFAULT_PROMPT, add_special_tokens=False)["input_ids"])
    res = generate(target, drafter, [prompt], max_new_tokens=p.eval_new_tokens, stop_token_ids=[eos_id],
                   draft_length=int(drafter.config.block_size) - 1)
    result["default_prompt"] = {"prompt": DEFAULT_PROMPT, "text": tokenizer.decode(prompt + res.tokens[0]),
                                "distinct_4gram": distinct_ngram_ratio(res.tokens[0]),
                                "tau": res.stats.mean_tau}
    return result


if __name__ == "__main__":
    sys.exit(main())
