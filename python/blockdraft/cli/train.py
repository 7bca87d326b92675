"""``blockdraft train-drafter`` and ``blockdraft eval-drafter``."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from blockdraft.cli.common import (
    CliError,
    check_lengths,
    model_dtype,
    pick_device,
    require_min,
    require_temperature,
)
from blockdraft.errors import error_line
from blockdraft.pair.load import check_target_dir, find_pair, load_target_model, load_tokenizer

log = logging.getLogger("blockdraft.cli")


def _ids(text: str | None) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise CliError(f"--target-layer-ids {text!r}: expected comma-separated integers") from None


def _temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise CliError(f"--temperatures {text!r}: expected comma-separated numbers") from None
    if not temps:
        raise CliError(f"--temperatures {text!r}: no temperature given")
    for t in temps:
        require_temperature("--temperatures", t)
    return temps


def _dflash2_sizes(text: str | None) -> dict[str, int] | None:
    """``--dflash2 K,G,R,C`` -> the DFlash2 sizes (``None`` when the flag is absent)."""
    from blockdraft.config import DFLASH2_FIELDS

    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != len(DFLASH2_FIELDS) or min(values) < 1:
        raise CliError(f"--dflash2 {text!r}: expected four positive integers KERNEL,GROUP,RANK,TOP_K")
    return dict(zip(DFLASH2_FIELDS, values))


def _texts(flag: str, path: str) -> list[str]:
    """:func:`load_texts` with its errors naming ``flag`` (a bad JSONL line: ``path:line``)."""
    from blockdraft.training.data import load_texts

    try:
        return load_texts(path)
    except (OSError, ValueError) as exc:
        raise CliError(f"{flag}: {error_line(exc)}") from exc


def resolve_mask_token(target: Any, tokenizer: Any, requested: int | None, out: Path) -> tuple[int, Path | None]:
    """The MASK id: ``requested``, else the tokenizer's mask token, else a new ``<|mask|>``.

    A new token grows the target's embeddings (its row starts at the mean embedding) and the
    grown target + tokenizer are saved to ``out/target``, which is then the target to serve
    with. Returns (mask id, the new target directory or ``None``).
    """
    if requested is not None:
        return requested, None
    existing = getattr(tokenizer, "mask_token_id", None)
    if isinstance(existing, int):
        return existing, None
    from blockdraft.training.data import MASK_TOKEN

    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    target.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    new_dir = out / "target"
    target.save_pretrained(new_dir)
    tokenizer.save_pretrained(new_dir)
    mask = int(tokenizer.mask_token_id)
    log.warning("target has no mask token: added %s as id %d; serve with the grown target in %s",
                MASK_TOKEN, mask, new_dir)
    return mask, new_dir


def _train(args: argparse.Namespace) -> int:
    from blockdraft.training.data import encode_stream
    from blockdraft.training.loop import DrafterTrainConfig, train_drafter

    layer_ids = _ids(args.target_layer_ids)
    device = pick_device(args.device)
    check_target_dir(args.target)
    # The corpus is checked before the target loads: a bad line fails in a second.
    texts = _texts("--corpus", args.corpus)
    tokenizer = load_tokenizer("--target", args.target)
    target = load_target_model("--target", args.target, device, model_dtype(device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mask, grown = resolve_mask_token(target, tokenizer, args.mask_token_id, out)
    eos = getattr(tokenizer, "eos_token_id", None)
    stream = encode_stream(texts, tokenizer, eos if isinstance(eos, int) else None)
    print(f"corpus: {len(texts)} documents, {stream.numel()} tokens")
    if args.rollouts > 0:
        stream = _rollouts(args, target, stream, eos)
        print(f"rollouts: {args.rollouts} continuations by the target, {stream.numel()} tokens")
    cfg = DrafterTrainConfig(
        num_layers=args.layers, block_size=args.block_size, mask_token_id=mask,
        target_layer_ids=layer_ids, intermediate_size=args.intermediate_size,
        seq_len=args.seq_len, num_seqs=args.num_seqs, num_anchors=args.num_anchors, steps=args.steps,
        time_budget_s=args.time_budget, lr=args.lr, warmup_steps=args.warmup, label_mode=args.labels,
        gamma=args.gamma, seed=args.seed, save_every=args.save_every, save_dtype=args.save_dtype,
        log_every=args.log_every, distill_weight=args.distill_weight, anchor_focus=args.anchor_focus,
        selector_distill_weight=args.selector_distill_weight,
        dflash2=_dflash2_sizes(args.dflash2), selector_weight=args.selector_weight,
        init_from=args.init_from,
    )
    res = train_drafter(target, stream, cfg, out, resume=args.resume, progress=not args.no_progress)
    print(f"drafter: {res.drafter_dir} ({res.steps} steps, {res.seconds:.0f} s, "
          f"loss {res.final_loss:.3f}, tau estimate {res.final_tau:.2f})")
    if grown is not None:
        print(f"target with the added mask token: {grown}")
    return 0


def _rollouts(args: argparse.Namespace, target: Any, stream: Any, eos: Any) -> Any:
    """``--rollouts``: the target's own continuations of corpus prompts, as the training stream."""
    from blockdraft.training.rollouts import rollout_stream

    for flag, value in (("--rollout-prompt-tokens", args.rollout_prompt_tokens),
                        ("--rollout-tokens", args.rollout_tokens)):
        require_min(flag, value)
    require_min("--rollout-batch", args.rollout_batch, 0)
    require_temperature("--rollout-temperature", args.rollout_temperature)
    if not isinstance(eos, int):
        raise CliError("--rollouts needs a tokenizer with an eos token (it ends each rollout)")
    try:
        return rollout_stream(target, stream, eos, num=args.rollouts, prompt_len=args.rollout_prompt_tokens,
                              new_tokens=args.rollout_tokens, temperature=args.rollout_temperature,
                              seed=args.seed, batch=args.rollout_batch)
    except ValueError as exc:
        raise CliError(f"--rollouts: {error_line(exc)}") from exc


