"""The target's own continuations (rollouts) and the unlikelihood fine-tuning that reads them,
on the CPU with tiny random targets."""

from __future__ import annotations

import math

import pytest
import torch

from blockdraft.sampling import sample_rows
from blockdraft.training.builtin.unlikelihood import (
    TuneConfig,
    kl_to_start,
    own_choice_loss,
    repeated_ngram_mask,
    tune_target,
    unlikelihood_loss,
)
from blockdraft.training.rollouts import document_starts, prompt_starts, rollout, rollout_stream

from support.tinypair import tiny_target

VOCAB = 64
EOS = 0


def _prompts(n: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_rollout_equals_generate_in_any_batching() -> None:
    model = tiny_target(vocab=VOCAB)
    prompts = _prompts(5, 7)
    with torch.no_grad():
        want = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12,
                              do_sample=False, pad_token_id=0, eos_token_id=None)[:, 7:]
    assert torch.equal(rollout(model, prompts, 12), want)
    assert torch.equal(rollout(model, prompts, 12, batch=2), want)


def test_sampled_rollout_draws_from_the_full_distribution_step_by_step() -> None:
    """At T > 0 each token is drawn from softmax(logits / T) of the whole prefix (a cache-free
    reference with the same generator draws the same tokens)."""
    model = tiny_target(vocab=VOCAB)
    prompts = _prompts(3, 4, seed=1)
    got = rollout(model, prompts, 9, temperature=0.7, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    seq = prompts.clone()
    with torch.no_grad():
        for _ in range(9):
            probs = torch.softmax(model(input_ids=seq).logits[:, -1].float() / 0.7, dim=-1)
            seq = torch.cat((seq, sample_rows(probs, gen)[:, None]), dim=1)
    assert torch.equal(got, seq[:, 4:])
    again = rollout(model, prompts, 9, temperature=0.7, generator=torch.Generator().manual_seed(5))
    assert torch.equal(got, again)


@pytest.mark.parametrize(("shape", "new", "temp", "match"), [
    ((2, 0), 4, 0.0, "P >= 1"), ((3,), 4, 0.0, r"\[n, P\]"), ((2, 3), 0, 0.0, "new_tokens"),
    ((2, 3), 4, -1.0, "temperature")])
def test_rollout_refuses_bad_arguments(shape: tuple[int, ...], new: int, temp: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rollout(tiny_target(vocab=VOCAB), torch.ones(shape, dtype=torch.int64), new, temperature=temp)


def test_document_starts_and_prompt_starts() -> None:
    stream = torch.tensor([5, 6, 7, EOS, 8, 9, 10, 11, EOS, 12, EOS, 13, 14])
    assert document_starts(stream, EOS, 2).tolist() == [0, 4, 9, 11]
    assert document_starts(stream, EOS, 3).tolist() == [0, 4, 9]
    assert document_starts(stream, EOS, 5).tolist() == [0, 4]
    gen = torch.Generator().manual_seed(0)
    starts = prompt_starts(stream, EOS, 6, 3, gen, doc_fraction=0.5)
    # Three document starts (each once), three uniform offsets.
    assert sorted(starts[:3].tolist()) == [0, 4, 9] and starts.numel() == 6
    assert all(0 <= s <= stream.numel() - 3 for s in starts.tolist())
    only_docs = prompt_starts(stream, EOS, 2, 2, gen, doc_fraction=1.0)
    assert set(only_docs.tolist()) <= {0, 4, 9, 11} and len(set(only_docs.tolist())) == 2
    with pytest.raises(ValueError, match="doc_fraction"):
        prompt_starts(stream, EOS, 2, 2, gen, doc_fraction=1.5)
    with pytest.raises(ValueError, match="prompts need more"):
        prompt_starts(stream, EOS, 2, 13, gen)


def test_rollout_stream_is_prompt_continuation_eos_per_document() -> None:
    model = tiny_target(vocab=VOCAB)
    stream = torch.randint(1, VOCAB, (300,), generator=torch.Generator().manual_seed(2))
    stream[::37] = EOS
    out = rollout_stream(model, stream, EOS, num=6, prompt_len=5, new_tokens=8, seed=3)
    docs = out.reshape(6, 14)
    assert (docs[:, -1] == EOS).all()
    for doc in docs:
        prompt = doc[:5]
        assert any(torch.equal(stream[s : s + 5], prompt) for s in range(stream.numel() - 4))
        assert torch.equal(doc[5:13], rollout(model, prompt[None], 8)[0])
    # A seed fixes the stream; sampled rollouts differ from greedy ones.
    assert torch.equal(out, rollout_stream(model, stream, EOS, num=6, prompt_len=5, new_tokens=8, seed=3))
    sampled = rollout_stream(model, stream, EOS, num=6, prompt_len=5, new_tokens=8, seed=3, temperature=1.0)
    assert not torch.equal(sampled, out)


def test_repeated_ngram_mask_marks_the_token_that_completes_a_repeat() -> None:
    rows = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 5], [7, 7, 7, 7, 7, 7, 9, 8, 6]])
    mask = repeated_ngram_mask(rows, 4)
    # 1 2 3 4 repeats: its last token (index 7) is the one that completes the repeat.
    assert mask[0].tolist() == [False] * 7 + [True, False]
    # 7777 first ends at 3, again at 4 and 5.
    assert mask[1].tolist() == [False] * 4 + [True, True] + [False] * 3
    assert not repeated_ngram_mask(torch.arange(20)[None], 4).any()
    assert repeated_ngram_mask(torch.tensor([[3, 3, 5, 3]]), 1).tolist() == [[False, True, False, True]]
    with pytest.raises(ValueError):
        repeated_ngram_mask(rows, 0)


