"""The proposer's fast path: the fused drafter view and the precompute inside the graph.

``FastDrafter`` (stacked q/k/v and gate/up weights, fused norm/RoPE/SwiGLU steps) must compute
the reference ``forward_block`` in fp32, with its torch steps and with its Triton kernels (run by
the interpreter here). The graph path with the ctx K/V precompute captured (``graphs="static"``
runs the same buffers eagerly) must draft exactly what the plain path drafts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from blockdraft import DFlashProposer, kernels
from blockdraft.kernels import triton_available
from blockdraft.models.attention import ReferenceAttend
from blockdraft.proposer.fast import FastDrafter

from support.tinypair import drafter_config, tiny_dflash2, tiny_drafter, tiny_target

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="Triton is not importable here"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_forward_equals_the_reference_forward_in_fp32(backend: str) -> None:
    drafter = tiny_drafter(drafter_config(block=4, layers=2))
    fast = FastDrafter.from_drafter(drafter, kernels.ops(backend))  # type: ignore[arg-type]
    assert fast is not None
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 7, 64, generator=gen)
    ctx_pos = [torch.arange(7), torch.arange(3, 10)]
    kv = [drafter.context_kv(drafter.fuse_context(ctx[i]), ctx_pos[i]) for i in range(2)]
    embeds = torch.randn(2, 4, 32, generator=gen)
    block_pos = torch.stack([torch.arange(7, 11), torch.arange(10, 14)])
    attend = ReferenceAttend(drafter.config, kv, ctx_pos, block_pos)
    want = drafter.forward_block(embeds, block_pos, attend)
    got = fast.forward_block(embeds, block_pos, attend)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(fast.fuse_context(ctx[0]), drafter.fuse_context(ctx[0]),
                               atol=2e-6, rtol=1e-5)
    # The view copies the weights: the reference drafter is unchanged and keeps its modules.
    assert fast.qkv_weight[0].shape == (4 * 8 + 2 * 2 * 8, 32)
    assert fast.gate_up_weight[1].shape == (2 * 48, 32)


@pytest.mark.skipif(not triton_available(), reason="Triton is not importable here")
@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_fast_forward_on_the_streaming_gemms_equals_the_reference(blocks: int) -> None:
    """With the weight-streaming GEMMs on (fp32 under the interpreter), a block of at most 16
    rows (one sequence) runs its projections on them and computes the reference forward; more
    rows take ``F.linear``."""
    import dataclasses

    from blockdraft.kernels.projections import Projections

    calls = {"linear": 0, "linear_silu_mul": 0}
    ops = kernels.ops("triton")

    def counted(name: str) -> Any:
        real = getattr(ops, name)

        def call(*a: Any, **k: Any) -> Any:
            calls[name] += 1
            return real(*a, **k)

        return call

    ops = dataclasses.replace(ops, linear=counted("linear"), linear_silu_mul=counted("linear_silu_mul"))
    drafter = tiny_drafter(drafter_config(block=8, layers=2))
    fast = FastDrafter.from_drafter(drafter, ops, Projections(ops, True))
    assert fast is not None
    gen = torch.Generator().manual_seed(blocks)
    ctx = torch.randn(blocks, 7, 64, generator=gen)
    ctx_pos = [torch.arange(7) for _ in range(blocks)]
    kv = [drafter.context_kv(drafter.fuse_context(ctx[i]), ctx_pos[i]) for i in range(blocks)]
    embeds = torch.randn(blocks, 8, 32, generator=gen)
    block_pos = torch.stack([torch.arange(7, 15) for _ in range(blocks)])
    attend = ReferenceAttend(drafter.config, kv, ctx_pos, block_pos)
    want = drafter.forward_block(embeds, block_pos, attend)
    got = fast.forward_block(embeds, block_pos, attend)
    torch.testing.assert_close(got, want, atol=5e-6, rtol=1e-5)
    # 8 rows per sequence: two sequences stream (3 projections and the gate/up per layer).
    streamed = blocks * 8 <= 16
    assert calls == ({"linear": 3 * 2, "linear_silu_mul": 2} if streamed else {"linear": 0, "linear_silu_mul": 0})


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize(("heads", "kv_heads", "rows"), [(6, 3, 5), (8, 1, 1), (4, 4, 3)])
def test_qk_norm_rope_head_groups(backend: str, heads: int, kv_heads: int, rows: int) -> None:
    """Head counts that do not fill the kernel's groups of 8 (12, 10 and 12 heads), through the
    drafter's fused view against its torch view (the torch view against itself would prove nothing)."""
    drafter = tiny_drafter(drafter_config(extra={
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 8}))
    ref = FastDrafter.from_drafter(drafter, kernels.ops("torch"))
    fast = FastDrafter.from_drafter(drafter, kernels.ops(backend))  # type: ignore[arg-type]
    assert ref is not None and fast is not None
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * 8, generator=gen)
    pos = torch.randint(0, 300, (rows,), generator=gen)
    for got, want in zip(fast.qk_norm_rope(qkv, pos, 0), ref.qk_norm_rope(qkv, pos, 0)):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_only_dflash_drafters_have_a_fused_view() -> None:
    assert FastDrafter.from_drafter(object(), kernels.ops("torch")) is None


