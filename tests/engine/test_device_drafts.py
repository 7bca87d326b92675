"""Greedy drafts left on the device into the verify (``BLOCKDRAFT_DEVICE_DRAFTS``): the tokens
equal target-only decoding's whichever path a step takes (on the device, read between drafter
and verify, declined part way), and the runtime's verify of device drafts equals its verify of
the same tokens from the host. The static graph path runs the graph buffers eagerly on the CPU,
so these tests cover the bookkeeping the CUDA graphs replay."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import blockdraft.pretrained
from blockdraft._core import ConfigError
from blockdraft.engine import SpeculativeEngine
from blockdraft.levers import ENV_BATCH_PROPOSE, ENV_DEVICE_DRAFTS, read_device_drafts
from blockdraft.proposer import DFlashProposer
from blockdraft.sampling import SamplingParams
from blockdraft.target.backend import RuntimeTarget

TARGET, DRAFTER, _TOKENIZER = blockdraft.pretrained.builtin_pair(device="cpu", dtype=torch.float32)
# Held-out prompts the trained pair drafts well for (several drafts accepted per step), cut to
# ragged lengths.
PROMPTS = [p[: 9 + 7 * i] for i, p in enumerate(blockdraft.pretrained.heldout_prompts()[:5])]
NEW = 24


def engine(**kw: Any) -> SpeculativeEngine:
    kw = {"runtime": "blockdraft", "max_seq_len": 160, "max_active": 8, "graphs": "static",
          "draft_length": 15, **kw}
    return SpeculativeEngine(TARGET, DRAFTER, **kw)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with engine(speculate=False) as off:
        return [list(t) for t in off.generate(PROMPTS, max_new_tokens=NEW).tokens]


class Spy:
    """Counts the steps whose verify took drafts on the device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.drafted = 0
        real = RuntimeTarget.verify_drafted

        def counted(target: RuntimeTarget, *a: Any, **k: Any) -> Any:
            self.drafted += 1
            return real(target, *a, **k)

        monkeypatch.setattr(RuntimeTarget, "verify_drafted", counted)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    yield Spy(monkeypatch)


def test_the_lever_reads_a_boolean() -> None:
    assert read_device_drafts({}) is True
    assert read_device_drafts({ENV_DEVICE_DRAFTS: "off"}) is False
    assert read_device_drafts({ENV_DEVICE_DRAFTS: " ON "}) is True
    with pytest.raises(ConfigError, match=ENV_DEVICE_DRAFTS):
        read_device_drafts({ENV_DEVICE_DRAFTS: "sometimes"})


def test_only_a_runtime_with_graphs_takes_drafts_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    with engine() as eng:
        assert eng.device_drafts
    with engine(graphs="off") as eng:
        assert not eng.device_drafts
    with engine(runtime="hf") as eng:
        assert not eng.device_drafts
    with engine(speculate=False) as eng:
        assert not eng.device_drafts
    monkeypatch.setenv(ENV_DEVICE_DRAFTS, "off")
    with engine() as eng:
        assert not eng.device_drafts


