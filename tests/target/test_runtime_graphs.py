"""The target runtime's CUDA-graph manager (``RuntimeGraphs``) on the CPU.

There are no CUDA graphs here: ``graphs="static"`` runs the graph path's fixed-shape buffers
eagerly, which checks the bookkeeping (which calls take the path, the bucket a call lands in,
the padding of the rows past ``n``) and that its outputs are the plain forward's. The
capture/replay bookkeeping is driven with a stand-in for the capture that records nothing and
reruns the forward on replay; real captures are checked in ``tests/gpu/test_runtime_gpu.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import blockdraft.target.runtime.graphs as graphs_module
from blockdraft import TargetRuntime, faults
from blockdraft._core import PAD_SLOT, ConfigError
from blockdraft.cuda_graphs import default_buckets, resolve_mode
from blockdraft.target.runtime.forward import ForwardBatch

from support.runtime_models import make_target

MODEL = make_target("qwen3")
CPU = torch.device("cpu")
PAGE = 4
BLOCK = 4
PROMPTS = [[1, 2, 3], [9, 8], [(5 * i + 2) % 60 for i in range(13)], [40], [7, 7, 7, 7, 7]]


def runtime(graphs: str, **kw: Any) -> TargetRuntime:
    args: dict[str, Any] = {"num_pages": 80, "page_size": PAGE, "max_seq_len": 40,
                            "max_batch": 5, "graph_rows": (BLOCK, 1, BLOCK),
                            "capture_layers": [0, 2], **kw}
    return TargetRuntime(MODEL, graphs=graphs, **args)  # type: ignore[arg-type]


def prefilled(rt: TargetRuntime, prompts: list[list[int]]) -> list[Any]:
    seqs = [rt.new_sequence(40) for _ in prompts]
    rt.prefill(seqs, prompts)
    return seqs


@dataclass
class Seen:
    """A copy of one :class:`ForwardBatch` the forward was given."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: torch.Tensor
    q_starts: list[int]
    kv_lens: list[int]
    max_rows: int
    logit_rows: torch.Tensor | None


