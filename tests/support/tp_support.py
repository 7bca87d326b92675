"""What the tensor-parallel tests run on every rank (module level: each rank is a fresh
interpreter that imports these functions by name), and the pair the CLI tests save.

Each function takes the rank's :class:`~blockdraft.parallel.TPGroup` first, as
:func:`blockdraft.parallel.launch` calls it; the tests call the same functions with a group
of one for the TP = 1 reference, so both sides run the same code.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

import blockdraft
from blockdraft import ConfigError, SamplingParams, SpeculativeEngine, TargetRuntime
from blockdraft.parallel import TPGroup

from support.runtime_models import VOCAB, make_target
from support.tinypair import drafter_config, tiny_drafter, tiny_target

PROMPTS = [[3], [5, 9, 11, 2, 60, 7, 7, 1, 40], [(7 * i + 3) % VOCAB for i in range(23)]]
def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


RUNTIME_CASES = ["qwen3", "llama-gqa3", "qwen3-mha-tied", "qwen3-sliding", "mistral-sliding-gqa4",
                 "llama-bias-gqa"]
"""Head counts and intermediate sizes that 2 divides: GQA 2:1 and 3:1, MHA with tied
embeddings, sliding windows, Mistral's head_dim != hidden / heads, o/down biases."""

ENGINE_PROMPTS = [[1, 2, 3, 4, 5], [7], [(3 * i + 1) % 60 for i in range(19)], [9, 8, 7, 6]]


def runtime_case(group: TPGroup, name: str) -> dict[str, Any]:
    """A ragged prefill in chunks over pages of 4, then a 4-row verify block per sequence, then
    greedy decoding: logits, captured rows, tokens and every page table along the way."""
    model = make_target(name)
    rt = TargetRuntime(model, num_pages=40, page_size=4, backend="torch", capture_layers=[0, 2],
                       prefill_chunk=7, tp=group)
    seqs = [rt.new_sequence(len(p) + 4) for p in PROMPTS]
    rows: list[torch.Tensor] = []
    last = rt.prefill(seqs, PROMPTS, on_chunk=lambda i, s, r: rows.append(r.clone()))
    pages = [[list(s.pages) for s in seqs]]
    rt.check_replicas(seqs)
    blocks = [[(5 * k + j) % VOCAB for j in range(4)] for k in range(len(PROMPTS))]
    out = rt.forward(seqs, blocks, logits="all")
    rt.check_replicas(seqs)
    rt.accept(seqs, [1, 4, 2])
    rt.check_replicas(seqs)
    pages.append([list(s.pages) for s in seqs])
    rt.free(seqs)
    free_after = rt.pool.num_free
    again = TargetRuntime(model, num_pages=30, page_size=4, tp=group)
    decoded = blockdraft.decode(again, PROMPTS, max_new_tokens=10).tokens
    torch.manual_seed(1000 + group.rank)  # ranks whose global random state differs
    sampled = blockdraft.decode(again, PROMPTS, max_new_tokens=10, sampling=SamplingParams(1.0)).tokens
    return {"sampled": sampled, "last": last.clone(), "verify": out.logits.clone(), "rows": torch.cat(rows),
            "pages": pages, "free": (free_after, rt.pool.num_pages), "decoded": decoded,
            "num_kv_heads": rt.spec.num_kv_heads, "qkv_rows": rt.forward_pass._layers[0].qkv.shape[0]}


def engine_case(group: TPGroup, kind: str) -> dict[str, Any]:
    """The speculative engine on a tiny pair: greedy requests admitted two at a time (more
    wait), the pages of every running request compared across ranks after every step; then
    sampled requests (a seed each, and none: the engine's own per-request seeds)."""
    target = tiny_target(kind)
    drafter = tiny_drafter(drafter_config(block=4))
    engine = SpeculativeEngine(target, drafter, max_seq_len=64, max_active=2, page_size=4,
                               num_pages=64, max_batch=2, backend="torch", graphs="static",
                               tp=group)
    rt = engine.runtime
    assert rt is not None
    rids = [engine.submit(p, max_new_tokens=12) for p in ENGINE_PROMPTS]
    used: list[tuple[int, int]] = []
    while any(not engine.request(r).status.ended for r in rids):
        engine.step()
        running = [engine.request(r) for r in rids if engine.request(r).target_seq is not None]
        rt.check_replicas([r.target_seq for r in running])
        used.append((engine.pages_used()["target"], engine.pages_used()["drafter"]))
    greedy = [list(engine.request(r).out) for r in rids]
    seeded = engine.generate(ENGINE_PROMPTS[:2], max_new_tokens=10, sampling=SamplingParams(1.0),
                             generator=torch.Generator().manual_seed(5)).tokens
    torch.manual_seed(1000 + group.rank)  # ranks whose global random state differs
    unseeded = engine.generate(ENGINE_PROMPTS[:2], max_new_tokens=10, sampling=SamplingParams(1.0)).tokens
    return {"greedy": greedy, "seeded": seeded, "unseeded": unseeded, "used": used,
            "end": engine.pages_used(), "total": engine.pages_total()}