def test_unlikelihood_loss_is_minus_log_one_minus_p_at_the_negatives() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, VOCAB, generator=gen)
    tokens = torch.randint(0, VOCAB, (2, 5), generator=gen)
    neg = torch.tensor([[True, False, False, True, False], [False] * 5])
    p = torch.softmax(logits, -1)
    want = sum(-math.log(1 - float(p[b, t, tokens[b, t]])) for b, t in [(0, 0), (0, 3)]) / 10
    assert math.isclose(float(unlikelihood_loss(logits, tokens, neg)), want, rel_tol=1e-5)
    assert float(unlikelihood_loss(logits, tokens, torch.zeros_like(neg))) == 0.0
    # A token the model is sure of costs a large but finite loss.
    sure = torch.full((1, 1, VOCAB), -50.0)
    sure[0, 0, 3] = 50.0
    big = float(unlikelihood_loss(sure, torch.tensor([[3]]), torch.tensor([[True]])))
    assert 10 < big < math.inf


def _tuning_stream() -> torch.Tensor:
    """4000 random tokens with a document break every 50."""
    stream = torch.randint(1, VOCAB, (4000,), generator=torch.Generator().manual_seed(4))
    stream[::50] = EOS
    return stream


def _sharp_target() -> torch.nn.Module:
    """A tiny target confident as a trained model is (its logits scaled 20 times: p of a loop's
    token near 1), the same one every call."""
    torch.manual_seed(0)
    model = tiny_target(vocab=VOCAB, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def test_the_unlikelihood_term_makes_greedy_continuations_repeat_less() -> None:
    """Tuned with the next-token loss alone, a tiny target's greedy continuations repeat more
    (it learns the stream's most frequent tokens); with the unlikelihood term added, the same
    tuning leaves far fewer continuation tokens that complete a repeated 4-gram."""
    stream = _tuning_stream()
    prompts = stream[1:401].reshape(100, 4)
    share: dict[float, tuple[float, float]] = {}
    for weight in (0.0, 4.0):
        model = _sharp_target()
        before = float(repeated_ngram_mask(rollout(model, prompts, 24)).float().mean())
        cfg = TuneConfig(steps=40, lr=3e-3, warmup_steps=2, batch=2, seq_len=32, ul_batch=16, prompt_len=4,
                         new_tokens=24, regen_every=5, ul_weight=weight)
        out = tune_target(model, stream, EOS, cfg)
        assert out["steps"] == 40 and not model.training
        share[weight] = before, float(repeated_ngram_mask(rollout(model, prompts, 24)).float().mean())
    (before, mle_only), (_, with_ul) = share[0.0], share[4.0]
    assert mle_only > before and with_ul < 0.6 * mle_only, share


def test_kl_to_start_is_the_kl_of_the_start_distribution_to_the_model() -> None:
    gen = torch.Generator().manual_seed(5)
    logits, start = torch.randn(2, 3, VOCAB, generator=gen), torch.randn(2, 3, VOCAB, generator=gen)
    p, q = torch.softmax(start, -1), torch.softmax(logits, -1)
    want = float((p * (p.log() - q.log())).sum(-1).mean())
    assert math.isclose(float(kl_to_start(logits, start)), want, rel_tol=1e-5)
    assert abs(float(kl_to_start(start, start))) < 1e-6
    assert float(kl_to_start(logits, start)) > 0


def test_the_kl_term_holds_the_tuned_targets_distribution_on_the_corpus() -> None:
    """The same unlikelihood tuning with a heavy KL term ends closer to the start's distribution
    on corpus windows (and still counts its KL) than without it."""
    stream = _tuning_stream()
    windows = stream[:256].reshape(8, 32)
    drift: dict[float, float] = {}
    for weight in (0.0, 20.0):
        model = _sharp_target()
        with torch.no_grad():
            start = model(input_ids=windows).logits
        cfg = TuneConfig(steps=20, lr=3e-3, warmup_steps=2, batch=2, seq_len=32, ul_batch=8, prompt_len=4,
                         new_tokens=16, regen_every=5, ul_weight=4.0, kl_weight=weight)
        out = tune_target(model, stream, EOS, cfg)
        assert (out["final_kl"] > 0) == (weight > 0)
        with torch.no_grad():
            drift[weight] = float(kl_to_start(model(input_ids=windows).logits, start))
    assert drift[20.0] < 0.5 * drift[0.0], drift


def test_own_choice_loss_is_the_cross_entropy_of_the_tokens_that_are_not_negatives() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 4, VOCAB, generator=gen)
    tokens = torch.randint(0, VOCAB, (2, 4), generator=gen)
    neg = torch.tensor([[False, True, False, False], [True, True, True, False]])
    logp = torch.log_softmax(logits, -1)
    kept = [(0, 0), (0, 2), (0, 3), (1, 3)]
    want = -sum(float(logp[b, t, tokens[b, t]]) for b, t in kept) / len(kept)
    assert math.isclose(float(own_choice_loss(logits, tokens, neg)), want, rel_tol=1e-5)
    assert float(own_choice_loss(logits, tokens, torch.ones_like(neg))) == 0.0


