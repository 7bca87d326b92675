"""Make the built-in trained target + drafter pair from scratch, offline.

    python -m blockdraft.training.corpus_site SITE            # once, with network: the corpus packages
    python -m blockdraft.training.make_builtin_pair --preset h200 --corpus-site SITE --out DIR
    python -m blockdraft.training.make_builtin_pair --preset tiny --out DIR   # CPU smoke run

Steps: collect Python source (the interpreter's standard library, then the permissively
licensed packages under ``--corpus-site``, default the interpreter's own site-packages),
deduplicated, holding out whole files (by content hash) for evaluation; train a byte-level BPE
tokenizer; train a small Qwen3 causal LM from scratch (the target) and measure it on the
held-out files; train the drafters (``--drafters``: DFlash or DFlash2, any block sizes) against
it with the recipe (:mod:`blockdraft.training.recipe`), each with the same time budget; measure
tau on held-out prompts with the speculative engine; write everything (bf16) with a model card
under ``DIR/pair`` (the layout of ``blockdraft/pretrained``).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockdraft.devices import default_dtype, sync
from blockdraft.training.data import (
    EOS_TOKEN,
    MASK_TOKEN,
    SourceFile,
    encode_stream,
    sample_windows,
    split_heldout,
    step_generator,
    train_bpe_tokenizer,
)
from blockdraft.pretrained import DEFAULT_PROMPT
from blockdraft.training.evaluate import EvalReport, distinct_ngram_ratio, evaluate_drafter, heldout_metrics
from blockdraft.training.licences import permissive_python_sources
from blockdraft.training.model_card import write_model_card
from blockdraft.training.recipe import BudgetCalibrator, DrafterTrainConfig, train_drafter

log = logging.getLogger("blockdraft.make_builtin_pair")


@dataclass
class Preset:
    """Sizes and budgets of one build."""

    corpus_chars: int
    tokenizer_chars: int
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    target_seq_len: int
    target_batch: int
    target_steps: int
    target_lr: float
    target_budget_s: float
    drafter_layers: int
    target_layer_ids: list[int]
    drafter: dict[str, Any]
    drafter_budget_s: float
    drafters: list[str]
    eval_prompts: int
    eval_prompt_tokens: int
    eval_new_tokens: int
    heldout_every: int = 40
    test_prompts: int = 4
    per_block: dict[int, dict[str, Any]] = field(default_factory=dict)
    dflash2: dict[str, int] = field(default_factory=lambda: dict(
        conv_kernel_size=3, conv_group_size=32, selector_rank=32, selector_top_k=8))


PRESETS: dict[str, Preset] = {
    "h200": Preset(
        corpus_chars=150_000_000, tokenizer_chars=10_000_000, vocab=8192,
        hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1152, max_positions=2048,
        target_seq_len=512, target_batch=96, target_steps=20000, target_lr=1.5e-3, target_budget_s=270,
        drafter_layers=2, target_layer_ids=[1, 4, 6],
        drafter=dict(seq_len=512, num_seqs=32, num_anchors=64, steps=20000, lr=1e-3, warmup_steps=100,
                     log_every=100, init_from_target=True),
        per_block={8: dict(num_seqs=64, num_anchors=128, distill_weight=0.5)},
        drafter_budget_s=100, drafters=["16", "16:dflash2", "8"],
        eval_prompts=16, eval_prompt_tokens=64, eval_new_tokens=128,
    ),
    "tiny": Preset(
        corpus_chars=400_000, tokenizer_chars=200_000, vocab=512,
        hidden=64, layers=3, heads=4, kv_heads=2, intermediate=128, max_positions=512,
        target_seq_len=64, target_batch=8, target_steps=40, target_lr=3e-3, target_budget_s=0,
        drafter_layers=1, target_layer_ids=[0, 2],
        drafter=dict(seq_len=64, num_seqs=4, num_anchors=8, steps=20, lr=1e-3, warmup_steps=5, log_every=10,
                     init_from_target=True),
        per_block={8: dict(distill_weight=0.5)},
        drafter_budget_s=0, drafters=["8", "16:dflash2"],
        eval_prompts=3, eval_prompt_tokens=16, eval_new_tokens=24, test_prompts=3, heldout_every=4,
        dflash2=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4),
    ),
}


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter to train: ``"16"`` (DFlash, B = 16) or ``"16:dflash2"``."""

    block: int
    dflash2: bool

    @property
    def name(self) -> str:
        return f"b{self.block}" + ("-dflash2" if self.dflash2 else "")

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        """``B`` or ``B:dflash2``.

        Raises:
            ValueError: anything else.
        """
        block, _, kind = text.strip().partition(":")
        if not block.isdigit() or int(block) < 2 or kind not in ("", "dflash", "dflash2"):
            raise ValueError(f"drafter {text!r}: expected B or B:dflash2 with B >= 2")
        return cls(int(block), kind == "dflash2")