def _steps(prop: DFlashProposer, eager_calls: list[int], on_device: bool = False) -> list[list[list[int]]]:
    """3 sequences: a long first commit (stored before the forward: ``store_plans`` on the
    plain path, ``store_long_plans`` on the graph path), then 1..4 rows per step (staged).
    ``on_device``: every proposal through ``propose_on_device``, its tensor read back."""
    fwd = prop.forward
    plain_store, long_store = fwd.store_plans, fwd.store_long_plans

    def counting(items: Any) -> None:
        eager_calls.append(len(items))
        plain_store(items)

    def counting_long(items: Any) -> None:
        eager_calls.append(len(items))
        long_store(items)

    fwd.store_plans = counting  # type: ignore[method-assign]
    fwd.store_long_plans = counting_long  # type: ignore[method-assign]
    rows = torch.randn(200, 64, generator=torch.Generator().manual_seed(5))
    states = [prop.alloc_state_for(80) for _ in range(3)]
    pos = [11, 5, 17]
    for i, st in enumerate(states):
        prop.commit_ctx(st, rows[: pos[i]], range(pos[i]))
    out = []
    for step in range(8):
        idx = [0, 1, 2] if step % 2 else [step % 3]
        toks = [(step * 5 + i) % 60 for i in idx]
        if on_device:
            drafts = prop.propose_on_device([states[i] for i in idx], toks, [pos[i] for i in idx], 3)
            assert drafts is not None and drafts.dtype == torch.int64
            assert tuple(drafts.shape) == (len(idx), 3)
            out.append(drafts.tolist())
        elif len(idx) == 1:
            out.append([prop.propose(states[idx[0]], toks[0], pos[idx[0]], 3)])
        else:
            got = prop.propose_batch([states[i] for i in idx], toks, [pos[i] for i in idx], 3)
            assert got is not None
            out.append(got)
        for i in idx:
            prop.after_verify(states[i], 0)
            k = 1 + (step + i) % 4  # 1..B rows: the steady state's accepted + 1
            prop.commit_ctx(states[i], rows[pos[i] : pos[i] + k], range(pos[i], pos[i] + k))
            pos[i] += k
    for st in states:
        prop.free_state(st)
    return out


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_drafts_on_the_device_are_the_listed_drafts(graphs: str) -> None:
    """``propose_on_device`` (one sequence or several, graph path or plain) drafts what
    ``propose`` / ``propose_batch`` draft, as a tensor; it declines what ``propose_batch``
    declines, leaving the states as they were."""
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(block=4, layers=2))

    def make(mode: str) -> DFlashProposer:
        return DFlashProposer(drafter, target, max_seq_len=120, num_pages=90, page_size=4,
                              max_batch=4, graphs=mode, backend="torch")  # type: ignore[arg-type]

    assert _steps(make(graphs), [], on_device=True) == _steps(make("off"), [])
    prop = make(graphs)
    states = [prop.alloc_state_for(40) for _ in range(5)]
    for st in states:
        prop.commit_ctx(st, torch.randn(6, 64), range(6))
    free = prop.pool.num_free
    assert prop.propose_on_device(states, [1] * 5, [6] * 5, 3) is None  # past max_batch
    assert prop.propose_on_device(states[:2], [1], [6, 6], 3) is None  # lengths differ
    assert prop.propose_on_device(states[:2], [1, 2], [6, 6], 0) is None  # no drafts wanted
    assert prop.pool.num_free == free
    got = prop.propose_on_device(states[:1], [1], [6], 2)
    assert got is not None and tuple(got.shape) == (1, 2)
    for st in states:
        prop.free_state(st)


