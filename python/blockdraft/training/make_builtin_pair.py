"""Make the built-in trained target + drafter pair from scratch, offline.

    python -m blockdraft.training.make_builtin_pair --preset h200 --out DIR   # the shipped pair
    python -m blockdraft.training.make_builtin_pair --preset tiny --out DIR   # CPU smoke run

Steps: collect the interpreter's own Python source (standard library, then site-packages),
deduplicated, holding out whole files (by content hash) for evaluation; train a byte-level BPE
tokenizer; train a small Qwen3 causal LM from scratch (the target); train DFlash drafters
against it with the recipe (:mod:`blockdraft.training.recipe`) for B = 8 and, time allowing,
B = 16; measure tau on held-out files with the speculative engine; write everything (bf16) with
a model card under ``DIR/pair`` (the layout of ``blockdraft/pretrained``).

Stages run against one wall-clock deadline (``--deadline-s``) so a run on a rented GPU ends in
time: the target and the first drafter get fixed time budgets (steps are fitted after a short
calibration and recorded), the B = 16 drafter only what is left.
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockdraft.devices import sync
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
from blockdraft.training.evaluate import EvalReport, evaluate_drafter
from blockdraft.training.licences import permissive_python_sources
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
    b16_budget_s: float
    eval_prompts: int
    eval_prompt_tokens: int
    eval_new_tokens: int
    heldout_every: int = 40
    test_prompts: int = 4
    per_block: dict[int, dict[str, Any]] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "h200": Preset(
        corpus_chars=20_000_000, tokenizer_chars=6_000_000, vocab=8192,
        hidden=256, layers=6, heads=4, kv_heads=2, intermediate=768, max_positions=2048,
        target_seq_len=512, target_batch=48, target_steps=6000, target_lr=2e-3, target_budget_s=75,
        drafter_layers=2, target_layer_ids=[1, 3, 5],
        drafter=dict(seq_len=512, num_seqs=32, num_anchors=64, steps=8000, lr=1e-3, warmup_steps=100,
                     log_every=100),
        per_block={8: dict(num_seqs=64, num_anchors=128)},
        drafter_budget_s=140, b16_budget_s=100,
        eval_prompts=16, eval_prompt_tokens=64, eval_new_tokens=128,
    ),
    "tiny": Preset(
        corpus_chars=400_000, tokenizer_chars=200_000, vocab=512,
        hidden=64, layers=3, heads=4, kv_heads=2, intermediate=128, max_positions=512,
        target_seq_len=64, target_batch=8, target_steps=40, target_lr=3e-3, target_budget_s=0,
        drafter_layers=1, target_layer_ids=[0, 2],
        drafter=dict(seq_len=64, num_seqs=4, num_anchors=8, steps=20, lr=1e-3, warmup_steps=5, log_every=10),
        drafter_budget_s=0, b16_budget_s=0,
        eval_prompts=3, eval_prompt_tokens=16, eval_new_tokens=24, test_prompts=3, heldout_every=4,
    ),
}


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


@torch.no_grad()
def heldout_loss(model: Any, stream: torch.Tensor, seq_len: int, device: torch.device) -> float:
    """Mean next-token loss over up to 32 consecutive held-out windows."""
    n = min(32, (stream.numel() - 1) // seq_len)
    if n < 1:
        return float("nan")
    tokens = stream[: n * seq_len].reshape(n, seq_len).to(device)
    return float(model(input_ids=tokens, labels=tokens, use_cache=False).loss)


def _params(module: Any) -> int:
    return sum(q.numel() for q in module.parameters())


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory (the pair goes to OUT/pair)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=0.0, help="wall-clock limit of the whole build (0: none)")
    ap.add_argument("--blocks", default="8,16", help="drafter block sizes to train (default 8,16)")
    ap.add_argument("--reuse-target", type=Path, default=None,
                    help="take the target and tokenizer from this directory instead of training them")
    ap.add_argument("--target-steps", type=int, default=0, help="fixed target steps (no time budget)")
    ap.add_argument("--drafter-budget-s", type=float, default=0.0, help="override the first drafter's time budget")
    ap.add_argument("--drafter-steps", default="", help="fixed drafter steps per block, e.g. 8:4000,16:2861")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        handlers=[logging.StreamHandler(sys.stderr), logging.FileHandler(out / "build.log")])
    p = PRESETS[args.preset]
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
                              "command": f"python -m blockdraft.training.make_builtin_pair --preset {args.preset} "
                                         f"--seed {args.seed} --out DIR"}

    def save_report() -> None:
        (pair / "build_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")

    def left() -> float:
        return math.inf if args.deadline_s <= 0 else args.deadline_s - (time.perf_counter() - start)

    if args.target_steps > 0:
        p = dataclasses.replace(p, target_steps=args.target_steps, target_budget_s=0.0)
    if args.drafter_budget_s > 0:
        p = dataclasses.replace(p, drafter_budget_s=args.drafter_budget_s)
    fixed_steps = {int(k): int(v) for k, v in (kv.split(":") for kv in args.drafter_steps.split(",") if kv)}
    blocks = [int(b) for b in args.blocks.split(",") if b]

    # ---- corpus and tokenizer
    t = time.perf_counter()
    # Only the standard library and permissively licensed distributions (their licences go
    # into the report, for the model card).
    files, licences = permissive_python_sources(max_chars=p.corpus_chars)
    train_files, held_files = split_heldout(files, p.heldout_every)
    train_texts = [f.text for f in train_files]
    tok_texts: list[str] = []
    size = 0
    for text in train_texts:
        if size >= p.tokenizer_chars:
            break
        tok_texts.append(text)
        size += len(text)
    if args.reuse_target is not None:
        from transformers import AutoTokenizer

        tokenizer: Any = AutoTokenizer.from_pretrained(args.reuse_target)
    else:
        tokenizer = train_bpe_tokenizer(tok_texts, p.vocab)
    eos_id = int(tokenizer.convert_tokens_to_ids(EOS_TOKEN))
    mask_id = int(tokenizer.convert_tokens_to_ids(MASK_TOKEN))
    stream = encode_stream(train_texts, tokenizer, eos_id)
    held_stream = encode_stream([f.text for f in held_files], tokenizer, eos_id)
    report["corpus"] = {
        "files": len(files), "train_files": len(train_files), "heldout_files": len(held_files),
        "chars": sum(len(f.text) for f in files), "train_tokens": int(stream.numel()),
        "heldout_tokens": int(held_stream.numel()), "tokenizer_chars": size, "vocab": len(tokenizer),
        "seconds": time.perf_counter() - t,
        "licences": [{"distribution": lic.distribution, "version": lic.version, "licence": lic.licence}
                     for lic in licences],
    }
    log.info("corpus: %s", report["corpus"])
    save_report()

    # ---- target
    target_dir = pair / "target"
    if args.reuse_target is not None:
        shutil.copytree(args.reuse_target, target_dir)
        earlier = args.reuse_target.parent / "build_report.json"
        report["target"] = {"reused_from": str(args.reuse_target)}
        if earlier.is_file():
            report["target"].update(json.loads(earlier.read_text(encoding="utf-8")).get("target", {}))
    else:
        train_and_save_target(p, args.seed, eos_id, stream, held_stream, device, tokenizer, target_dir, report)
    save_report()

    from transformers import AutoModelForCausalLM

    run_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loaded: Any = AutoModelForCausalLM.from_pretrained(target_dir, dtype=run_dtype)
    target = loaded.to(device).eval()

    prompts = held_prompts(held_files, tokenizer, p)
    (pair / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n", encoding="utf-8")

    # ---- drafters
    report["drafters"] = {}
    for block in blocks:
        budget = p.drafter_budget_s if block == blocks[0] else p.b16_budget_s
        reserve = 60.0 if device.type == "cuda" else 0.0
        if block != blocks[0] and budget > 0:
            budget = min(budget, left() - reserve)
            if budget < 30:
                log.info("skipping the B=%d drafter: %.0f s left", block, left())
                report["drafters"][f"b{block}"] = {"skipped": f"{left():.0f} s left before the deadline"}
                break
        settings = {**p.drafter, **p.per_block.get(block, {})}
        if block in fixed_steps:
            settings["steps"], budget = fixed_steps[block], 0.0
        cfg = DrafterTrainConfig(num_layers=p.drafter_layers, block_size=block, mask_token_id=mask_id,
                                 target_layer_ids=list(p.target_layer_ids), time_budget_s=budget,
                                 seed=args.seed, **settings)
        res = train_drafter(target, stream, cfg, work / f"drafter-b{block}")
        dest = pair / f"drafter-b{block}"
        shutil.copytree(res.drafter_dir, dest)
        entry: dict[str, Any] = {
            "block_size": block, "layers": p.drafter_layers, "target_layer_ids": p.target_layer_ids,
            "steps": res.steps, "seconds": res.seconds, "context_tokens": res.context_tokens,
            "s_per_1m_context_tokens": res.seconds / max(1, res.context_tokens) * 1e6,
            "final_loss": res.final_loss, "train_tau_estimate": res.final_tau, "mb": _dir_mb(dest),
            "train_config": dataclasses.asdict(cfg),
        }
        report["drafters"][f"b{block}"] = entry
        save_report()
        entry["eval"] = run_eval(target, dest, prompts, p, device, eos_id)
        save_report()
    report["total_seconds"] = time.perf_counter() - start
    save_report()
    write_model_card(pair, report)
    log.info("pair written to %s (%.1f MB) in %.0f s", pair, _dir_mb(pair), report["total_seconds"])
    return 0


def train_and_save_target(p: Preset, seed: int, eos_id: int, stream: torch.Tensor, held_stream: torch.Tensor,
                          device: torch.device, tokenizer: Any, target_dir: Path, report: dict[str, Any]) -> None:
    """Train the target from scratch and save it (bf16) with its tokenizer to ``target_dir``."""
    model = build_target(p, eos_id, seed)
    report["target"] = {"params": _params(model), "config": {
        "hidden": p.hidden, "layers": p.layers, "heads": p.heads, "kv_heads": p.kv_heads,
        "intermediate": p.intermediate, "vocab": p.vocab, "tied_embeddings": True}}
    report["target"].update(train_target(model, stream, p, device, seed))
    report["target"]["heldout_loss"] = heldout_loss(model, held_stream, p.target_seq_len, device)
    log.info("target: %s", report["target"])
    model.to(torch.bfloat16).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    report["target"]["mb"] = _dir_mb(target_dir)


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


def run_eval(target: Any, drafter_dir: Path, prompts: dict[str, Any], p: Preset, device: torch.device,
             eos_id: int) -> dict[str, Any]:
    """tau greedy / T=1 and the speed comparison; the torch backend if the default one fails."""
    from blockdraft.checkpoint import load_drafter

    drafter = load_drafter(drafter_dir, device=device, dtype=next(target.parameters()).dtype)
    ids = [q["ids"] for q in prompts["prompts"]]
    result: dict[str, Any] = {}
    for backend in ("auto", "torch"):
        try:
            rep: EvalReport = evaluate_drafter(target, drafter, ids, max_new_tokens=p.eval_new_tokens,
                                               stop_token_ids=[eos_id], backend=backend)
        except Exception as exc:  # noqa: BLE001 - recorded, then the plain-torch backend is tried
            log.exception("evaluation with backend %s failed", backend)
            result[f"error_{backend}"] = f"{type(exc).__name__}: {exc}"
            continue
        result.update(dataclasses.asdict(rep))
        result["backend"] = backend
        for line in rep.lines():
            log.info("%s", line)
        break
    return result


def write_model_card(pair: Path, report: dict[str, Any]) -> None:
    """MODEL_CARD.md from the build report."""
    c, tg = report["corpus"], report["target"]
    lines = [
        "# blockdraft built-in pair: a small Python code model and its DFlash drafters",
        "",
        "Made from scratch, offline, by "
        f"`{report['command']}` on {report['device_name']} ({report['device']}), "
        f"Python {report['python']}, torch {report['torch']}; total {report['total_seconds']:.0f} s.",
        "",
        "## Data",
        f"- Python source of the build machine's interpreter (standard library first, then site-packages): "
        f"{c['files']} files after de-duplication by content, {c['chars'] / 1e6:.1f} M characters.",
        f"- Held out by content hash (whole files): {c['heldout_files']} files ({c['heldout_tokens']} tokens); "
        f"training: {c['train_files']} files, {c['train_tokens'] / 1e6:.2f} M tokens.",
        f"- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {c['vocab']}, trained on "
        f"{c['tokenizer_chars'] / 1e6:.1f} M characters; `<|endoftext|>` = eos, `<|mask|>` = the drafters' MASK.",
        "",
        "## Target (`target/`)",
        f"- Qwen3 architecture, {tg['config']['layers']} layers, hidden {tg['config']['hidden']}, "
        f"{tg['config']['heads']} heads ({tg['config']['kv_heads']} K/V), MLP {tg['config']['intermediate']}, "
        f"tied embeddings: {tg['params'] / 1e6:.2f} M parameters, {tg['mb']:.1f} MB in bf16.",
        f"- Trained {tg['steps']} steps ({tg['tokens_seen'] / 1e6:.1f} M tokens seen) in {tg['seconds']:.0f} s "
        f"({tg['s_per_1m_tokens']:.2f} s per 1M tokens); final train loss {tg['final_loss']:.3f}, "
        f"held-out loss {tg['heldout_loss']:.3f}.",
        "",
        "## Drafters",
    ]
    for name, d in report.get("drafters", {}).items():
        if "skipped" in d:
            lines.append(f"- `drafter-{name}`: not trained ({d['skipped']}).")
            continue
        lines.append(
            f"- `drafter-{name}/`: DFlash, B = {d['block_size']}, {d['layers']} layers, target layers "
            f"{d['target_layer_ids']}, {d['mb']:.1f} MB in bf16; {d['steps']} steps in {d['seconds']:.0f} s "
            f"({d['s_per_1m_context_tokens']:.2f} s per 1M context tokens), final loss {d['final_loss']:.3f}."
        )
        ev = d.get("eval", {})
        if "tau" in ev:
            taus = ", ".join(f"{k} tau = {v:.2f}" for k, v in ev["tau"].items())
            lines.append(
                f"  Held-out ({ev['num_prompts']} prompts x {ev['max_new_tokens']} new tokens, "
                f"{ev['device']}, {ev['dtype']}, backend {ev['backend']}): {taus}."
            )
            if ev.get("target_tokens_per_s") is not None:
                lines.append(
                    f"  Greedy: {ev['tokens_per_s']['greedy']:.1f} tok/s vs target-only "
                    f"{ev['target_tokens_per_s']:.1f} tok/s (speed-up {ev['speedup']:.2f}x); output identical "
                    f"to target-only decoding on {ev['identical']}/{ev['num_prompts']} prompts ({ev['dtype']})."
                )
        else:
            lines.append(f"  Evaluation failed: {ev}")
    lines += [
        "",
        "Full numbers: `build_report.json`. Held-out prompts (token ids and text): `heldout_prompts.json`.",
        "Training recipe: see `docs/training.md` in the repository.",
        "",
    ]
    (pair / "MODEL_CARD.md").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