def recording(rt: TargetRuntime, monkeypatch: pytest.MonkeyPatch) -> list[Seen]:
    """Every batch ``rt``'s forward runs from now on."""
    seen: list[Seen] = []
    real = rt.forward_pass.run

    def run(batch: ForwardBatch, capture: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(Seen(batch.input_ids.tolist(), batch.positions.tolist(), batch.slots.tolist(),
                         batch.page_tables.clone(), batch.q_starts.tolist(),
                         batch.kv_lens.tolist(), batch.max_rows,
                         None if batch.logit_rows is None else batch.logit_rows.clone()))
        return real(batch, capture)

    monkeypatch.setattr(rt.forward_pass, "run", run)
    return seen


def test_buckets_are_powers_of_two_and_the_most() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(2) == [1, 2]
    assert default_buckets(5) == [1, 2, 4, 5]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(9) == [1, 2, 4, 8, 9]
    assert default_buckets(32) == [1, 2, 4, 8, 16, 32]


def test_modes_off_cuda() -> None:
    """Off CUDA: ``auto`` and ``off`` give no graph path, ``capture`` is refused, ``static``
    keeps the fixed-shape buffers."""
    assert resolve_mode("auto", CPU) is None and resolve_mode("off", CPU) is None
    assert resolve_mode("static", CPU) == "static"
    with pytest.raises(ConfigError, match="CUDA"):
        resolve_mode("capture", CPU)
    with pytest.raises(ConfigError, match="'auto', 'capture', 'static' or 'off'"):
        resolve_mode("always", CPU)
    assert runtime("auto").graphs is None and runtime("off").graphs is None
    with pytest.raises(ConfigError, match="CUDA"):
        runtime("capture")
    static = runtime("static").graphs
    assert static is not None and static.mode == "static" and static.disabled is None


def test_accepts_up_to_the_most_sequences_of_the_graph_rows() -> None:
    graphs = runtime("static").graphs
    assert graphs is not None
    assert graphs.buckets == [1, 2, 4, 5]
    assert graphs.rows == (1, BLOCK)  # sorted, each once
    assert graphs.width == 10  # pages of max_seq_len 40
    for n in range(1, 6):
        assert graphs.accepts(n, 1) and graphs.accepts(n, BLOCK)
    assert not graphs.accepts(6, 1)
    for rows in (2, 3, BLOCK + 1):
        assert not graphs.accepts(1, rows)
    graphs.disabled = "off for this check"
    assert not graphs.accepts(1, 1)


@pytest.mark.parametrize("rows", [1, BLOCK])
def test_calls_land_in_the_smallest_bucket_with_padded_rows(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """n sequences run in the smallest bucket >= n; the rows past n are token 0 at position
    0 with ``PAD_SLOT``, one key, page 0; a smaller call after a larger one in the same
    bucket leaves nothing of the larger one behind."""
    rt = runtime("static")
    graphs = rt.graphs
    assert graphs is not None
    seqs = prefilled(rt, PROMPTS)
    seen = recording(rt, monkeypatch)
    for n, bucket in ((1, 1), (2, 2), (4, 4), (3, 4), (5, 5)):
        calls = graphs.calls
        tokens = [[(11 * i + j) % 60 for j in range(rows)] for i in range(n)]
        out = rt.forward(seqs[:n], tokens)
        assert graphs.calls == calls + 1
        assert out.logits.shape == (n * rows, rt.vocab_size)
        assert out.ctx_rows is not None and out.ctx_rows.shape[0] == n * rows
        b = seen[-1]
        m = n * rows
        assert len(b.kv_lens) == bucket and len(b.ids) == bucket * rows, (n, bucket)
        assert b.max_rows == rows and b.logit_rows is None
        assert b.q_starts == [i * rows for i in range(bucket + 1)]
        assert tuple(b.tables.shape) == (bucket, graphs.width)
        assert b.ids[:m] == [t for ts in tokens for t in ts]
        for i, seq in enumerate(seqs[:n]):
            pos = list(range(seq.length, seq.length + rows))
            assert b.positions[i * rows:(i + 1) * rows] == pos
            assert b.slots[i * rows:(i + 1) * rows] == [
                seq.pages[p // PAGE] * PAGE + p % PAGE for p in pos]
            assert b.kv_lens[i] == seq.length + rows
            # the pages of the tokens the forward reads (the rest of the row is never read)
            used = -(-(seq.length + rows) // PAGE)
            assert b.tables[i, :used].tolist() == list(seq.pages[:used])
        assert b.ids[m:] == [0] * (bucket * rows - m)
        assert b.positions[m:] == [0] * (bucket * rows - m)
        assert b.slots[m:] == [PAD_SLOT] * (bucket * rows - m)
        assert b.kv_lens[n:] == [1] * (bucket - n)
        assert not b.tables[n:].any()
        rt.accept(seqs[:n], [1] * n)
    rt.free(seqs)
    assert rt.pool.num_free == rt.pool.num_pages


def test_other_shapes_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uneven rows, rows without graphs, last-row logits of a verify and more sequences than
    the largest bucket take the plain forward (its own exact-size batch)."""
    rt = runtime("static", max_batch=2)
    graphs = rt.graphs
    assert graphs is not None and graphs.buckets == [1, 2]
    seqs = prefilled(rt, PROMPTS[:3])
    seen = recording(rt, monkeypatch)
    cases: list[tuple[list[Any], list[list[int]], str]] = [
        (seqs[:2], [[1], [2, 3]], "all"),  # uneven
        (seqs[:1], [[1, 2]], "all"),  # 2 rows: no graph of its own
        (seqs[:2], [[1] * BLOCK, [2] * BLOCK], "last"),  # a verify's rows, last logits only
        (seqs, [[1], [2], [3]], "all"),  # 3 sequences, buckets end at 2
    ]
    for some, tokens, logits in cases:
        out = rt.forward(some, tokens, logits=logits)
        b = seen[-1]
        assert len(b.ids) == sum(len(t) for t in tokens) and len(b.kv_lens) == len(some)
        assert out.logits.shape[0] == (len(some) if logits == "last" else len(b.ids))
        rt.accept(some, [0] * len(some))
    assert graphs.calls == 0
    # decode's last-row logits are every row: that takes the path
    rt.forward(seqs[:2], [[1], [2]], logits="last")
    assert graphs.calls == 1
    rt.free(seqs)


def test_static_path_gives_the_plain_forwards_outputs() -> None:
    """Decode and verify forwards of 1..5 sequences (every bucket, padded and not), with the
    rows accepted in between: the logits and captured rows of the fixed-shape path are the
    plain forward's."""
    static, plain = runtime("static"), runtime("off")
    s_seqs, p_seqs = prefilled(static, PROMPTS), prefilled(plain, PROMPTS)
    assert static.graphs is not None and plain.graphs is None
    step = 0
    for n in (5, 1, 3, 2, 4, 3):
        for rows in (1, BLOCK):
            tokens = [[(7 * step + 3 * i + j) % 60 for j in range(rows)] for i in range(n)]
            got = static.forward(s_seqs[:n], tokens)
            want = plain.forward(p_seqs[:n], tokens)
            assert got.logits.shape == want.logits.shape
            torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
            assert got.ctx_rows is not None and want.ctx_rows is not None
            torch.testing.assert_close(got.ctx_rows, want.ctx_rows, atol=1e-5, rtol=1e-5)
            keep = [1 + (step + i) % rows for i in range(n)]
            static.accept(s_seqs[:n], keep)
            plain.accept(p_seqs[:n], keep)
            step += 1
    assert static.graphs.calls == step
    assert [s.length for s in s_seqs] == [s.length for s in p_seqs]
    static.free(s_seqs)
    plain.free(p_seqs)


def test_a_fault_on_the_graph_path_leaves_nothing_pending() -> None:
    rt = runtime("static")
    assert rt.graphs is not None
    seqs = prefilled(rt, PROMPTS[:2])
    before = [s.length for s in seqs]
    with faults.inject("target_forward", 1) as plan, pytest.raises(Exception, match="fault injection"):
        rt.forward(seqs, [[1], [2]])
    assert plan.fired
    assert [s.length for s in seqs] == before and all(s.pending == 0 for s in seqs)
    plain = runtime("off")
    p_seqs = prefilled(plain, PROMPTS[:2])
    torch.testing.assert_close(rt.forward(seqs, [[1], [2]]).logits,
                               plain.forward(p_seqs, [[1], [2]]).logits, atol=1e-5, rtol=1e-5)
    rt.free(seqs)
    plain.free(p_seqs)


class _Rerun:
    """Stands in for a captured graph: a replay reruns the forward into its static output."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        with torch.inference_mode():  # as the runtime's forwards run
            self.out.copy_(self.fn())


def _capture_mode(rt: TargetRuntime, monkeypatch: pytest.MonkeyPatch,
                  capture: Callable[..., Any]) -> None:
    """Switch ``rt``'s graphs (buckets already made, unpinned, by static calls) to capture
    mode with ``capture`` in place of the CUDA one."""
    assert rt.graphs is not None
    monkeypatch.setattr(graphs_module, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    rt.graphs.mode = "capture"


def test_one_capture_per_bucket_then_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    rt, plain = runtime("static"), runtime("off")
    seqs, p_seqs = prefilled(rt, PROMPTS), prefilled(plain, PROMPTS)
    for n in (1, 3):  # make the buckets 1 and 4 of one row
        rt.forward(seqs[:n], [[1]] * n)
        rt.accept(seqs[:n], [0] * n)
    pools: list[Any] = []

    def fake_capture(fn: Callable[[], torch.Tensor], device: torch.device, pool: Any) -> Any:
        pools.append(pool)
        out = fn()
        return _Rerun(fn, out), out

    _capture_mode(rt, monkeypatch, fake_capture)
    graphs = rt.graphs
    assert graphs is not None
    for step, n in enumerate((1, 3, 4, 1, 3)):
        tokens = [[(5 * step + i) % 60] for i in range(n)]
        got = rt.forward(seqs[:n], tokens)
        want = plain.forward(p_seqs[:n], tokens)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        rt.accept(seqs[:n], [1] * n)
        plain.accept(p_seqs[:n], [1] * n)
    assert graphs.captures == 2 and graphs.replays == 5  # buckets 1 and 4 (n = 3 and 4)
    assert pools == ["pool", "pool"]  # one memory pool shared by every graph
    rt.free(seqs)
    plain.free(p_seqs)


def test_a_failed_capture_turns_the_graphs_off_for_good(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The call whose capture fails runs eagerly (right logits); later calls never try again."""
    rt, plain = runtime("static"), runtime("off")
    seqs, p_seqs = prefilled(rt, PROMPTS[:2]), prefilled(plain, PROMPTS[:2])
    rt.forward(seqs, [[1], [2]])
    rt.accept(seqs, [0, 0])

    def failing(fn: Callable[[], torch.Tensor], device: torch.device, pool: Any) -> Any:
        raise RuntimeError("no capture here")

    _capture_mode(rt, monkeypatch, failing)
    graphs = rt.graphs
    assert graphs is not None
    calls = graphs.calls
    with caplog.at_level("WARNING", logger="blockdraft.target.runtime.graphs"):
        got = rt.forward(seqs, [[1], [2]])
    want = plain.forward(p_seqs, [[1], [2]])
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert graphs.disabled == "CUDA graph capture failed: no capture here"
    assert "running eagerly" in caplog.text
    assert not graphs.accepts(2, 1) and graphs.captures == 0 and graphs.replays == 0
    rt.accept(seqs, [1, 1])
    plain.accept(p_seqs, [1, 1])
    got = rt.forward(seqs, [[3], [4]])
    torch.testing.assert_close(got.logits, plain.forward(p_seqs, [[3], [4]]).logits,
                               atol=1e-5, rtol=1e-5)
    assert graphs.calls == calls + 1
    rt.free(seqs)
    plain.free(p_seqs)