@pytest.mark.parametrize("backend", BACKENDS)
def test_precompute_in_the_graph_gives_the_plain_drafts(backend: str) -> None:
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(block=4, layers=2))

    def make(graphs: str, be: str) -> DFlashProposer:
        return DFlashProposer(drafter, target, max_seq_len=120, num_pages=90, page_size=4,
                              max_batch=4, graphs=graphs, backend=be)  # type: ignore[arg-type]

    plain_eager: list[int] = []
    plain = _steps(make("off", "torch"), plain_eager)
    static_prop = make("static", backend)
    runner = static_prop.graph_runner
    assert runner is not None and runner.forward.fused_view() is not None
    launches: list[tuple[int, int, int]] = []
    real_launch = runner.launch

    def recording(bucket: Any, n: int, cap: int) -> Any:
        launches.append((bucket.size, bucket.meta.staged, cap))
        return real_launch(bucket, n, cap)

    runner.launch = recording  # type: ignore[method-assign]
    graph_eager: list[int] = []
    graph = _steps(static_prop, graph_eager)
    assert graph == plain
    # Each call stores its staged rows' K/V with the smallest capacity holding them (1, 4 or
    # B rows per sequence of the bucket); both small and full capacities were exercised.
    for size, staged, cap in launches:
        assert cap == min(c for c in runner.stage_caps(size) if c >= staged)
    assert {cap < size * 4 for size, _, cap in launches} == {True, False}
    # The plain path stores every call eagerly; the graph path only the long first plans (one
    # per sequence), the steady-state rows are stored by the (captured) forward.
    assert len(plain_eager) == 8
    assert sum(graph_eager) == 3
    # The last call (step 7, n=3 -> bucket 4) staged 3 + 3 + 4 rows (commits of steps 5 and 6).
    bucket = runner.bucket(4)
    assert bucket is not None and bucket.meta.staged == 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_staging_after_double_commits_and_slides(backend: str) -> None:
    """The graph path stages the last commit's rows through the view kept at commit time; when
    the plan covers more (two commits since the last proposal) or the window slid, it reads the
    accumulator instead. Either way: the plain path's drafts."""
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(block=4, layers=2))

    def run(graphs: str) -> tuple[list[list[list[int]]], int]:
        prop = DFlashProposer(drafter, target, max_seq_len=40, num_pages=60, page_size=4,
                              max_batch=2, graphs=graphs, backend=backend)  # type: ignore[arg-type]
        rows = torch.randn(400, 64, generator=torch.Generator().manual_seed(9))
        states = [prop.alloc_state_for(12), prop.alloc_state_for(30)]  # windows 17 and 35
        pos = [0, 0]
        out = []
        fresh_hits = 0
        for step in range(14):
            for i, st in enumerate(states):
                commits = 2 if (step + i) % 3 == 0 else 1
                for _ in range(commits):
                    k = 1 + (step * 7 + i) % 3
                    prop.commit_ctx(st, rows[pos[i] : pos[i] + k], range(pos[i], pos[i] + k))
                    pos[i] += k
                fresh = st.kept_range
                plan_start = st.ctx.ctx_committed
                fresh_hits += int(fresh is not None and fresh[0] == plan_start)
            got = prop.propose_batch(states, [3, 5], list(pos), 3)
            assert got is not None
            out.append(got)
            for st in states:
                prop.after_verify(st, 0)
        for st in states:
            prop.free_state(st)
            assert st.kept_range is None
        return out, fresh_hits

    plain, _ = run("off")
    graph, hits = run("static")
    assert graph == plain
    assert 0 < hits < 28  # both the kept view and the accumulator read were used


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_path_declining_a_wide_table_leaves_no_stale_staging(backend: str) -> None:
    """A call whose page table is wider than the graphs falls back to the plain path before
    anything is staged. The bucket's staged entries from before must still be cleared by its
    next graph call: here they name slots of a freed sequence whose pages a new sequence now
    holds, and storing them again would overwrite the new sequence's K/V with old rows.
    Drafts equal the plain path's throughout."""
    from blockdraft.proposer import GraphRunner

    target = tiny_target()
    drafter = tiny_drafter(drafter_config(block=4, layers=2))
    rows = torch.randn(400, 64, generator=torch.Generator().manual_seed(21))

    def run(graphs: str) -> list[list[list[int]]]:
        # 11 pages: a and b at their largest take 10; the pool hands a's freed ones to e
        prop = DFlashProposer(drafter, target, max_seq_len=120, num_pages=11, page_size=4,
                              max_batch=2, graphs=graphs, backend=backend)  # type: ignore[arg-type]
        if graphs == "static":
            # graphs 4 pages wide: longer tables take the plain path
            prop.graph_runner = GraphRunner(prop.forward, "static", ceiling=16, max_batch=2)
        st = {k: prop.alloc_state_for(100) for k in "ab"}
        pos = dict.fromkeys("abe", 0)
        out: list[list[list[int]]] = []

        def commit(k: str, n: int, at: int = 0) -> None:
            prop.commit_ctx(st[k], rows[at + pos[k] : at + pos[k] + n], range(pos[k], pos[k] + n))
            pos[k] += n

        def batch(keys: str) -> None:
            got = prop.propose_batch([st[k] for k in keys], [7] * len(keys), [pos[k] for k in keys], 3)
            assert got is not None
            out.append(got)
            for k in keys:
                prop.after_verify(st[k], 0)

        commit("a", 3)
        commit("b", 3)
        batch("ba")  # graph path: 6 staged rows
        commit("a", 4)
        commit("b", 4)
        batch("ba")  # graph path: b's rows are staged entries 0..3, a's 4..7 (meta row 1)
        commit("a", 20)  # a is now wider than the graphs
        commit("b", 1)
        batch("ba")  # plain path; the bucket's staged entries are still those of a and b
        prop.free_state(st["a"])
        st["e"] = prop.alloc_state_for(100)
        commit("e", 13, at=200)  # 4 pages, the first free ones: a's
        out.append([prop.propose(st["e"], 5, pos["e"], 3)])
        prop.after_verify(st["e"], 0)
        commit("e", 1, at=200)
        commit("b", 2)
        batch("eb")  # graph path, 3 staged rows: capacity 8 would reach a's old entries
        commit("e", 1, at=200)
        commit("b", 1)
        batch("be")
        for k in "be":
            prop.free_state(st[k])
        assert prop.pool.num_free == prop.pool.num_pages
        return out

    assert run("static") == run("off")


