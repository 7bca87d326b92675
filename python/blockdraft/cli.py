"""The ``blockdraft`` command line.

Subcommands:
    generate  speculative generation with a target + DFlash drafter (default: the built-in pair).
    train-drafter  train a DFlash drafter for a target (blockdraft.training's recipe).
    eval-drafter   tau and speed of a target + drafter on held-out texts.
    demo      walk the Rust core through a sequence's lifecycle (pool, window, slide, free).
    bench     proposer latency, batching, memory, host overhead, reference and end-to-end cost.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("blockdraft.cli")


def _demo(args: argparse.Namespace) -> int:
    """Show the core's bookkeeping on a small pool: windows, paged blocks, a slide, free."""
    import blockdraft as bd

    pool = bd.BlockPool(args.num_blocks, args.block_size)
    window = bd.ctx_window(args.max_seq_len, args.gamma, budget_tokens=args.budget, cap=None)
    print(
        f"pool: {pool.num_blocks} blocks x {pool.block_size} tokens; "
        f"ctx cap {bd.read_ctx_cap()} (env {bd.ENV_CTX_CAP}); window for budget "
        f"{args.budget} and B={args.gamma}: {window} rows"
    )
    states = [bd.ContextState(pool, window) for _ in range(args.sequences)]
    next_pos = [0] * len(states)
    for step in range(args.steps):
        for i, st in enumerate(states):
            # Prefill a chunk on the first step, then accepted + 1 rows per verify step.
            n = min(window, args.prefill if step == 0 else 1 + (step + i) % args.gamma)
            positions = list(range(next_pos[i], next_pos[i] + n))
            next_pos[i] += n
            plan = st.plan_append(positions)
            st.apply_append(plan)
            pre = st.plan_precompute()
            st.confirm_precompute(pre)
            slid = f" slid (kept {plan.slide.keep} rows)" if plan.slide is not None else ""
            print(
                f"step {step} seq {i}: +{n} rows -> ctx_len {st.ctx_len}, "
                f"positions {st.ctx_positions[0]}..{st.ctx_positions[-1]}, "
                f"{st.num_blocks} blocks{slid}; pool {pool.num_used}/{pool.num_blocks} used"
            )
    for st in states:
        st.free()
        st.free()  # idempotent: the second call does nothing
    pool.check_invariants()
    print(f"all states freed twice: pool {pool.num_free}/{pool.num_blocks} free")
    return 0 if pool.num_free == pool.num_blocks else 1


class CliError(Exception):
    """A user-facing problem reported as one line (exit code 2)."""


def _pick_device(name: str | None) -> Any:
    import torch

    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CliError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"unsupported device {name!r} (use cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CliError(f"device {name!r} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CliError(f"device {name!r} does not exist ({torch.cuda.device_count()} GPUs)")
    return device


class _ByteTokenizer:
    """The demo pair's tokenizer: UTF-8 bytes are ids 0..255."""

    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) or [32]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


DEMO_VOCAB = 320
DEMO_MASK = 256


def build_demo_pair(*, device: Any = "cpu", dtype: Any = None, seed: int = 0) -> tuple[Any, Any]:
    """A small random Qwen3 target (byte vocabulary) and a matching 1-layer DFlash drafter.

    Deterministic: the same seed gives the same weights on every machine (drawn on the CPU).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from blockdraft.config import DrafterConfig
    from blockdraft.models import DFlashDrafter

    dtype = dtype or torch.float32
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(  # type: ignore[no-untyped-call]
        Qwen3Config(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            vocab_size=DEMO_VOCAB,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    )
    cfg = DrafterConfig.from_dict(
        {
            "architectures": ["DFlashDraftModel"],
            "hidden_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "vocab_size": DEMO_VOCAB,
            "max_position_embeddings": 4096,
            "num_target_layers": 4,
            "block_size": 8,
            "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": DEMO_MASK},
        }
    )
    drafter = DFlashDrafter(cfg, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    drafter.requires_grad_(False)
    moved: Any = target
    target = moved.to(device=device, dtype=dtype).eval()
    drafter = drafter.to(device=device, dtype=dtype).eval()
    return target, drafter


def _load_pair(args: argparse.Namespace, device: Any) -> tuple[Any, Any, Any, str]:
    """(target, drafter, tokenizer, description) from ``--target/--drafter`` or the demo pair."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.target is None and args.drafter is None:
        from blockdraft import pretrained

        if pretrained.available():
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
            target, drafter, tokenizer = pretrained.builtin_pair(device=device, dtype=dtype)
            return target, drafter, tokenizer, "built-in trained pair (Python code model + B=8 DFlash drafter)"
        target, drafter = build_demo_pair(device=device, dtype=dtype)
        return (
            target,
            drafter,
            _ByteTokenizer(),
            "built-in trained pair not installed; using the demo pair with RANDOM weights "
            "(output is noise; pass --target/--drafter for a real pair)",
        )
    if args.target is None or args.drafter is None:
        raise CliError("give both --target DIR and --drafter DIR (or neither for the built-in pair)")
    from pathlib import Path

    for flag, value in (("--target", args.target), ("--drafter", args.drafter)):
        path = Path(value)
        if not path.is_dir():
            raise CliError(f"{flag} {value}: not a directory")
        if not (path / "config.json").is_file():
            raise CliError(f"{flag} {value}: no config.json")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # The CLI has its own progress bar; transformers' loading bars would bury error lines.
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    from blockdraft.checkpoint import load_drafter

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    except Exception as exc:  # noqa: BLE001 - reported as one line
        raise CliError(f"--target {args.target}: cannot load the tokenizer: {exc}") from exc
    try:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device)
    except Exception as exc:  # noqa: BLE001 - reported as one line
        raise CliError(f"--target {args.target}: cannot load the model: {exc}") from exc
    target.eval()
    drafter = load_drafter(args.drafter, device=device, dtype=dtype)
    return target, drafter, tokenizer, f"target {args.target}, drafter {args.drafter}"


