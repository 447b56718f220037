"""`ll.beam_search` against transformers' `generate(num_beams=..., do_sample=False)`."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

import logitloop as ll
from tests.decoding.random_llama import small_llama
from tests.models.tiny_checkpoints import build_hf_model, random_prompts, save_hf_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MAX_TOKENS = 10
PROMPT_LENGTHS = [5, 9, 3]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def pair(request, tmp_path_factory):
    """(case, HF model, our model, a stop token that transformers' beams use often)."""
    hf = build_hf_model(request.param, seed=1)
    model = ll.load_pretrained(save_hf_model(hf, tmp_path_factory.mktemp(request.param)))
    counts = Counter()
    for prompt in random_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed=12):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, num_beams=4, num_return_sequences=4,
                max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        counts.update(t for row in out[:, len(prompt) + 1 : len(prompt) + 4].tolist() for t in row)
    # Beams then end at different lengths, some of them early.
    return request.param, hf, model, counts.most_common(1)[0][0]


def hf_beams(hf, prompt, *, stop, num_beams, length_penalty, early_stopping, num_return,
             min_tokens=0):  # fmt: skip
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            num_beams=num_beams,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=min_tokens or None,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            num_return_sequences=num_return,
            eos_token_id=stop,
            pad_token_id=stop,
            return_dict_in_generate=True,
            output_scores=True,
        )
    seqs = out.sequences[:, len(prompt) :].tolist()
    return seqs, out.sequences_scores.tolist()


def check_against_hf(pair, num_beams, length_penalty, early_stopping, min_tokens=0):
    _, hf, model, stop = pair
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed=12)
    num_return = num_beams
    ours = ll.beam_search(
        model, prompts, num_beams=num_beams, max_tokens=MAX_TOKENS,
        length_penalty=length_penalty, early_stopping=early_stopping,
        num_return_sequences=num_return, stop_token_ids=[stop], ignore_eos=True,
        min_tokens=min_tokens,
    )  # fmt: skip
    ended = 0
    for prompt, beams in zip(prompts, ours, strict=True):
        seqs, scores = hf_beams(
            hf, prompt, stop=stop, num_beams=num_beams, length_penalty=length_penalty,
            early_stopping=early_stopping, num_return=num_return, min_tokens=min_tokens,
        )  # fmt: skip
        assert len(beams) == num_return
        for beam, seq, score in zip(beams, seqs, scores, strict=True):
            n = len(beam.token_ids)
            assert beam.token_ids == seq[:n]
            assert all(t == stop for t in seq[n:])  # transformers pads with the stop token
            assert beam.score == pytest.approx(score, abs=1e-4)
            assert beam.finish_reason == ("stop" if beam.token_ids[-1] == stop else "length")
            assert n >= max(min_tokens, 1)
            ended += beam.finish_reason == "stop"
    return ended


def test_matches_transformers(pair):
    case, *_ = pair
    if case == "llama":
        ended = check_against_hf(pair, 4, 1.0, True)
    else:
        ended = check_against_hf(pair, 3, 2.0, False, min_tokens=2)
    assert ended > 0  # the stop token ended some hypotheses


# num_beams=1: transformers runs greedy search instead (no sequences_scores), which
# `test_one_beam_is_greedy_generate` compares.
@pytest.mark.slow
@pytest.mark.parametrize(
    "num_beams, length_penalty, early_stopping",
    list(itertools.product([2, 5, 8], [0.5, 1.0, 2.0], [True, False, "never"])),
)
def test_matches_transformers_matrix(pair, num_beams, length_penalty, early_stopping):
    check_against_hf(pair, num_beams, length_penalty, early_stopping)


def test_beam_count_per_prompt(pair):
    """Each prompt's own count: what transformers' search with that count gives."""
    case, hf, model, stop = pair
    if case != "llama":
        pytest.skip("a property of the rule, not of the model: the Llama case checks it")
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed=12)
    counts = [2, 4, 3]
    ours = ll.beam_search(
        model, prompts, num_beams=counts, max_tokens=MAX_TOKENS, length_penalty=0.5,
        num_return_sequences=2, stop_token_ids=[stop], ignore_eos=True,
    )  # fmt: skip
    for prompt, count, beams in zip(prompts, counts, ours, strict=True):
        seqs, scores = hf_beams(
            hf, prompt, stop=stop, num_beams=count, length_penalty=0.5, early_stopping=True,
            num_return=2,
        )  # fmt: skip
        for beam, seq, score in zip(beams, seqs, scores, strict=True):
            assert beam.token_ids == seq[: len(beam.token_ids)]
            assert beam.score == pytest.approx(score, abs=1e-4)


def test_one_beam_is_greedy_generate(pair):
    case, _, model, stop = pair
    if case != "llama":
        pytest.skip("a property of the rule, not of the model: the Llama case checks it")
    prompts = random_prompts(model.config.vocab_size, [6, 2, 4], seed=14)
    params = ll.SamplingParams.create(
        3, temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], logprobs=0
    )
    greedy = ll.generate(model, prompts, params, ignore_eos=True)
    beams = ll.beam_search(
        model, prompts, num_beams=1, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
        ignore_eos=True,
    )  # fmt: skip
    for r, (b,) in enumerate(beams):
        assert b.token_ids == greedy.token_ids[r]
        assert b.finish_reason == greedy.finish_reason[r]
        want = np.sum(greedy.raw_logprobs[r]) / len(b.token_ids)
        assert b.score == pytest.approx(want, abs=1e-5)


@pytest.fixture(scope="module")
def small():
    return small_llama(160, 128, seed=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_beams=0), r"num_beams = 0 is outside the allowed range \[1, 160\]"),
        (dict(num_beams=161), r"num_beams = 161 is outside the allowed range \[1, 160\]"),
        (dict(num_beams=2, num_return_sequences=3), r"num_return_sequences = 3 .* \[1, 2\]"),
        (dict(num_beams=[2, 3]), r"num_beams has 2 entries but there are 1 prompts"),
        (dict(num_beams=[0]), r"num_beams\[0\] = 0 is outside the allowed range \[1, 160\]"),
        (dict(num_beams=2, length_penalty=float("nan")), r"length_penalty = nan is not finite"),
        (dict(num_beams=2, early_stopping="sometimes"), r"early_stopping must be True, False"),
        (dict(num_beams=2, max_tokens=0), r"max_tokens = 0 is outside the allowed range"),
        (dict(num_beams=2, max_tokens=200), r"prompts\[0\] has 3 tokens and max_tokens = 200"),
        (
            dict(num_beams=2, params=ll.SamplingParams.create(1, temperature=0.5)),
            r"params.temperature\[0\] is set, but beam search is deterministic",
        ),
    ],
)
def test_bad_input(small, kwargs, match):
    model = small
    kwargs = {"max_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        ll.beam_search(model, [[1, 2, 3]], **kwargs)
