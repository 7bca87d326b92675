"""Bad-input catalogue beyond the core: proposer, engine, checkpoints, environment levers, CLI.

(The core's own catalogue is ``test_core_bad_inputs.py``.) Every case gives a typed error whose
message names the offending argument, and changes nothing: the pool's bitmap, every state's
bookkeeping and accumulator rows are compared before and after. ``propose_batch`` never raises
by contract: its bad inputs must decline (``None``) and log the reason, also changing nothing.
The CLI turns every bad input into exit code 2 and one ``blockdraft: error:`` line naming it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from blockdraft import CheckpointError, ConfigError, InvalidStateError, SamplingParams
from blockdraft.checkpoint import load_drafter
from blockdraft.cli import main
from blockdraft.engine import SpeculativeEngine
from blockdraft.proposer import DFlashProposer, DFlashState

from support.scorecard import expect_clear_error, score
from support.tinypair import K_H, drafter_config, make_proposer, tiny_drafter, tiny_drafter_shape

WORDS = 2  # ceil(64 / 32) bitmask words of the tiny vocabulary


def make(drafter: Any, target: Any, **kw: Any) -> DFlashProposer:
    prop: DFlashProposer = make_proposer(drafter, target, **{"max_seq_len": 64, "num_pages": 32, **kw})
    return prop


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, K_H, generator=torch.Generator().manual_seed(n))


@dataclass
class World:
    """A proposer with two live states (one proposed once), a freed one, and a foreign one."""

    prop: DFlashProposer
    st: DFlashState
    st2: DFlashState
    freed: DFlashState
    foreign: DFlashState


def world(drafter: Any, target: Any) -> World:
    prop = make(drafter, target)
    st = prop.alloc_state_for(20)
    prop.commit_ctx(st, rows(5), range(5))
    prop.propose(st, 1, 5, 2)
    st2 = prop.alloc_state_for(20)
    prop.commit_ctx(st2, rows(3), range(3))
    freed = prop.alloc_state()
    prop.free_state(freed)
    other = make(drafter, target)
    foreign = other.alloc_state_for(10)
    other.commit_ctx(foreign, rows(2), [0, 1])
    return World(prop, st, st2, freed, foreign)


def snapshot(w: World) -> Any:
    pool = w.prop.pool
    states = []
    for s in (w.st, w.st2, w.freed, w.foreign):
        states.append(
            (
                s.freed,
                tuple(s.ctx_positions),
                s.ctx_committed,
                tuple(s.page_table),
                s.seq_len,
                s.last_num_drafted,
                s.last_num_accepted,
                None if s.acc is None else s.acc.clone(),
            )
        )
    return pool.num_free, tuple(pool.is_allocated(b) for b in range(pool.num_pages)), states


def unchanged(a: Any, b: Any) -> bool:
    if a[:2] != b[:2]:
        return False
    for x, y in zip(a[2], b[2]):
        if x[:-1] != y[:-1]:
            return False
        if (x[-1] is None) != (y[-1] is None) or (x[-1] is not None and not torch.equal(x[-1], y[-1])):
            return False
    return True


@dataclass(frozen=True)
class Case:
    name: str
    exc: type[BaseException]
    words: tuple[str, ...]
    call: Callable[[World], Any]


def mask(words: int, rows_: int | None = None, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    shape = (words,) if rows_ is None else (rows_, words)
    return torch.full(shape, -1, dtype=torch.int64).to(dtype)


API_CASES = [
    # alloc_state_for
    Case("budget negative", ValueError, ("budget_tokens",), lambda w: w.prop.alloc_state_for(-1)),
    Case("budget string", TypeError, ("budget_tokens",), lambda w: w.prop.alloc_state_for("8")),  # type: ignore[arg-type]
    Case("budget bool", TypeError, ("budget_tokens",), lambda w: w.prop.alloc_state_for(True)),
    Case("budget float", TypeError, ("budget_tokens",), lambda w: w.prop.alloc_state_for(8.0)),  # type: ignore[arg-type]
    # commit_ctx: hidden rows
    Case("rows wrong width", ValueError, ("hidden_rows",),
         lambda w: w.prop.commit_ctx(w.st2, torch.zeros(2, K_H + 1), [3, 4])),
    Case("rows 3-D", ValueError, ("hidden_rows",), lambda w: w.prop.commit_ctx(w.st2, torch.zeros(1, 2, K_H), [3, 4])),
    Case("rows 1-D", ValueError, ("hidden_rows",), lambda w: w.prop.commit_ctx(w.st2, torch.zeros(K_H), [3])),
    Case("rows integer dtype", TypeError, ("hidden_rows",),
         lambda w: w.prop.commit_ctx(w.st2, torch.zeros(2, K_H, dtype=torch.int32), [3, 4])),
    Case("rows bool dtype", TypeError, ("hidden_rows",),
         lambda w: w.prop.commit_ctx(w.st2, torch.zeros(2, K_H, dtype=torch.bool), [3, 4])),
    Case("rows a list", TypeError, ("hidden_rows",), lambda w: w.prop.commit_ctx(w.st2, [[0.0] * K_H], [3])),  # type: ignore[arg-type]
    Case("rows on another device", ValueError, ("hidden_rows",),
         lambda w: w.prop.commit_ctx(w.st2, torch.zeros(2, K_H, device="meta"), [3, 4])),
    # commit_ctx: positions
    Case("fewer positions than rows", ValueError, ("positions",), lambda w: w.prop.commit_ctx(w.st2, rows(2), [3])),
    Case("negative position", ValueError, ("positions",), lambda w: w.prop.commit_ctx(w.st2, rows(1), [-4])),
    Case("positions out of order", ValueError, ("positions",), lambda w: w.prop.commit_ctx(w.st2, rows(2), [9, 8])),
    Case("positions repeat the last", ValueError, ("positions",), lambda w: w.prop.commit_ctx(w.st2, rows(1), [2])),
    Case("no positions", ValueError, ("positions",), lambda w: w.prop.commit_ctx(w.st2, rows(0), [])),
    Case("float positions", TypeError, ("positions",), lambda w: w.prop.commit_ctx(w.st2, rows(2), [3.0, 4.0])),
    Case("NaN position", TypeError, ("positions",), lambda w: w.prop.commit_ctx(w.st2, rows(1), [float("nan")])),
    Case("float tensor positions", TypeError, ("positions",),
         lambda w: w.prop.commit_ctx(w.st2, rows(2), torch.tensor([3.0, 4.0]))),
    Case("commit to a freed state", InvalidStateError, ("freed",), lambda w: w.prop.commit_ctx(w.freed, rows(1), [0])),
    Case("commit to a foreign state", InvalidStateError, ("another proposer",),
         lambda w: w.prop.commit_ctx(w.foreign, rows(1), [5])),
    # propose
    Case("num_drafts zero", ValueError, ("num_drafts",), lambda w: w.prop.propose(w.st2, 1, 3, 0)),
    Case("num_drafts = B", ValueError, ("num_drafts",), lambda w: w.prop.propose(w.st2, 1, 3, w.prop.block_gamma)),
    Case("num_drafts huge", ValueError, ("num_drafts",), lambda w: w.prop.propose(w.st2, 1, 3, 2**70)),
    Case("num_drafts float", TypeError, ("num_drafts",), lambda w: w.prop.propose(w.st2, 1, 3, 1.0)),  # type: ignore[arg-type]
    Case("num_drafts bool", TypeError, ("num_drafts",), lambda w: w.prop.propose(w.st2, 1, 3, True)),
    Case("position negative", ValueError, ("position",), lambda w: w.prop.propose(w.st2, 1, -1, 1)),
    Case("position not after ctx", ValueError, ("position",), lambda w: w.prop.propose(w.st2, 1, 2, 1)),
    Case("position beyond int64", ValueError, ("position",), lambda w: w.prop.propose(w.st2, 1, 2**63, 1)),
    Case("position float", TypeError, ("position",), lambda w: w.prop.propose(w.st2, 1, 3.5, 1)),  # type: ignore[arg-type]
    Case("last_token negative", ValueError, ("last_token",), lambda w: w.prop.propose(w.st2, -1, 3, 1)),
    Case("last_token beyond vocab", ValueError, ("last_token",), lambda w: w.prop.propose(w.st2, 2**70, 3, 1)),
    Case("last_token tensor of floats", TypeError, ("last_token",), lambda w: w.prop.propose(w.st2, 1.0, 3, 1)),  # type: ignore[arg-type]
    Case("bitmask one word short", ValueError, ("grammar_bitmask",),
         lambda w: w.prop.propose(w.st2, 1, 3, 1, mask(WORDS - 1))),
    Case("bitmask one word long", ValueError, ("grammar_bitmask",),
         lambda w: w.prop.propose(w.st2, 1, 3, 1, mask(WORDS + 1))),
    Case("bitmask too few rows", ValueError, ("grammar_bitmask",),
         lambda w: w.prop.propose(w.st2, 1, 3, 3, mask(WORDS, 2))),
    Case("bitmask 3-D", ValueError, ("grammar_bitmask",),
         lambda w: w.prop.propose(w.st2, 1, 3, 1, torch.zeros(1, 1, WORDS, dtype=torch.int32))),
    Case("bitmask float", ValueError, ("grammar_bitmask",),
         lambda w: w.prop.propose(w.st2, 1, 3, 1, torch.zeros(WORDS))),
    Case("bitmask bool", ValueError, ("grammar_bitmask",),
         lambda w: w.prop.propose(w.st2, 1, 3, 1, torch.ones(WORDS, dtype=torch.bool))),
    Case("bitmask empty list", ValueError, ("grammar_bitmask",), lambda w: w.prop.propose(w.st2, 1, 3, 1, [])),
    Case("propose a freed state", InvalidStateError, ("freed",), lambda w: w.prop.propose(w.freed, 1, 0, 1)),
    Case("propose a foreign state", InvalidStateError, ("another proposer",),
         lambda w: w.prop.propose(w.foreign, 1, 5, 1)),
    Case("propose a core state", InvalidStateError, ("not a DFlash",), lambda w: w.prop.propose(w.st2.ctx, 1, 3, 1)),  # type: ignore[arg-type]
    # after_verify / free_state
    Case("accept more than drafted", ValueError, ("num_accepted",), lambda w: w.prop.after_verify(w.st, 3)),
    Case("accept negative", ValueError, ("num_accepted",), lambda w: w.prop.after_verify(w.st, -1)),
    Case("verify a freed state", InvalidStateError, ("freed",), lambda w: w.prop.after_verify(w.freed, 0)),
    Case("verify a foreign state", InvalidStateError, ("another proposer",),
         lambda w: w.prop.after_verify(w.foreign, 0)),
    Case("free a foreign state", InvalidStateError, ("another proposer",), lambda w: w.prop.free_state(w.foreign)),
    # after_verify_batch (each error at the first state or before any: nothing is recorded)
    Case("batch: accept more than drafted", ValueError, ("num_accepted",),
         lambda w: w.prop.after_verify_batch([w.st, w.st2], [3, 0])),
    Case("batch: accept negative", ValueError, ("num_accepted",), lambda w: w.prop.after_verify_batch([w.st], [-1])),
    Case("batch: a freed state", InvalidStateError, ("freed",),
         lambda w: w.prop.after_verify_batch([w.freed, w.st], [0, 0])),
    Case("batch: a foreign state", InvalidStateError, ("another proposer",),
         lambda w: w.prop.after_verify_batch([w.st, w.foreign], [0, 0])),
    Case("batch: a core state", InvalidStateError, ("not a DFlash",),
         lambda w: w.prop.after_verify_batch([w.st2.ctx], [0])),  # type: ignore[list-item]
    Case("batch: a state twice", ValueError, ("twice",), lambda w: w.prop.after_verify_batch([w.st, w.st], [0, 0])),
    Case("batch: fewer counts", ValueError, ("accepted counts",),
         lambda w: w.prop.after_verify_batch([w.st, w.st2], [0])),
    Case("batch: a float count", TypeError, ("num_accepted",), lambda w: w.prop.after_verify_batch([w.st], [0.5])),  # type: ignore[list-item]
]


@pytest.mark.parametrize("case", API_CASES, ids=[c.name for c in API_CASES])
def test_api_bad_input_is_typed_named_and_changes_nothing(drafter: Any, target: Any, case: Case) -> None:
    w = world(drafter, target)
    before = snapshot(w)
    with expect_clear_error(case.exc, *case.words):
        case.call(w)
    assert unchanged(before, snapshot(w)), f"{case.name} changed the world"
    w.prop.pool.check_invariants()
    score.invariant_checks += 2
    # Still usable: the next good call works.
    assert len(w.prop.propose(w.st2, 1, 3, 1)) == 1


def expect_decline(caplog: pytest.LogCaptureFixture, call: Callable[[], Any], *words: str) -> None:
    """``propose_batch``'s typed error is a decline: ``None`` and a logged reason naming it."""
    score.bad_inputs += 1
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="blockdraft.proposer"):
        assert call() is None
    text = " ".join(r.getMessage() for r in caplog.records)
    missing = [x for x in words if not re.search(x, text, re.IGNORECASE)]
    assert not missing, f"decline reason {text!r} does not name {missing}"
    score.clear_errors += 1


