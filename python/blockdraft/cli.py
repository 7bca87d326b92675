"""The ``blockdraft`` command line.

Subcommands:
    demo      walk the Rust core through a sequence's lifecycle (pool, window, slide, free).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s")
    try:
        rc: int = args.func(args)
    except Exception as exc:  # noqa: BLE001 - the CLI turns every failure into one line
        if args.debug:
            raise
        print(f"blockdraft: error: {exc}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