@pytest.mark.parametrize("graphs", ["static", "off"])
def test_drafts_without_autograd_whether_or_not_the_caller_has_it_on(graphs: str) -> None:
    """The draft forward runs without autograd: under the caller's ``enable_grad`` (it enters
    ``no_grad`` itself) and under ``inference_mode`` (nothing to enter); same drafts."""
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(block=4, layers=1))
    for p in drafter.parameters():
        p.requires_grad_(True)  # as a drafter loaded outside inference code would be
    rows = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))
    got = []
    for ctx in (torch.enable_grad, torch.inference_mode):
        prop = DFlashProposer(drafter, target, max_seq_len=40, num_pages=20, page_size=4,
                              graphs=graphs)  # type: ignore[arg-type]
        st = prop.alloc_state_for(20)
        with ctx():
            prop.commit_ctx(st, rows[:9], range(9))
            got.append(prop.propose(st, 3, 9, 3))
            prop.after_verify(st, 1)
            prop.commit_ctx(st, rows[9:11], range(9, 11))
            got.append(prop.propose(st, 4, 11, 3))
        assert prop.cache.k.grad_fn is None and not prop.cache.k.requires_grad
        prop.free_state(st)
    assert got[:2] == got[2:]


def test_stage_caps() -> None:
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(block=8, layers=1))
    prop = DFlashProposer(drafter, target, max_seq_len=64, num_pages=40, page_size=4,
                          max_batch=4, graphs="static")
    runner = prop.graph_runner
    assert runner is not None
    assert runner.stage_caps(1) == [1, 4, 8] and runner.stage_caps(4) == [4, 16, 32]
    assert [runner.stage_cap(4, k) for k in (0, 4, 5, 16, 17, 32)] == [4, 4, 16, 16, 32, 32]
    with pytest.raises(AssertionError):
        runner.stage_cap(4, 33)


