"""The built-in pair's corpus and target stages: collect and tokenize the corpus, train the
target from scratch, tune it against loops, measure it."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockdraft.devices import sync
from blockdraft.pretrained import DEFAULT_PROMPT
from blockdraft.training.builtin.licences import permissive_python_sources
from blockdraft.training.builtin.presets import Preset
from blockdraft.training.builtin.unlikelihood import TuneConfig, tune_target
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
from blockdraft.training.evaluate import distinct_ngram_ratio, heldout_metrics, target_only_greedy
from blockdraft.training.optim import BudgetCalibrator, adamw, apply_gradients, cosine_lr

log = logging.getLogger("blockdraft.make_builtin_pair")


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
        "site": "the interpreter's site-packages" if site is None else "the corpus packages (corpus_site)",
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
    report["target"] = {"params": param_count(model), "config": {
        "hidden": p.hidden, "layers": p.layers, "heads": p.heads, "kv_heads": p.kv_heads,
        "intermediate": p.intermediate, "vocab": p.vocab, "tied_embeddings": True}}
    report["target"].update(train_target(model, corpus.stream, p, device, seed))
    report["target"]["heldout"] = heldout_metrics(model, corpus.held_stream, corpus.held_chars,
                                                  seq_len=p.target_seq_len)
    log.info("target: %s", report["target"])
    model.to(torch.bfloat16).save_pretrained(target_dir)
    corpus.tokenizer.save_pretrained(target_dir)
    report["target"]["mb"] = dir_mb(target_dir)


def measure_other_target(path: Path, held: list[SourceFile], p: Preset, device: torch.device) -> dict[str, Any]:
    """:func:`heldout_metrics` of another target (its own tokenizer) on this build's held-out files."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(path)
    model = load_target(path, device, torch.float32)
    eos = tokenizer.eos_token_id
    texts = [f.text for f in held]
    stream = encode_stream(texts, tokenizer, eos if isinstance(eos, int) else None)
    out: dict[str, Any] = {"path": str(path), "params": param_count(model)}
    out.update(heldout_metrics(model, stream, sum(len(t) for t in texts), seq_len=p.target_seq_len))
    log.info("compare target: %s", out)
    return out


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
    """Next-token training of ``model`` on windows of ``stream`` (AdamW, warm-up + cosine).

    With ``p.target_compile`` the forward and backward run through ``torch.compile`` (the
    compiled module shares ``model``'s parameters); if compiling fails on the first step, the
    training goes on eagerly and the result says ``compiled: False``.
    """
    from tqdm import tqdm  # type: ignore[import-untyped]

    model.to(device).train()
    opt = adamw(model, p.target_lr, 0.1)
    total, warmup = p.target_steps, min(100, p.target_steps // 10 + 1)
    use_amp = device.type == "cuda"
    t0 = time.perf_counter()
    calibrator = BudgetCalibrator(p.target_budget_s, 20, device, t0)
    settled = p.target_budget_s <= 0
    step, loss_v = 0, float("nan")
    forward, compiled = (torch.compile(model), True) if p.target_compile else (model, False)
    bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc="target")
    while step < total:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, total, p.target_lr, warmup, 0.1)
        tokens = sample_windows(stream, p.target_batch, p.target_seq_len, step_generator(seed, step)).to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=use_amp):
            try:
                loss = forward(input_ids=tokens, labels=tokens, use_cache=False).loss
            except Exception:  # noqa: BLE001 - a compiler failure costs speed, not the build
                if forward is model or step > 0:
                    raise
                log.exception("torch.compile of the target failed; training it eagerly")
                forward, compiled = model, False
                loss = forward(input_ids=tokens, labels=tokens, use_cache=False).loss
        apply_gradients(opt, loss, model, 1.0)
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
            "s_per_1m_tokens": seconds / tokens_seen * 1e6, "compiled": compiled}


def load_target(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """A saved causal LM in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def loop_metrics(model: Any, prompts: dict[str, Any], tokenizer: Any, eos_id: int, new_tokens: int) -> dict[str, float]:
    """Mean :func:`distinct_ngram_ratio` of ``model``'s greedy continuations of the held-out
    prompts, and that of the default prompt's."""
    held = [distinct_ngram_ratio(target_only_greedy(model, q["ids"], new_tokens, [eos_id]))
            for q in prompts["prompts"]]
    default = list(tokenizer(DEFAULT_PROMPT, add_special_tokens=False)["input_ids"])
    return {"heldout": statistics.fmean(held) if held else float("nan"),
            "default_prompt": distinct_ngram_ratio(target_only_greedy(model, default, new_tokens, [eos_id]))}


def tune_and_save_target(p: Preset, seed: int, corpus: Corpus, device: torch.device, target_dir: Path,
                         prompts: dict[str, Any], report: dict[str, Any]) -> None:
    """Unlikelihood fine-tuning (:mod:`~blockdraft.training.builtin.unlikelihood`) of the target in
    ``target_dir``, measured before and after (held-out metrics, the loop metric in fp32),
    saved back in bf16."""
    model = load_target(target_dir, device, torch.float32)

    def measure() -> dict[str, Any]:
        return {"heldout": heldout_metrics(model, corpus.held_stream, corpus.held_chars, seq_len=p.target_seq_len),
                "distinct_4gram": loop_metrics(model, prompts, corpus.tokenizer, corpus.eos_id, p.eval_new_tokens)}

    before = measure()
    log.info("target before tuning: %s", before)
    cfg = TuneConfig(**{**p.tune, "time_budget_s": p.tune_budget_s, "seed": seed})
    tuning = tune_target(model, corpus.stream, corpus.eos_id, cfg)
    model.to(torch.bfloat16).save_pretrained(target_dir)
    corpus.tokenizer.save_pretrained(target_dir)
    # Measured as shipped: the bf16 weights, run in fp32.
    model = load_target(target_dir, device, torch.float32)
    after = measure()
    log.info("target after tuning: %s", after)
    tg = report["target"]
    tg["tuning"] = {**tuning, "before": before}
    tg.update(after)
    tg["mb"] = dir_mb(target_dir)


def param_count(module: Any) -> int:
    """Parameters of ``module``."""
    return sum(q.numel() for q in module.parameters())


def dir_mb(path: Path) -> float:
    """Megabytes of the files under ``path`` (a saved model)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6