def _eval(args: argparse.Namespace) -> int:
    from blockdraft import pretrained
    from blockdraft.training.evaluate import evaluate_drafter, heldout_prompts

    for flag, value in (("--repeats", args.repeats), ("--num-prompts", args.num_prompts),
                        ("--prompt-tokens", args.prompt_tokens), ("--max-new-tokens", args.max_new_tokens)):
        require_min(flag, value)
    temps = _temperatures(args.temperatures)
    device = pick_device(args.device)
    block = args.block_size if args.block_size is not None else pretrained.DEFAULT_BLOCK_SIZE
    source = find_pair(args.target, args.drafter, block_size=block)
    prompts: list[list[int]] | None = None
    if source.builtin:
        if args.texts is None:
            prompts = pretrained.heldout_prompts()[: args.num_prompts]
    elif args.texts is None:
        raise CliError("--texts PATH (held-out texts: a directory or JSONL) is needed with --target")
    tokenizer = source.tokenizer()
    if prompts is None:
        try:
            prompts = heldout_prompts(_texts("--texts", args.texts), tokenizer, args.num_prompts,
                                      args.prompt_tokens)
        except ValueError as exc:
            raise CliError(f"--texts {args.texts}: {error_line(exc)}") from exc
    check_lengths(max(len(p) for p in prompts), args.max_new_tokens, source.max_positions,
                  what="the longest prompt")
    pair = source.load(device, tokenizer=tokenizer)
    target, drafter = pair.target, pair.drafter
    eos = getattr(tokenizer, "eos_token_id", None)
    report = evaluate_drafter(
        target, drafter, prompts, max_new_tokens=args.max_new_tokens, temperatures=temps,
        compare_target=not args.no_compare, stop_token_ids=[eos] if isinstance(eos, int) else [],
        seed=args.seed, backend=args.backend, repeats=args.repeats, sampled_drafts=args.sampled_drafts,
    )
    for line in report.lines():
        print(line)
    return 0