def _own_choice_p(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> float:
    """Mean probability ``model`` gives each token of its own greedy continuations."""
    cont = rollout(model, prompts, new_tokens)
    with torch.no_grad():
        logits = model(input_ids=torch.cat((prompts, cont), 1)).logits[:, prompts.shape[1] - 1 : -1]
    return float(torch.softmax(logits, -1).gather(-1, cont[..., None]).mean())


def test_the_own_choice_term_makes_the_tuned_target_surer_of_its_greedy_choices() -> None:
    """The same unlikelihood tuning, with and without the own-choice term: with it, the tuned
    target gives the tokens of its own greedy continuations a far higher probability, and those
    continuations repeat less (its non-repeating choices now outweigh the repeats)."""
    stream = _tuning_stream()
    prompts = stream[1:401].reshape(100, 4)
    sure: dict[float, float] = {}
    repeats: dict[float, float] = {}
    for weight in (0.0, 2.0):
        model = _sharp_target()
        cfg = TuneConfig(steps=40, lr=3e-3, warmup_steps=2, batch=2, seq_len=32, ul_batch=16, prompt_len=4,
                         new_tokens=24, regen_every=5, ul_weight=4.0, own_weight=weight)
        out = tune_target(model, stream, EOS, cfg)
        assert (out["final_own_loss"] > 0) == (weight > 0)
        sure[weight] = _own_choice_p(model, prompts, 24)
        repeats[weight] = float(repeated_ngram_mask(rollout(model, prompts, 24)).float().mean())
    assert sure[2.0] > sure[0.0] + 0.3, sure
    assert repeats[2.0] < repeats[0.0], repeats