def _generate(args: argparse.Namespace) -> int:
    """Decode one prompt speculatively; optionally compare with target-only decoding."""
    import time

    import torch
    from tqdm import tqdm  # type: ignore[import-untyped]

    from blockdraft.engine import SpeculativeEngine

    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, not {args.max_new_tokens}")
    device = _pick_device(args.device)
    target, drafter, tokenizer, what = _load_pair(args, device)
    prompt = args.prompt if args.prompt is not None else "def fibonacci(n):"
    ids = list(tokenizer.encode(prompt))
    stop = getattr(tokenizer, "eos_token_id", None)
    stops = [stop] if isinstance(stop, int) else None
    max_seq_len = len(ids) + args.max_new_tokens
    engine = SpeculativeEngine(
        target,
        drafter,
        max_seq_len=max_seq_len,
        max_batch=1,
        num_blocks=-(-(max_seq_len + int(drafter.config.block_size) + 1) // 16),
        kv_block_size=16,
    )
    print(f"blockdraft generate: {what}; device {device}")
    bar = tqdm(
        total=args.max_new_tokens,
        unit="tok",
        disable=args.max_new_tokens < 64 or args.no_progress,
        leave=False,
    )
    with bar:
        result = engine.generate(
            [ids],
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            stop_token_ids=stops,
            progress=bar.update,
        )
    out = result.tokens[0]
    stats = result.stats
    print(prompt + tokenizer.decode(out))
    print(
        f"tokens {stats.num_new_tokens}  tau {stats.mean_tau:.2f}  "
        f"{stats.tokens_per_s:.1f} tok/s  ttft {stats.ttft_s[0] * 1000:.1f} ms"
    )
    if args.compare:
        inp = torch.tensor([ids], dtype=torch.long, device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            ref = target.generate(
                inp,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=stops,
                pad_token_id=stops[0] if stops else 0,
            )
        elapsed = time.perf_counter() - start
        ref_out = ref[0, len(ids) :].tolist()
        ref_tps = len(ref_out) / elapsed if elapsed > 0 else 0.0
        same = "identical" if ref_out == out else "DIFFERENT"
        speedup = stats.tokens_per_s / ref_tps if ref_tps > 0 else float("nan")
        print(
            f"target only: {len(ref_out)} tokens  {ref_tps:.1f} tok/s  "
            f"speed-up {speedup:.2f}x  output {same}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockdraft", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk the Rust core through a sequence lifecycle")
    demo.add_argument("--num-blocks", type=int, default=64)
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--max-seq-len", type=int, default=4096)
    demo.add_argument("--gamma", type=int, default=8)
    demo.add_argument("--budget", type=int, default=40)
    demo.add_argument("--prefill", type=int, default=30)
    demo.add_argument("--sequences", type=int, default=2)
    demo.add_argument("--steps", type=int, default=6)
    demo.set_defaults(func=_demo)
    gen = sub.add_parser("generate", help="speculative generation with a DFlash drafter")
    gen.add_argument("prompt", nargs="?", default=None, help="text to continue")
    gen.add_argument("--target", default=None, help="target model directory (HF format)")
    gen.add_argument("--drafter", default=None, help="DFlash drafter directory")
    gen.add_argument("--compare", action="store_true", help="also decode with the target alone")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    gen.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    gen.set_defaults(func=_generate)
    bench = sub.add_parser("bench", help="benchmark the proposer on random weights (see docs/BENCHMARKS.md)")
    from blockdraft.bench import add_arguments, main_from_args

    add_arguments(bench)
    bench.set_defaults(func=main_from_args)
    from blockdraft.training.cli import add_training_commands

    add_training_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s")
    try:
        rc: int = args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("blockdraft: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI turns every failure into one line
        if args.debug:
            raise
        lines = str(exc).strip().splitlines()
        print(f"blockdraft: error: {lines[0] if lines else type(exc).__name__}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
