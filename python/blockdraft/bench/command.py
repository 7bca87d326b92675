"""The ``blockdraft bench`` command line: its options, the config they make, and the run."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from blockdraft.bench.config import BenchConfig
from blockdraft.bench.driver import resolve, run
from blockdraft.bench.report import to_markdown, write_outputs
from blockdraft.bench.side_by_side import PUBLIC_TAU
from blockdraft.pair import SHAPES

log = logging.getLogger(__name__)

OUT_ROOT_NAME = "blockdraft-bench"
"""The folder under the system temp dir that holds the default output directories."""


def default_out_dir(shape: str) -> Path:
    """A new, empty directory ``<system temp>/blockdraft-bench/<shape>-<date>-<time>-<random>``:
    the output directory of a run without ``--out``.

    Outside any checkout, so a run never leaves results in a working tree; a new one per call,
    so no run overwrites another.
    """
    root = Path(tempfile.gettempdir()) / OUT_ROOT_NAME
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.mkdtemp(prefix=f"{shape}-{stamp}-", dir=root))


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _caps(text: str) -> list[int | None]:
    """``--spec-caps``: ``env`` (``None``: the environment's cap) or non-negative ints."""
    out: list[int | None] = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        if word == "env":
            out.append(None)
            continue
        try:
            cap = int(word)
        except ValueError:
            raise ValueError(f"--spec-caps: expected 'env' or a number of tokens, got {word!r}") from None
        if cap < 0:
            raise ValueError(f"--spec-caps: a cap must be >= 0, got {cap}")
        out.append(cap)
    return out


def add_arguments(parser: Any) -> None:
    """The ``bench`` subcommand's options (shared by the CLI and ``python -m``)."""
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                        help="the random pair's shape")
    parser.add_argument("--contexts", default=None, help="comma-separated (default 512,4096,16384; tiny: 32,128)")
    parser.add_argument("--batches", default=None, help="comma-separated (default 1,4,16,32,64; tiny: 1,4)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per cell")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before each cell's timed ones")
    parser.add_argument("--loop-reps", type=int, default=5,
                        help="repeats of the per-sequence loop (n propose calls each)")
    parser.add_argument("--e2e-steps", type=int, default=24,
                        help="speculative steps per end-to-end run")
    parser.add_argument("--e2e-repeats", type=int, default=1,
                        help="end-to-end runs per engine (alternating); the median is reported")
    parser.add_argument("--e2e-backends", default="flash,default",
                        help="SDPA settings of the end-to-end section on CUDA, in run order")
    parser.add_argument("--sections", default="propose,reference,e2e,host,kernels",
                        help="comma-separated: propose, reference, e2e, host, kernels, target, spec")
    parser.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: CUDA when present)")
    parser.add_argument("--dtype", default="auto", help="bf16, fp16 or fp32 (auto: bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    parser.add_argument(
        "--out",
        default=None,
        help=(
            "directory for bench.json / bench.md (created if missing; updated after every "
            "section). Default: a new directory under the system temp dir, "
            f"<tmp>/{OUT_ROOT_NAME}/<shape>-<date>-<time>-<random>; the path is printed"
        ),
    )
    parser.add_argument("--spec-caps", default="env",
                        help="comma-separated drafter window caps the spec section runs each "
                             "cell under: 'env' (BLOCKDRAFT_DFLASH_CTX_CAP, default 16384) or "
                             "a number of tokens (0 = uncapped); e.g. env,0")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="the spec section's engines take sequences this long, as a server's "
                             "runtime (its page tables as wide); default: each cell's context "
                             "and steps")
    parser.add_argument("--public-tau", type=float, default=PUBLIC_TAU,
                        help="tokens per step of a trained pair at which the side-by-side table "
                             f"derives tokens/s from the measured steps (default {PUBLIC_TAU})")
    parser.add_argument("--plot", action="store_true", help="also write PNG charts (matplotlib)")


def config_from_args(args: Any) -> BenchConfig:
    """The :class:`BenchConfig` of parsed ``bench`` options (the tiny shape has smaller
    default contexts and batches)."""
    tiny = args.shape.startswith("tiny")
    return BenchConfig(
        shape=args.shape,
        contexts=_ints(args.contexts) if args.contexts else ([32, 128] if tiny else [512, 4096, 16384]),
        batches=_ints(args.batches) if args.batches else ([1, 4] if tiny else [1, 4, 16, 32, 64]),
        reps=args.reps,
        warmup=args.warmup,
        loop_reps=args.loop_reps,
        e2e_steps=args.e2e_steps,
        e2e_repeats=args.e2e_repeats,
        e2e_backends=[b.strip() for b in args.e2e_backends.split(",") if b.strip()],
        device=args.device,
        dtype=args.dtype,
        sections=[s for s in args.sections.split(",") if s.strip()],
        seed=args.seed,
        spec_caps=_caps(args.spec_caps),
        max_seq_len=args.max_seq_len,
        public_tau=args.public_tau,
    )


def main_from_args(args: Any) -> int:
    """Run, write the outputs, print the markdown and the files written; 0 when every
    section ran, 1 when one failed (its traceback is in the outputs)."""
    cfg = config_from_args(args)
    resolve(cfg)  # a bad config fails here, before the default output directory is made
    out = Path(args.out) if args.out else default_out_dir(cfg.shape)
    log.info("bench: writing to %s", out)

    def checkpoint(partial: dict[str, Any]) -> None:
        write_outputs(partial, out)

    result = run(cfg, checkpoint=checkpoint)
    files = write_outputs(result, out, plots=args.plot)
    print(to_markdown(result))
    print("wrote " + ", ".join(str(f) for f in files))
    return 1 if result["errors"] else 0