def build_target(p: Preset, eos_id: int, seed: int) -> Any:
    """A fresh Qwen3 causal LM (fp32, CPU, tied embeddings) of the preset's shape."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=p.vocab, hidden_size=p.hidden, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, head_dim=p.hidden // p.heads,
        intermediate_size=p.intermediate, max_position_embeddings=p.max_positions,
        tie_word_embeddings=True, eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)  # type: ignore[no-untyped-call]


def train_target(model: Any, stream: torch.Tensor, p: Preset, device: torch.device, seed: int) -> dict[str, Any]:
    """Next-token training of ``model`` on windows of ``stream`` (AdamW, warm-up + cosine)."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    model.to(device).train()
    decay = [q for q in model.parameters() if q.dim() > 1]
    rest = [q for q in model.parameters() if q.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=p.target_lr, betas=(0.9, 0.95))
    total, warmup = p.target_steps, min(100, p.target_steps // 10 + 1)
    use_amp = device.type == "cuda"
    t0 = time.perf_counter()
    calibrator = BudgetCalibrator(p.target_budget_s, 20, device, t0)
    settled = p.target_budget_s <= 0
    step, loss_v = 0, float("nan")
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc="target")
    while step < total:
        lr = p.target_lr * (step + 1) / warmup if step < warmup else p.target_lr * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))))
        for g in opt.param_groups:
            g["lr"] = lr
        tokens = sample_windows(stream, p.target_batch, p.target_seq_len, step_generator(seed, step)).to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=use_amp):
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        if step % 50 == 0 or step == total:
            loss_v = float(loss.detach())
            bar.set_postfix(loss=f"{loss_v:.3f}")
        if not settled:
            total, settled = calibrator.check(step, step, total)
            bar.total = total
    bar.close()
    sync(device)
    seconds = time.perf_counter() - t0
    tokens_seen = step * p.target_batch * p.target_seq_len
    model.eval()
    return {"steps": step, "seconds": seconds, "tokens_seen": tokens_seen, "final_loss": loss_v,
            "s_per_1m_tokens": seconds / tokens_seen * 1e6}