BATCH_CASES: list[tuple[str, tuple[str, ...], Callable[[World], Any]]] = [
    ("one sequence", (r"fewer than 2|n=1",), lambda w: w.prop.propose_batch([w.st], [1], [5], 1)),
    ("more than max_batch", ("max_batch|exceeds",),
     lambda w: w.prop.propose_batch([w.st, w.st2] * 3, [1] * 6, [5, 3] * 3, 1)),
    ("fewer positions", ("position",), lambda w: w.prop.propose_batch([w.st, w.st2], [1, 1], [5], 1)),
    ("fewer states", ("state",), lambda w: w.prop.propose_batch([w.st], [1, 1], [5, 3], 1)),
    ("num_drafts zero", ("num_drafts",), lambda w: w.prop.propose_batch([w.st, w.st2], [1, 1], [5, 3], 0)),
    ("same state twice", ("twice",), lambda w: w.prop.propose_batch([w.st2, w.st2], [1, 1], [3, 3], 1)),
    ("freed state inside", ("freed",), lambda w: w.prop.propose_batch([w.st, w.freed], [1, 1], [5, 0], 1)),
    ("foreign state inside", ("another proposer",),
     lambda w: w.prop.propose_batch([w.st, w.foreign], [1, 1], [5, 5], 1)),
    ("bad position inside", ("position",), lambda w: w.prop.propose_batch([w.st, w.st2], [1, 1], [5, 1], 1)),
    ("bad token inside", ("last_token",), lambda w: w.prop.propose_batch([w.st, w.st2], [1, 999], [5, 3], 1)),
    ("a length-less argument", ("bad arguments",), lambda w: w.prop.propose_batch([w.st, w.st2], 7, [5, 3], 1)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("case", BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
def test_propose_batch_bad_input_declines_and_changes_nothing(
    drafter: Any, target: Any, case: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, words, call = case
    w = world(drafter, target)
    before = snapshot(w)
    expect_decline(caplog, lambda: call(w), *words)
    assert unchanged(before, snapshot(w))
    score.invariant_checks += 1


ENV_CASES = [
    ("BLOCKDRAFT_DFLASH_CTX_CAP", "lots"),
    ("BLOCKDRAFT_DFLASH_CTX_CAP", "-1"),
    ("BLOCKDRAFT_DFLASH_SLIDE", "1.5"),
    ("BLOCKDRAFT_DFLASH_SLIDE", "nan"),
    ("BLOCKDRAFT_DFLASH_BATCH_PROPOSE", "two"),
    ("BLOCKDRAFT_DFLASH_BATCH_PROPOSE", "-3"),
    ("BLOCKDRAFT_DFLASH_BATCHED_PRECOMPUTE", "maybe"),
    ("BLOCKDRAFT_DFLASH_DRAFT_CAP", "0"),
    ("BLOCKDRAFT_DFLASH_DRAFT_CAP", "1.5"),
]


@pytest.mark.parametrize(("var", "value"), ENV_CASES)
def test_bad_env_value_fails_construction_naming_the_variable(
    drafter: Any, target: Any, var: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(var, value)
    with expect_clear_error(ConfigError, var):
        make(drafter, target)


CTOR_CASES: list[tuple[str, type[BaseException], str, dict[str, Any]]] = [
    ("max_seq_len zero", ValueError, "max_seq_len", {"max_seq_len": 0}),
    ("max_batch zero", ValueError, "max_batch", {"max_batch": 0}),
    ("page_size zero", ValueError, "page_size", {"page_size": 0}),
    ("num_pages zero", ValueError, "num_pages", {"num_pages": 0}),
    ("memory fraction zero", ValueError, "pool_memory_fraction", {"num_pages": None, "pool_memory_fraction": 0.0}),
    ("memory fraction NaN", ValueError, "pool_memory_fraction",
     {"num_pages": None, "pool_memory_fraction": float("nan")}),
    ("unknown backend", ConfigError, "backend", {"backend": "cuda-graphs"}),
]


@pytest.mark.parametrize("case", CTOR_CASES, ids=[c[0] for c in CTOR_CASES])
def test_bad_constructor_argument(drafter: Any, target: Any, case: Any) -> None:
    _, exc, word, kw = case
    with expect_clear_error(exc, word):
        make(drafter, target, **kw)


def test_mismatched_pairs(target: Any) -> None:
    wrong_mask = tiny_drafter(drafter_config(mask=10_000))
    with expect_clear_error(ConfigError, "mask_token_id"):
        make(wrong_mask, target)
    wrong_layers = tiny_drafter(drafter_config(target_layers=8))  # reads target layer 7 of 3
    with expect_clear_error(ConfigError, "target_layer_ids"):
        make(wrong_layers, target)


@pytest.fixture(scope="module")
def engine(drafter: Any, target: Any) -> SpeculativeEngine:
    return SpeculativeEngine(target, drafter, max_seq_len=32, num_pages=32, max_batch=2, page_size=4)


GEN_CASES: list[tuple[str, type[BaseException], str, list[Any], dict[str, Any]]] = [
    ("max_new_tokens zero", ValueError, "max_new_tokens", [[1, 2]], {"max_new_tokens": 0}),
    ("sampling not settings", TypeError, "sampling", [[1, 2]], {"sampling": 0.5}),
    ("no prompts", ValueError, "prompts", [], {}),
    ("an empty prompt", ValueError, "prompt 1", [[1], []], {}),
    ("prompt beyond max_seq_len", ValueError, "max_seq_len", [list(range(30))], {}),
    ("token beyond the vocabulary", ValueError, "prompt 0.*vocabulary", [[1, 10_000]], {}),
    ("negative token", ValueError, "prompt 0.*vocabulary", [[-1]], {}),
    ("float token", TypeError, "prompts", [[1.5]], {}),
]


@pytest.mark.parametrize("case", GEN_CASES, ids=[c[0] for c in GEN_CASES])
def test_generate_bad_input(engine: SpeculativeEngine, case: Any) -> None:
    _, exc, word, prompts, kw = case
    with expect_clear_error(exc, word):
        engine.generate(prompts, **{"max_new_tokens": 4, **kw})
    pool = engine.proposer.pool
    assert pool.num_free == pool.num_pages
    score.invariant_checks += 1


# Sampling settings are checked where they are made, before any request exists.
SAMPLING_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("temperature negative", "temperature", {"temperature": -0.5}),
    ("top_p zero", "top_p", {"top_p": 0.0}),
    ("top_p above one", "top_p", {"top_p": 1.5}),
    ("top_k negative", "top_k", {"top_k": -1}),
]


@pytest.mark.parametrize("case", SAMPLING_CASES, ids=[c[0] for c in SAMPLING_CASES])
def test_sampling_params_bad_input(case: Any) -> None:
    _, word, kw = case
    with expect_clear_error(ValueError, word):
        SamplingParams(**kw)


def _config() -> dict[str, Any]:
    return tiny_drafter_shape().config_dict()


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory: pytest.TempPathFactory, drafter: Any) -> Path:
    root = tmp_path_factory.mktemp("ckpt") / "good"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(_config()))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(root / "model.safetensors"))
    load_drafter(root)  # the uncorrupted copy loads
    return root


def _corrupt(root: Path, kind: str, drafter: Any) -> None:
    weights = root / "model.safetensors"
    state = {k: v.contiguous() for k, v in drafter.state_dict().items()}
    if kind == "truncated weights":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif kind == "garbage weights":
        weights.write_bytes(b"\x00" * 64)
    elif kind == "missing tensor":
        state.pop(sorted(state)[0])
        save_file(state, str(weights))
    elif kind == "extra tensor":
        state["bogus.weight"] = torch.zeros(2)
        save_file(state, str(weights))
    elif kind == "wrong shape":
        name = sorted(state)[0]
        state[name] = torch.zeros(3, 3)
        save_file(state, str(weights))
    elif kind == "integer tensor":
        name = sorted(state)[0]
        state[name] = state[name].to(torch.int32)
        save_file(state, str(weights))
    elif kind == "pickle only":
        weights.unlink()
        (root / "pytorch_model.bin").write_bytes(b"not loaded")
    elif kind == "index names a missing shard":
        weights.unlink()
        index = {"weight_map": {k: "shard-1.safetensors" for k in state}}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    elif kind == "index escapes the directory":
        weights.unlink()
        index = {"weight_map": {k: "../x.safetensors" for k in state}}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    elif kind == "config not JSON":
        (root / "config.json").write_text("{ hidden_size: 32")
    elif kind == "config truncated":
        text = json.dumps(_config())
        (root / "config.json").write_text(text[: len(text) // 2])
    elif kind == "config missing hidden_size":
        cfg = _config()
        del cfg["hidden_size"]
        (root / "config.json").write_text(json.dumps(cfg))
    elif kind == "config inconsistent heads":
        cfg = _config()
        cfg["num_key_value_heads"] = 3
        (root / "config.json").write_text(json.dumps(cfg))
    elif kind == "config missing":
        (root / "config.json").unlink()
    else:
        raise AssertionError(kind)


CKPT_CASES = [
    ("truncated weights", "cannot read|model.safetensors"),
    ("garbage weights", "cannot read|model.safetensors"),
    ("missing tensor", "missing tensors"),
    ("extra tensor", "unexpected tensors.*bogus"),
    ("wrong shape", "shape"),
    ("integer tensor", "dtype"),
    ("pickle only", "pickle"),
    ("index names a missing shard", "shard-1"),
    ("index escapes the directory", "outside"),
    ("config not JSON", "config.json.*JSON"),
    ("config truncated", "config.json.*JSON"),
    ("config missing hidden_size", "hidden_size"),
    ("config inconsistent heads", "num_key_value_heads|heads"),
    ("config missing", "config"),
]


@pytest.mark.parametrize(("kind", "words"), CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_corrupt_checkpoint(good_ckpt: Path, tmp_path: Path, drafter: Any, kind: str, words: str) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(good_ckpt, root)
    _corrupt(root, kind, drafter)
    with expect_clear_error(CheckpointError, words):
        load_drafter(root)


def test_checkpoint_paths_and_dtype(good_ckpt: Path, tmp_path: Path) -> None:
    with expect_clear_error(CheckpointError, "not found"):
        load_drafter(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with expect_clear_error(CheckpointError, "not a directory"):
        load_drafter(tmp_path / "file")
    with expect_clear_error(ValueError, "dtype"):
        load_drafter(good_ckpt, dtype="int8")
    with expect_clear_error(ValueError, "dtype"):
        load_drafter(good_ckpt, dtype=torch.int64)


def expect_cli_error(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> None:
    """Exit code 2 and exactly one ``blockdraft: error:`` line that names the problem."""
    score.bad_inputs += 1
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, (argv, rc, err)
    assert len(err) == 1 and err[0].startswith("blockdraft: error:"), err
    missing = [x for x in words if not re.search(x, err[0], re.IGNORECASE)]
    assert not missing, f"{err[0]!r} does not name {missing}"
    score.clear_errors += 1


def test_cli_bad_inputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, good_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expect_cli_error(capsys, ["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens")
    expect_cli_error(capsys, ["generate", "x", "--device", "tpu"], "device 'tpu'")
    expect_cli_error(capsys, ["generate", "x", "--device", "cuda:0"], "cuda")
    expect_cli_error(capsys, ["generate", "x", "--target", str(tmp_path)], "--drafter")
    expect_cli_error(capsys, ["generate", "x", "--target", str(tmp_path / "no"), "--drafter", str(good_ckpt)],
                     "--target", "not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    expect_cli_error(capsys, ["generate", "x", "--target", str(empty), "--drafter", str(good_ckpt)],
                     "--target", "config.json")
    expect_cli_error(capsys, ["demo", "--num-pages", "0"], "--num-pages")
    expect_cli_error(capsys, ["demo", "--block-size", "0"], "--block-size")
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_CTX_CAP", "huge")
    expect_cli_error(capsys, ["demo"], "BLOCKDRAFT_DFLASH_CTX_CAP")
    monkeypatch.delenv("BLOCKDRAFT_DFLASH_CTX_CAP")
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_SLIDE", "2")
    expect_cli_error(capsys, ["demo"], "BLOCKDRAFT_DFLASH_SLIDE")
    monkeypatch.delenv("BLOCKDRAFT_DFLASH_SLIDE")
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_DRAFT_CAP", "none")
    expect_cli_error(capsys, ["generate", "x", "--max-new-tokens", "2", "--device", "cpu", "--no-progress"],
                     "BLOCKDRAFT_DFLASH_DRAFT_CAP")


def test_cli_unparsable_argument_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    score.bad_inputs += 1
    with pytest.raises(SystemExit) as info:
        main(["generate", "x", "--max-new-tokens", "many"])
    assert info.value.code == 2
    assert "--max-new-tokens" in capsys.readouterr().err
    score.clear_errors += 1