def test_quick_bench_runs_on_the_tiny_shape() -> None:
    from blockdraft import bench as bd_bench
    from blockdraft import pair as bd_pair

    shape = bd_pair.SHAPES["tiny"]
    cpu = torch.device("cpu")
    target, drafter = bd_pair.random_pair(shape, cpu, torch.float32)
    recs = bd_bench.bench_quick(shape, drafter, target, cpu, cells=[(32, 1), (32, 2)], reps=2,
                                warmup=1)
    assert [(r["context"], r["batch"]) for r in recs] == [(32, 1), (32, 2)]
    assert all(r["latency_ms"]["median"] > 0 for r in recs)
    table = bd_bench.quick_markdown(recs)
    assert table.count("\n") == 4 and "| 32 | 2 |" in table


@pytest.mark.parametrize("backend", BACKENDS)
def test_dflash2_fast_forward_equals_the_reference_forward_in_fp32(backend: str) -> None:
    drafter = tiny_dflash2(block=5)
    fast = FastDrafter.from_drafter(drafter, kernels.ops(backend))  # type: ignore[arg-type]
    assert fast is not None and all(a is not None and m is not None for a, m in fast.convs)
    gen = torch.Generator().manual_seed(2)
    ctx = torch.randn(3, 6, 64, generator=gen)
    ctx_pos = [torch.arange(6), torch.arange(2, 8), torch.arange(9, 15)]
    kv = [drafter.context_kv(drafter.fuse_context(ctx[i]), ctx_pos[i]) for i in range(3)]
    embeds = torch.randn(3, 5, 32, generator=gen)
    block_pos = torch.stack([torch.arange(6, 11), torch.arange(8, 13), torch.arange(15, 20)])
    attend = ReferenceAttend(drafter.config, kv, ctx_pos, block_pos)
    want = drafter.forward_block(embeds, block_pos, attend)
    torch.testing.assert_close(fast.forward_block(embeds, block_pos, attend), want,
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dflash2_graph_path_gives_the_plain_drafts(backend: str) -> None:
    """DFlash2 drafts through the graph path's buffers (``graphs="static"``: the fused view,
    the selector walk from the metadata's anchors) equal the plain path's, at n = 1 and in
    the batched buckets (n = 3 -> bucket 4)."""
    target = tiny_target()
    drafter = tiny_dflash2(layers=1)

    def make(graphs: str, be: str) -> DFlashProposer:
        return DFlashProposer(drafter, target, max_seq_len=120, num_pages=90, page_size=4,
                              max_batch=4, graphs=graphs, backend=be)  # type: ignore[arg-type]

    plain = _steps(make("off", "torch"), [])
    static_prop = make("static", backend)
    runner = static_prop.graph_runner
    assert runner is not None
    launches: list[int] = []
    real_launch = runner.launch

    def recording(bucket: Any, n: int, cap: int) -> Any:
        launches.append(bucket.size)
        return real_launch(bucket, n, cap)

    runner.launch = recording  # type: ignore[method-assign]
    graph = _steps(static_prop, [])
    assert sorted(set(launches)) == [1, 4] and len(launches) == 8
    assert graph == plain
    # the drafts depend on the anchors (the selector's first predecessor): not a constant
    assert len({tuple(d) for step in plain for d in step}) > 3


def test_dflash2_plain_path_on_triton_gives_the_torch_drafts() -> None:
    """The plain path's select on the Triton backend (split top-K, kernel walk) drafts what the
    torch backend (``torch.topk``, the reference walk) does."""
    if not triton_available():
        pytest.skip("Triton is not importable here")
    target = tiny_target()
    drafter = tiny_dflash2(layers=1)
    got = {}
    for be in ("torch", "triton"):
        prop = DFlashProposer(drafter, target, max_seq_len=120, num_pages=90, page_size=4,
                              max_batch=4, graphs="off", backend=be)  # type: ignore[arg-type]
        assert prop.forward.ops.backend == be
        got[be] = _steps(prop, [])
    assert got["triton"] == got["torch"]