def load_target(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """A saved causal LM in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def write_report(pair: Path, report: dict[str, Any]) -> None:
    """``pair/build_report.json``."""
    (pair / "build_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


def _params(module: Any) -> int:
    return sum(q.numel() for q in module.parameters())


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory (the pair goes to OUT/pair)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=0.0, help="wall-clock limit of the whole build (0: none)")
    ap.add_argument("--drafters", default=None,
                    help="drafters to train, e.g. 16,16:dflash2,8 (default: the preset's)")
    ap.add_argument("--corpus-site", type=Path, default=None,
                    help="site directory of the corpus packages (blockdraft.training.corpus_site); "
                         "default: the interpreter's own site-packages")
    ap.add_argument("--corpus-archive", type=Path, default=None,
                    help="a .tar.xz made by corpus_site --pack, unpacked under OUT/work and used as --corpus-site")
    ap.add_argument("--reuse-target", type=Path, default=None,
                    help="take the target and tokenizer from this directory instead of training them")
    ap.add_argument("--compare-target", type=Path, default=None,
                    help="another target directory (with its tokenizer) to measure on the same held-out files")
    ap.add_argument("--target-steps", type=int, default=0, help="fixed target steps (no time budget)")
    ap.add_argument("--target-budget-s", type=float, default=0.0, help="override the target's time budget")
    ap.add_argument("--drafter-budget-s", type=float, default=0.0, help="override each drafter's time budget")
    ap.add_argument("--drafter-steps", default="", help="fixed drafter steps by name, e.g. b8:4000,b16-dflash2:2861")
    ap.add_argument("--skip-eval", action="store_true", help="train only; measure later with --evaluate")
    ap.add_argument("--evaluate", type=Path, default=None, metavar="PAIR",
                    help="measure the drafters of an existing pair directory (and rewrite its report and "
                         "model card) instead of building; --out takes the log")
    ap.add_argument("--eval-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="dtype of the --evaluate run (auto: bf16 on CUDA, fp32 on the CPU)")
    args = ap.parse_args(argv)
    if args.corpus_site is not None and args.corpus_archive is not None:
        ap.error("give --corpus-site or --corpus-archive, not both")
    try:
        args.drafter_specs = [DrafterSpec.parse(t) for t in (args.drafters or "").split(",") if t.strip()]
        args.fixed_steps = {k: int(v) for k, v in (kv.split(":") for kv in args.drafter_steps.split(",") if kv)}
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
            return evaluate_pair(args.evaluate, args.device, args.eval_dtype)
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
    if args.drafter_budget_s > 0:
        p = dataclasses.replace(p, drafter_budget_s=args.drafter_budget_s)
    specs = args.drafter_specs or [DrafterSpec.parse(t) for t in p.drafters]
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
                              "command": "python -m blockdraft.training.make_builtin_pair " + " ".join(
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

    # ---- target
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
    else:
        train_and_save_target(p, args.seed, corpus, device, target_dir, report)
    write_report(pair, report)
    if args.compare_target is not None:
        report["compare_target"] = measure_other_target(args.compare_target, held_files, p, device)
        write_report(pair, report)

    target = load_target(target_dir, device, default_dtype(device))

    prompts = held_prompts(held_files, tokenizer, p)
    (pair / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n", encoding="utf-8")

    # ---- drafters: each gets the same time budget (a fair comparison), time allowing
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
        if spec.name in args.fixed_steps:
            settings["steps"], budget = args.fixed_steps[spec.name], 0.0
        cfg = DrafterTrainConfig(num_layers=p.drafter_layers, block_size=spec.block, mask_token_id=corpus.mask_id,
                                 target_layer_ids=list(p.target_layer_ids), time_budget_s=budget,
                                 seed=args.seed, dflash2=dict(p.dflash2) if spec.dflash2 else None, **settings)
        res = train_drafter(target, corpus.stream, cfg, work / f"drafter-{spec.name}")
        dest = pair / f"drafter-{spec.name}"
        shutil.copytree(res.drafter_dir, dest)
        entry: dict[str, Any] = {
            "architecture": "DFlash2" if spec.dflash2 else "DFlash",
            "block_size": spec.block, "layers": p.drafter_layers, "target_layer_ids": p.target_layer_ids,
            "steps": res.steps, "seconds": res.seconds, "context_tokens": res.context_tokens,
            "s_per_1m_context_tokens": res.seconds / max(1, res.context_tokens) * 1e6,
            "final_loss": res.final_loss, "train_tau_estimate": res.final_tau, "mb": _dir_mb(dest),
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
    log.info("pair written to %s (%.1f MB) in %.0f s", pair, _dir_mb(pair), report["total_seconds"])
    return 0


def evaluate_pair(pair: Path, device_name: str | None, dtype: str = "auto") -> int:
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
            entry[key] = run_eval(target, pair / f"drafter-{name}", prompts, p, tokenizer, eos_id)
            write_report(pair, report)
    report["eval_seconds"] = time.perf_counter() - t0
    write_report(pair, report)
    write_model_card(pair, report)
    return 0


@dataclass
class Corpus:
    """The build's data: held-out files, the tokenizer, and the training token stream."""

    held_files: list[SourceFile]
    tokenizer: Any
    stream: torch.Tensor
    held_stream: torch.Tensor
    held_chars: int
    eos_id: int
    mask_id: int


def build_corpus(p: Preset, site: Path | None, reuse_target: Path | None, report: dict[str, Any]) -> Corpus:
    """Collect, split, tokenize (training a tokenizer unless the target is reused)."""
    t = time.perf_counter()
    # Only the standard library and permissively licensed distributions (their licences go
    # into the report, for the model card).
    files, licences = permissive_python_sources(max_chars=p.corpus_chars,
                                                site_roots=None if site is None else [site])
    train_files, held_files = split_heldout(files, p.heldout_every)
    train_texts = [f.text for f in train_files]
    tok_texts: list[str] = []
    size = 0
    # The tokenizer learns from files spread evenly over the corpus, so that it sees every
    # package, not only the first few in path order.
    stride = max(1, sum(len(t) for t in train_texts) // max(1, p.tokenizer_chars))
    for text in train_texts[::stride] + train_texts:
        if size >= p.tokenizer_chars:
            break
        tok_texts.append(text)
        size += len(text)
    if reuse_target is not None:
        from transformers import AutoTokenizer

        tokenizer: Any = AutoTokenizer.from_pretrained(reuse_target)
    else:
        tokenizer = train_bpe_tokenizer(tok_texts, p.vocab)
    eos_id = int(tokenizer.convert_tokens_to_ids(EOS_TOKEN))
    mask_id = int(tokenizer.convert_tokens_to_ids(MASK_TOKEN))
    stream = encode_stream(train_texts, tokenizer, eos_id)
    held_texts = [f.text for f in held_files]
    held_stream = encode_stream(held_texts, tokenizer, eos_id)
    report["corpus"] = {
        "files": len(files), "train_files": len(train_files), "heldout_files": len(held_files),
        "chars": sum(len(f.text) for f in files), "train_tokens": int(stream.numel()),
        "heldout_tokens": int(held_stream.numel()), "tokenizer_chars": size, "vocab": len(tokenizer),
        "site": "the interpreter's site-packages" if site is None else "corpus packages (corpus_packages.txt)",
        "seconds": time.perf_counter() - t,
        "licences": [{"distribution": lic.distribution, "version": lic.version, "licence": lic.licence}
                     for lic in licences],
    }
    log.info("corpus: %s", {k: v for k, v in report["corpus"].items() if k != "licences"})
    return Corpus(held_files, tokenizer, stream, held_stream, sum(len(x) for x in held_texts), eos_id, mask_id)


def train_and_save_target(p: Preset, seed: int, corpus: Corpus, device: torch.device, target_dir: Path,
                          report: dict[str, Any]) -> None:
    """Train the target from scratch, measure it, save it (bf16) with its tokenizer to ``target_dir``."""
    model = build_target(p, corpus.eos_id, seed)
    report["target"] = {"params": _params(model), "config": {
        "hidden": p.hidden, "layers": p.layers, "heads": p.heads, "kv_heads": p.kv_heads,
        "intermediate": p.intermediate, "vocab": p.vocab, "tied_embeddings": True}}
    report["target"].update(train_target(model, corpus.stream, p, device, seed))
    report["target"]["heldout"] = heldout_metrics(model, corpus.held_stream, corpus.held_chars,
                                                  seq_len=p.target_seq_len)
    log.info("target: %s", report["target"])
    model.to(torch.bfloat16).save_pretrained(target_dir)
    corpus.tokenizer.save_pretrained(target_dir)
    report["target"]["mb"] = _dir_mb(target_dir)


def measure_other_target(path: Path, held: list[SourceFile], p: Preset, device: torch.device) -> dict[str, Any]:
    """:func:`heldout_metrics` of another target (its own tokenizer) on this build's held-out files."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    model = load_target(path, device, torch.float32)
    eos = tokenizer.eos_token_id
    texts = [f.text for f in held]
    stream = encode_stream(texts, tokenizer, eos if isinstance(eos, int) else None)
    out: dict[str, Any] = {"path": str(path), "params": _params(model)}
    out.update(heldout_metrics(model, stream, sum(len(t) for t in texts), seq_len=p.target_seq_len))
    log.info("compare target: %s", out)
    return out


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
             eos_id: int) -> dict[str, Any]:
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
                                               stop_token_ids=[eos_id], backend=backend, sampled_drafts=True)
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
    res = generate(target, drafter, [prompt], max_new_tokens=p.eval_new_tokens, stop_token_ids=[eos_id])
    result["default_prompt"] = {"prompt": DEFAULT_PROMPT, "text": tokenizer.decode(prompt + res.tokens[0]),
                                "distinct_4gram": distinct_ngram_ratio(res.tokens[0]),
                                "tau": res.stats.mean_tau}
    return result


if __name__ == "__main__":
    sys.exit(main())