@pytest.fixture(scope="module")
def host_steps() -> list[list[int]]:
    """Each request's tokens per step with the drafts read between drafter and verify."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DEVICE_DRAFTS, "off")
        with engine() as eng:
            return [list(a) for a in eng.generate(PROMPTS, max_new_tokens=NEW).stats.acceptance_lengths]


@pytest.mark.parametrize("width", ["16", "2", "1"])
def test_greedy_tokens_equal_target_only_decoding(
    width: str, reference: list[list[int]], host_steps: list[list[int]], spy: Spy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Width 2 and 1: a step's drafts come from several proposals into one graph bucket, each
    # kept apart from the next replay over the bucket's output.
    monkeypatch.setenv(ENV_BATCH_PROPOSE, width)
    with engine() as eng:
        got = eng.generate(PROMPTS, max_new_tokens=NEW)
        assert [list(t) for t in got.tokens] == reference
        # Any drafts give the target's tokens; the same drafts give the same steps.
        assert [list(a) for a in got.stats.acceptance_lengths] == host_steps
        assert got.stats.mean_tau > 2.0  # the drafts were accepted, not only the target's tokens
        assert eng.pages_used() == {"target": 0, "drafter": 0}
    assert spy.drafted >= NEW // 15


def test_the_lever_off_reads_drafts_before_the_verify(
    reference: list[list[int]], spy: Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_DEVICE_DRAFTS, "off")
    with engine() as eng:
        assert [list(t) for t in eng.generate(PROMPTS, max_new_tokens=NEW).tokens] == reference
    assert spy.drafted == 0


def test_steps_with_ragged_draft_counts_read_their_drafts(reference: list[list[int]], spy: Spy) -> None:
    # The adaptive policy and the requests' last tokens ask for different counts: those steps
    # take the host's path, the others the device's.
    with engine(draft_length="adaptive") as eng:
        assert [list(t) for t in eng.generate(PROMPTS, max_new_tokens=NEW).tokens] == reference


def test_a_sampled_request_in_the_step_keeps_drafts_on_the_host(reference: list[list[int]], spy: Spy) -> None:
    with engine() as eng:
        greedy = eng.submit(PROMPTS[0], max_new_tokens=NEW)
        eng.submit(PROMPTS[1], max_new_tokens=NEW, sampling=SamplingParams(temperature=0.8), seed=5)
        list(eng.stream())
        assert eng.request(greedy).out == reference[0]
    assert spy.drafted == 0


def test_a_group_declined_part_way_is_drafted_on_the_host(
    reference: list[list[int]], spy: Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_BATCH_PROPOSE, "2")
    calls = {"n": 0}
    real = DFlashProposer.propose_on_device

    def second_declines(prop: DFlashProposer, *a: Any, **k: Any) -> Any:
        calls["n"] += 1
        return None if calls["n"] % 3 == 2 else real(prop, *a, **k)

    monkeypatch.setattr(DFlashProposer, "propose_on_device", second_declines)
    with engine() as eng:
        got = eng.generate(PROMPTS, max_new_tokens=NEW)
        assert [list(t) for t in got.tokens] == reference
        assert eng.pages_used() == {"target": 0, "drafter": 0}
    assert calls["n"] > 3


@pytest.mark.parametrize("graphs", ["static", "off"])
def test_the_runtime_verifies_device_drafts_as_host_tokens(graphs: str) -> None:
    with engine(graphs=graphs) as eng:
        rt = eng.runtime
        assert rt is not None
        prompts = [PROMPTS[0], PROMPTS[2]]
        drafts = torch.tensor([[(31 * i + 7 * j) % 500 for j in range(15)] for i in range(2)])
        outs = []
        for on_device in (True, False):
            seqs = [rt.new_sequence(64) for _ in prompts]
            rt.prefill(seqs, prompts)
            anchors = [p[-1] for p in prompts]
            if on_device:
                out = rt.forward_drafted(seqs, anchors, drafts)
            else:
                out = rt.forward(seqs, [[a, *d] for a, d in zip(anchors, drafts.tolist())])
            assert out.ctx_rows is not None
            outs.append((out.logits.clone(), out.ctx_rows.clone()))
            assert [s.pending for s in seqs] == [16, 16]
            rt.free(seqs)
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)
        seqs = [rt.new_sequence(64) for _ in prompts]
        try:
            with pytest.raises(ValueError, match="one row of drafts per sequence"):
                rt.forward_drafted(seqs, [1, 2], drafts[:1])
            with pytest.raises(ValueError, match="vocabulary"):
                rt.forward_drafted(seqs, [1, 10**9], drafts)
            assert [s.pending for s in seqs] == [0, 0]
        finally:
            rt.free(seqs)
