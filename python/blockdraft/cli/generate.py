"""``blockdraft generate``: one prompt, decoded speculatively, optionally against the target alone.

Without ``--target/--drafter`` it runs the built-in trained pair, or a small random pair
(:func:`blockdraft.pair.load.build_demo_pair`) when that is not installed.

``--tp N`` splits the target over N ranks: the command starts N processes itself
(:func:`blockdraft.parallel.launch`, which stops them all and reports the rank when one
fails), or, run under ``torchrun --nproc-per-node N``, each process is one rank. Rank 0
prints.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from blockdraft.cli.common import (
    CliError,
    check_lengths,
    check_text,
    pick_device,
    progress_bar,
    require_min,
    require_temperature,
    tp_device,
    tp_sizes,
)
from blockdraft.pair.load import PairSource, find_pair
from blockdraft.pretrained import DEFAULT_PROMPT


def run_generate(args: argparse.Namespace) -> int:
    """Decode one prompt speculatively; with ``--compare`` also target-only on the same runtime
    and with Hugging Face ``generate``. The engine is warmed up first
    (:meth:`~blockdraft.SpeculativeEngine.warmup`, its time printed apart; ``--no-warmup``
    skips it) and every path runs once untimed, so the timed runs are warm. With ``--tp N`` (or under ``torchrun``) the
    target is split over N ranks."""
    from blockdraft.parallel import end_rank_process, init_tp, launch, launched_by_torchrun

    tp = args.tp
    if tp is not None:
        require_min("--tp", tp)
    if launched_by_torchrun():
        import os

        world = int(os.environ["WORLD_SIZE"])
        if tp is not None and tp != world:
            raise CliError(f"--tp {tp} but torchrun started {world} ranks (WORLD_SIZE)")
        group = init_tp(device=tp_device(args.device))
        rc = _generate(args, group)
        group.close()
        end_rank_process(rc)  # this process is the rank: no teardown (see end_rank_process)
    if tp is None or tp == 1:
        return _generate(args, None)
    _check_inputs(args, tp)  # one line before any rank starts
    rcs = launch(_generate_on_rank, tp, (args,), device=tp_device(args.device))
    return int(rcs[0])


def _generate_on_rank(group: Any, args: argparse.Namespace) -> int:
    """One rank of ``generate --tp N`` (module level: each rank imports it). Its logging is
    set up as ``main`` sets it up for one process; the other ranks log warnings only."""
    import logging

    debug = bool(getattr(args, "debug", False))
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(message)s")
    if not group.is_first:
        logging.getLogger().setLevel(logging.WARNING)
    return _generate(args, group)


def _check_inputs(args: argparse.Namespace, tp: int) -> tuple[PairSource, Any, str, list[int]]:
    """Every check made before weights load: ``(source, tokenizer, prompt, prompt ids)``."""
    from blockdraft.parallel import check_split

    require_min("--max-new-tokens", args.max_new_tokens)
    require_temperature("--temperature", args.temperature)
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if not prompt:
        raise CliError("the prompt is empty (give text to continue, or none for the default prompt)")
    check_text("the prompt", prompt)
    source = find_pair(args.target, args.drafter, demo=True)
    if tp > 1:
        arch, sizes = tp_sizes(source.config)
        check_split(arch, sizes, tp)
    tokenizer = source.tokenizer()
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise CliError("the prompt encodes to no tokens")
    check_lengths(len(ids), args.max_new_tokens, source.max_positions)
    return source, tokenizer, prompt, ids


def _silent(*args: Any, **kwargs: Any) -> None:
    """``print`` on the ranks after rank 0."""


def warm_up(engine: Any, *, bar: bool) -> Any:
    """:meth:`~blockdraft.SpeculativeEngine.warmup` with a progress bar (when ``bar``);
    returns its :class:`~blockdraft.engine.warmup.WarmupReport`."""
    if not bar:
        return engine.warmup()
    with progress_bar(total=0, desc="warm-up", unit="step", leave=False) as progress:
        def update(done: int, total: int) -> None:
            progress.total = total
            progress.update(done - progress.n)

        return engine.warmup(progress=update)


def _generate(args: argparse.Namespace, group: Any) -> int:
    import torch

    import blockdraft
    from blockdraft.devices import sync
    from blockdraft.engine import SpeculativeEngine
    from blockdraft.engine.generate import pool_sizes
    from blockdraft.sampling import SamplingParams

    ranks = 1 if group is None else int(group.size)
    say = print if group is None or group.is_first else _silent
    if ranks == 1:
        device = pick_device(args.device)
    else:
        tp_device(args.device)
        device = group.device
    source, tokenizer, prompt, ids = _check_inputs(args, ranks)
    pair = source.load(device, tokenizer=tokenizer)
    target, drafter = pair.target, pair.drafter
    stop = getattr(tokenizer, "eos_token_id", None)
    stops = [stop] if isinstance(stop, int) else None
    n = args.max_new_tokens
    target_pages, drafter_pages = pool_sizes([len(ids)], n, int(drafter.config.block_size))
    engine = SpeculativeEngine(target, drafter, max_seq_len=len(ids) + n, max_active=1,
                               max_batch=1, page_size=16, target_pages=target_pages,
                               num_pages=drafter_pages, tp=group)
    where = f"; tensor parallel over {ranks} ranks ({group.backend})" if ranks > 1 else ""
    say(f"blockdraft generate: {source.description}; device {device}{where}; "
        f"target on {'blockdraft runtime' if engine.runtime is not None else 'Hugging Face'}")
    if not args.no_warmup:
        report = warm_up(engine, bar=not args.no_progress and say is not _silent)
        say(f"warm-up: {report.seconds:.1f} s ({report.compiles} kernels compiled, "
            f"{report.captures} CUDA graphs captured; not in the figures below)")
    # One untimed run of this very prompt too: caches that follow the data are warm as well.
    warm = min(n, 16)
    engine.generate([ids], max_new_tokens=warm, stop_token_ids=stops)
    bar = progress_bar(total=n, unit="tok", disable=n < 64 or args.no_progress or say is _silent,
                       leave=False)
    with bar:
        result = engine.generate([ids], max_new_tokens=n, sampling=SamplingParams(args.temperature),
                                 stop_token_ids=stops, progress=bar.update)
    out = result.tokens[0]
    stats = result.stats
    say(prompt + tokenizer.decode(out))
    spec_tps = stats.tokens_per_s
    say(f"speculative: {stats.num_new_tokens} tokens, tau {stats.mean_tau:.2f}, "
        f"{spec_tps:.1f} tok/s, first token {stats.ttft_s[0] * 1000:.1f} ms")
    if not args.compare:
        return 0
    greedy = args.temperature <= 0
    speedups = []
    if engine.runtime is not None:
        blockdraft.decode(engine.runtime, [ids], max_new_tokens=warm, stop_token_ids=stops)
        alone = blockdraft.decode(engine.runtime, [ids], max_new_tokens=n, sampling=SamplingParams(args.temperature),
                                  stop_token_ids=stops)
        tps = alone.stats.tokens_per_s
        say(f"target only, blockdraft runtime: {alone.stats.num_new_tokens} tokens, {tps:.1f} tok/s"
            + (f", output {'identical' if alone.tokens[0] == out else 'DIFFERENT'}" if greedy else ""))
        speedups.append(("target-only decoding on the same runtime", spec_tps / tps if tps else float("nan")))
    if engine.is_warm:
        say(f"after warm-up: {engine.compiles_after_warmup} kernels compiled, "
            f"{engine.captures_after_warmup} CUDA graphs captured")
    if ranks > 1:
        say("target only, Hugging Face generate: not run with --tp (each rank holds a shard of "
            "the target)")
        for what, x in speedups:
            say(f"speed-up over {what}: {x:.2f}x")
        return 0
    inp = torch.tensor([ids], dtype=torch.long, device=device)

    def hf(count: int) -> tuple[list[int], float]:
        start = time.perf_counter()
        with torch.inference_mode():
            ref = target.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=count,
                                  do_sample=not greedy, temperature=args.temperature if not greedy else None,
                                  eos_token_id=stops, pad_token_id=stops[0] if stops else 0)
        sync(device)
        return ref[0, len(ids):].tolist(), time.perf_counter() - start

    hf(warm)
    ref_out, elapsed = hf(n)
    hf_tps = len(ref_out) / elapsed if elapsed > 0 else 0.0
    print(f"target only, Hugging Face generate: {len(ref_out)} tokens, {hf_tps:.1f} tok/s"
          + (f", output {'identical' if ref_out == out else 'DIFFERENT'}" if greedy else ""))
    speedups.append(("Hugging Face generate", spec_tps / hf_tps if hf_tps else float("nan")))
    for what, x in speedups:
        print(f"speed-up over {what}: {x:.2f}x")
    return 0


def add_generate_command(sub: Any) -> None:
    gen = sub.add_parser("generate", help="speculative generation with a DFlash drafter")
    gen.add_argument("prompt", nargs="?", default=None, help=f"text to continue (default {DEFAULT_PROMPT!r})")
    gen.add_argument("--target", default=None, help="target model directory (HF format)")
    gen.add_argument("--drafter", default=None, help="DFlash drafter directory")
    gen.add_argument("--compare", action="store_true", help="also decode with the target alone")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    gen.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    gen.add_argument("--no-warmup", action="store_true",
                     help="skip the warm-up (kernel compiles and CUDA graph captures for every "
                          "shape); for development: cold paths then land in the timings")
    gen.add_argument("--tp", type=int, default=None, metavar="N",
                     help="split the target over N ranks (tensor parallelism; starts N processes, "
                          "or the ranks torchrun started)")
    gen.set_defaults(func=run_generate)