def refusals(group: TPGroup) -> dict[str, str]:
    """The errors of targets that ``group`` cannot split, and of a sharded model reused
    without its group."""
    out: dict[str, str] = {}
    for name in ("llama-mqa-bias",):  # one K/V head
        try:
            TargetRuntime(make_target(name), num_pages=4, page_size=4, tp=group)
        except ConfigError as exc:
            out[name] = str(exc)
    model = make_target("qwen3")
    TargetRuntime(model, num_pages=4, page_size=4, tp=group)
    try:
        TargetRuntime(model, num_pages=4, page_size=4)
    except ConfigError as exc:
        out["sharded"] = str(exc)
    return out


def everything(group: TPGroup) -> dict[str, Any]:
    """Every case above on one group (one launch for the whole parity suite)."""
    return {
        "runtime": {name: runtime_case(group, name) for name in RUNTIME_CASES},
        "engine": {kind: engine_case(group, kind) for kind in ("qwen3", "llama")},
        "refusals": refusals(group) if group.size > 1 else {},
        "rank": group.rank,
    }


def skinny_gemm_case(group: TPGroup, name: str) -> tuple[list[list[int]], int]:
    """Greedy decoding with ``BLOCKDRAFT_SKINNY_GEMM`` on (set in this rank's process) on the
    Triton backend: the tokens, and how many projections ran on the streaming kernels."""
    import dataclasses

    from blockdraft.levers import ENV_SKINNY_GEMM

    os.environ[ENV_SKINNY_GEMM] = "on"
    rt = TargetRuntime(make_target(name), num_pages=40, page_size=4, backend="triton", tp=group)
    proj = rt.forward_pass.proj
    calls = [0]

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls[0] += 1
        return ops.linear(x, w, b)

    ops = proj.ops
    proj.ops = dataclasses.replace(ops, linear=counted)
    return blockdraft.decode(rt, PROMPTS, max_new_tokens=6).tokens, calls[0]


def decode_until_killed(group: TPGroup, pid_dir: str) -> None:
    """Decode forever; after the first forward each rank writes its pid to
    ``pid_dir/rank<r>`` (the test kills one of them mid-run)."""
    model = make_target("qwen3")
    rt = TargetRuntime(model, num_pages=40, page_size=4, tp=group)
    started = False
    while True:
        blockdraft.decode(rt, [PROMPTS[2]], max_new_tokens=30)
        if not started:
            path = Path(pid_dir) / f"rank{group.rank}"
            path.with_suffix(".tmp").write_text(str(os.getpid()))
            path.with_suffix(".tmp").rename(path)
            started = True
        time.sleep(0.01)


def fail_on_rank(group: TPGroup, rank: int) -> None:
    """Rank ``rank`` raises; the others wait on it in a collective."""
    group.barrier()
    if group.rank == rank:
        raise ValueError(f"boom on rank {rank}")
    group.all_reduce_(torch.ones(1))
    time.sleep(600)


def symptom_before_cause(group: TPGroup, cause: str) -> None:
    """Rank 0 fails at once as a collective does when its peer is gone; rank 1, the cause,
    ends half a second later (``cause``: ``"kill"``, SIGKILL to itself, or ``"raise"``), so the
    launcher sees the symptom first."""
    group.barrier()
    if group.rank == 0:
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Read error: Connection reset by peer")
    time.sleep(0.5)
    if cause == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError("the cause, on rank 1")


def save_pair(root: Path) -> tuple[Path, Path]:
    """The tiny random pair (hidden size 32, 4 heads over 2 K/V heads) as a target directory
    with a word-level tokenizer (``w0`` .. ``w63``) and a drafter directory."""
    import json

    from safetensors.torch import save_file

    from support.tinypair import tiny_drafter_shape
    from support.words import word_tokenizer

    tdir, ddir = root / "target", root / "drafter"
    tiny_target().save_pretrained(tdir)
    word_tokenizer(64).save_pretrained(tdir)
    ddir.mkdir()
    (ddir / "config.json").write_text(json.dumps(tiny_drafter_shape().config_dict()))
    drafter = tiny_drafter(drafter_config())
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(ddir / "model.safetensors"))
    return tdir, ddir