def add_training_commands(sub: Any) -> None:
    """Add ``train-drafter`` and ``eval-drafter`` to the CLI's subparsers."""
    # The CLI's help formatter shows each flag's default; a help text that says what leaving a
    # flag out means says it itself.
    tr = sub.add_parser("train-drafter", help="train a DFlash drafter for a target model")
    tr.add_argument("--target", required=True, help="target model directory (HF format, frozen)")
    tr.add_argument("--corpus", required=True, help="directory of text files or a JSONL of {'text': ...}")
    tr.add_argument("--out", required=True, help="output directory (drafter/ and checkpoints/)")
    tr.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    tr.add_argument("--block-size", type=int, default=16,
                    help="B, tokens per drafted block: the anchor + B-1 masks")
    tr.add_argument("--target-layer-ids", default=None, metavar="IDS",
                    help="comma-separated target layers whose hidden states the drafter reads, e.g. 1,9,17 "
                         "(default: the DFlash rule)")
    tr.add_argument("--mask-token-id", type=int, default=None,
                    help="token id of MASK (default: the tokenizer's mask token, else a new <|mask|> token)")
    tr.add_argument("--intermediate-size", type=int, default=None,
                    help="drafter MLP width (default: the target's)")
    tr.add_argument("--seq-len", type=int, default=512, help="tokens per training window")
    tr.add_argument("--num-seqs", type=int, default=16, help="windows per step")
    tr.add_argument("--num-anchors", type=int, default=64, help="blocks per window")
    tr.add_argument("--steps", type=int, default=1000,
                    help="optimizer steps; an upper bound with --time-budget")
    tr.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                    help="fit the step count to this many seconds, measured over the first steps; "
                         "0: run --steps")
    tr.add_argument("--lr", type=float, default=6e-4,
                    help="peak AdamW learning rate, then cosine decay to a tenth of it")
    tr.add_argument("--warmup", type=int, default=50,
                    help="steps of linear learning-rate warm-up")
    tr.add_argument("--labels", choices=("target", "corpus"), default="target",
                    help="train on the target's greedy choices or on the corpus tokens")
    tr.add_argument("--gamma", type=float, default=None,
                    help="loss decay over a block's positions (default: 7/5/4 for B=16/10/8)")
    tr.add_argument("--distill-weight", type=float, default=0.0,
                    help="add the target's T=1 distribution as a soft label with this weight (sampled drafts); "
                         "0: off")
    tr.add_argument("--anchor-focus", type=float, default=0.0, metavar="F",
                    help="draw this fraction of the anchors where the target was unsure of the anchor token "
                         "(where blocks start at inference); 0: all uniform")
    tr.add_argument("--dflash2", default=None, metavar="K,G,R,C",
                    help="train a DFlash2 drafter: conv kernel K, conv group G, selector rank R, top-K C "
                         "(e.g. 3,32,32,8; default: a DFlash drafter)")
    tr.add_argument("--selector-weight", type=float, default=1.0,
                    help="DFlash2: weight of the selector loss")
    tr.add_argument("--selector-distill-weight", type=float, default=0.0,
                    help="DFlash2: weight of the selector's distillation towards the target's distribution over "
                         "its candidates (sampled drafts); 0: off")
    tr.add_argument("--rollouts", type=int, default=0,
                    help="train on this many continuations written by the target itself (prompts from the "
                         "corpus) instead of on the corpus; 0: the corpus")
    tr.add_argument("--rollout-prompt-tokens", type=int, default=64,
                    help="corpus tokens that start a rollout")
    tr.add_argument("--rollout-tokens", type=int, default=256,
                    help="tokens the target writes per rollout")
    tr.add_argument("--rollout-temperature", type=float, default=0.0,
                    help="0: greedy rollouts; 1: sampled (for drafters that sample their drafts) "
                         "(default: %(default)s)")
    tr.add_argument("--rollout-batch", type=int, default=256,
                    help="rollouts written at once; 0: all")
    tr.add_argument("--init-from", default=None, metavar="DIR",
                    help="start from this saved drafter of the same shape, any block size (continued training; "
                         "default: new weights)")
    tr.add_argument("--seed", type=int, default=0,
                    help="seed of the windows, anchors, new weights and rollouts")
    tr.add_argument("--save-every", type=int, default=500,
                    help="checkpoint interval in steps; 0: at the end only")
    tr.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    tr.add_argument("--save-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                    help="dtype of the saved drafter's weights")
    tr.add_argument("--log-every", type=int, default=50,
                    help="steps between progress log lines")
    tr.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=_train)

    ev = sub.add_parser("eval-drafter", help="tau (greedy, T=1) and speed on held-out texts")
    ev.add_argument("--target", default=None, help="target directory (default: the built-in pair)")
    ev.add_argument("--drafter", default=None,
                    help="drafter directory, given with --target (default: the built-in pair's)")
    ev.add_argument("--block-size", type=int, default=None,
                    help="built-in drafter to use: 8 or 16 (default: the built-in default, 16)")
    ev.add_argument("--texts", default=None,
                    help="held-out texts: a directory or JSONL (default: the built-in pair's held-out prompts; "
                         "needed with --target)")
    ev.add_argument("--num-prompts", type=int, default=8, help="prompts measured")
    ev.add_argument("--prompt-tokens", type=int, default=64,
                    help="tokens per prompt taken from each --texts text")
    ev.add_argument("--max-new-tokens", type=int, default=64,
                    help="tokens generated per prompt")
    ev.add_argument("--temperatures", default="0,1",
                    help="comma-separated sampling temperatures; 0 = greedy")
    ev.add_argument("--sampled-drafts", action="store_true",
                    help="at temperatures > 0 also measure tau with drafts sampled from the drafter")
    ev.add_argument("--no-compare", action="store_true", help="skip the target-only comparison")
    ev.add_argument("--repeats", type=int, default=1,
                    help="rounds of engine vs target-only timing; medians are reported")
    ev.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                    help="the drafter's kernels: triton, torch, or auto (Triton on CUDA, torch elsewhere) "
                         "(default: %(default)s)")
    ev.add_argument("--seed", type=int, default=0, help="sampling seed at temperatures > 0")
    ev.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    ev.set_defaults(func=_eval)
