"""``blockdraft demo``: the Rust core's bookkeeping for a few sequences on a small pool."""

from __future__ import annotations

import argparse
from typing import Any

from blockdraft.cli.common import require_min

# (flag, default, help); every option is a count or a size, so each must be >= 1.
OPTIONS = (
    ("--num-pages", 64, "K/V pages in the pool"),
    ("--page-size", 16, "tokens per K/V page"),
    ("--max-seq-len", 4096, "longest sequence the target serves"),
    ("--block-size", 8, "B: the drafter's block (anchor + B-1 drafts)"),
    ("--budget", 40, "prompt + new tokens each sequence is allocated for"),
    ("--prefill", 30, "rows committed on the first step"),
    ("--sequences", 2, "sequences sharing the pool"),
    ("--steps", 6, "steps to walk"),
)


def run_demo(args: argparse.Namespace) -> int:
    """Show the core's bookkeeping on a small pool: windows, pages, a slide, free."""
    import blockdraft as bd

    for flag, _, _ in OPTIONS:
        require_min(flag, getattr(args, flag[2:].replace("-", "_")))
    pool = bd.BlockPool(args.num_pages, args.page_size)
    window = bd.ctx_window(args.max_seq_len, args.block_size, args.budget)
    # The proposer's policy: a slide leaves this many rows free beyond its commit's.
    room = bd.core.slide_room(window)
    print(
        f"pool: {pool.num_pages} pages x {pool.page_size} tokens; "
        f"ctx cap {bd.core.read_ctx_cap()} (env {bd.core.ENV_CTX_CAP}); window for budget "
        f"{args.budget} and B={args.block_size}: {window} rows; a slide leaves {room} free "
        f"(env {bd.core.ENV_SLIDE})"
    )
    states = [bd.core.ContextState(pool, window, slide_room=room) for _ in range(args.sequences)]
    next_pos = [0] * len(states)
    for step in range(args.steps):
        for i, st in enumerate(states):
            # Prefill a chunk on the first step, then accepted + 1 rows per verify step.
            n = min(window, args.prefill if step == 0 else 1 + (step + i) % args.block_size)
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
                f"{st.num_pages} pages{slid}; pool {pool.num_used}/{pool.num_pages} used"
            )
    for st in states:
        st.free()
        st.free()  # idempotent: the second call does nothing
    pool.check_invariants()
    print(f"all states freed twice: pool {pool.num_free}/{pool.num_pages} free")
    return 0 if pool.num_free == pool.num_pages else 1


def add_demo_command(sub: Any) -> None:
    demo = sub.add_parser("demo", help="walk the Rust core through a sequence lifecycle")
    for flag, default, text in OPTIONS:
        demo.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    demo.set_defaults(func=run_demo)
