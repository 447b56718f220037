"""`ll.beam_search` against transformers' `generate(num_beams=..., do_sample=False)`."""

from __future__ import annotations

import itertools
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.engine.beam import MASK
from tests.decoding.random_llama import small_llama
from tests.decoding.test_stop_strings import ByteTokenizer
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
        (  # a NumPy float is a length penalty (it was refused): the next check speaks
            dict(num_beams=2, length_penalty=np.float32(0.5), early_stopping="sometimes"),
            r"early_stopping must be True, False",
        ),
        (dict(num_beams=2, max_tokens=0), r"max_tokens = 0 is outside the allowed range"),
        (dict(num_beams=2, max_tokens=200), r"prompts\[0\] has 3 tokens and max_tokens = 200"),
        (
            dict(num_beams=2, params=ll.SamplingParams.create(1, temperature=0.5)),
            r"params.temperature\[0\] is set, but beam search is deterministic",
        ),
        (
            dict(num_beams=2, params=ll.SamplingParams.create(1), stop="x"),
            r"give stop and stop_sequences in params or as arguments, not both",
        ),
        (dict(num_beams=2, stop="x"), r"stop strings need a model that carries a tokenizer"),
    ],
)
def test_bad_input(small, kwargs, match):
    model = small
    kwargs = {"max_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        ll.beam_search(model, [[1, 2, 3]], **kwargs)


# Stop strings and stop sequences: a model whose logits are random floats, a function of the
# last token, its position and the sum of all tokens so far (so beams with the same last
# token differ, and a beam whose cache rows were not gathered by parent would show), with
# a byte tokenizer, against a float64 NumPy beam search over the same logits.
PIECES = [b"a", b"b", b"c", b"ab", b"ca", b"bc", b" ", b"x", b"cab", b"y", b"ba", b"z"]


def _stop_apply(params, tokens, positions, cache):
    last, mix = params  # [V, P, V], [V, V] f32
    vocab = mix.shape[0]
    batch, _ = tokens.shape
    idx = jnp.where(positions >= 0, positions, cache.shape[1])
    cache = cache.at[jnp.arange(batch)[:, None], idx].set(tokens, mode="drop")
    total = jnp.sum(jnp.maximum(cache, 0), axis=1) % vocab  # [B]
    logits = last[tokens[:, -1], jnp.maximum(positions[:, -1], 0)] + mix[total]
    return logits, cache


def _stop_cache(batch, length):
    return jnp.full((batch, length), -1, jnp.int32)


def stop_model(seed):
    rng = np.random.default_rng(seed)
    vocab = len(PIECES)
    last = rng.normal(0, 2.0, (vocab, 64, vocab)).astype(np.float32)
    mix = rng.normal(0, 2.0, (vocab, vocab)).astype(np.float32)
    model = ll.FunctionModel(
        apply_fn=_stop_apply,
        params=(jnp.asarray(last), jnp.asarray(mix)),
        init_cache=_stop_cache,
        vocab_size=vocab,
        max_length=64,
        tokenizer=ByteTokenizer(PIECES),
    )
    return model, last.astype(np.float64), mix.astype(np.float64)


def _text(seq):
    return b"".join(PIECES[t] for t in seq).decode()


def reference_beam_search(last, mix, prompt, *, num_beams, max_tokens, length_penalty,
                          stop=(), stop_sequences=(), min_tokens=0):  # fmt: skip
    """transformers' rule (early_stopping=True, no stop ids) in float64, a candidate ending
    when its text has a stop string ending in its last token's bytes or its tokens end with
    a stop sequence (from `min_tokens` tokens on), or at max_tokens.
    Returns [(score, tokens, text, finish_reason)], best first."""
    stops, stop_seqs = stop, stop_sequences
    vocab, k = mix.shape[0], num_beams
    c = 2 * k
    running = [([], 0.0 if b == 0 else MASK) for b in range(k)]
    pool = []
    for _ in range(max_tokens):
        cands = []
        for seq, total in running:
            full = prompt + seq
            z = last[full[-1], len(full) - 1] + mix[sum(full) % vocab]
            logp = z - z.max() - np.log(np.sum(np.exp(z - z.max())))
            cands += [(total + logp[v], seq + [v]) for v in range(vocab)]
        top = sorted(cands, key=lambda x: -x[0])[:c]

        def ends(seq):  # "string", "sequence", "length" or None (generate's priority)
            if len(seq) >= min_tokens and any(seq[-len(s) :] == list(s) for s in stop_seqs):
                return "sequence"
            data, before = _text(seq).encode(), len(_text(seq[:-1]).encode())
            hits = [data.find(s.encode(), max(0, before - len(s) + 1)) >= 0 for s in stops]
            if len(seq) >= min_tokens and any(hits):
                return "string"
            return "length" if len(seq) >= max_tokens else None

        ended = [ends(seq) for _, seq in top]
        for i, ((total, seq), e) in enumerate(zip(top, ended, strict=True)):
            if e and i < k:
                pool.append((total / len(seq) ** length_penalty, seq, e))
        pool = sorted(pool, key=lambda x: -x[0])[:k]
        live = sorted(((t + MASK * bool(e), s) for (t, s), e in zip(top, ended, strict=True)),
                      key=lambda x: -x[0])  # fmt: skip
        running = [(s, t) for t, s in live[:k]]
        if len(pool) == k or all(ended):
            break
    out = []
    for score, seq, reason in pool:
        text = _text(seq)
        if reason == "string":  # cut at the earliest occurrence ending after token min - 1
            head = len(_text(seq[: max(min_tokens - 1, 0)]))
            found = [text.find(s, max(0, head - len(s) + 1)) for s in stops]
            text = text[: min(i for i in found if i >= 0)]
        out.append((score, seq, text, "length" if reason == "length" else "stop", reason))
    return out


def check_stops(seed, prompts, **kwargs):
    model, last, mix = stop_model(seed)
    ours = ll.beam_search(model, prompts, num_return_sequences=kwargs["num_beams"], **kwargs)
    stopped = 0
    for prompt, beams in zip(prompts, ours, strict=True):
        want = reference_beam_search(last, mix, prompt, **kwargs)
        assert [b.token_ids for b in beams] == [w[1] for w in want]
        assert [b.score for b in beams] == pytest.approx([w[0] for w in want], abs=1e-4)
        assert [b.text for b in beams] == [w[2] for w in want]
        assert [b.finish_reason for b in beams] == [w[3] for w in want]
        stopped += sum(b.finish_reason == "stop" for b in beams)
        for b, w in zip(beams, want, strict=True):
            if w[4] == "sequence":
                assert b.stop_reason in [list(q) for q in kwargs["stop_sequences"]]
                assert b.token_ids[-len(b.stop_reason) :] == b.stop_reason
            elif w[4] == "string":
                assert b.stop_reason in kwargs["stop"]
                assert _text(b.token_ids).startswith(b.text + b.stop_reason)
            else:
                assert b.stop_reason is None
    assert stopped > 0  # the stops ended some of the returned hypotheses
    return ours


STOP_PROMPTS = [[1, 4, 2], [7], [3, 3, 0, 5, 9]]


def test_stop_strings_end_beams():
    """Multi-token stop strings: a beam's text window must be its parent's."""
    check_stops(0, STOP_PROMPTS, num_beams=3, max_tokens=8, length_penalty=1.0, stop=["abc"])


def test_stop_strings_and_sequences_with_min_tokens():
    check_stops(
        0, STOP_PROMPTS, num_beams=2, max_tokens=8, length_penalty=0.5, stop=["ca", "bcb"],
        stop_sequences=[[3, 0], [2, 2]], min_tokens=3,
    )  # fmt: skip
