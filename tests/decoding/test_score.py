"""`ll.score`: continuation log-probabilities against transformers, a float64 reference of
the sampler's order, and `generate`'s own log-probabilities."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from tests.decoding.random_llama import small_llama
from tests.decoding.reference import AmbiguousBoundary, reference_distribution
from tests.models.tiny_checkpoints import build_hf_model, random_prompts, save_hf_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


# The Llama case runs at XLA's default compile options (its 2e-5 bound; conftest.py).
LLAMA = pytest.param("llama", marks=pytest.mark.default_codegen)


@pytest.fixture(scope="module", params=[LLAMA, "gpt2"])
def hf_pair(request, tmp_path_factory):
    hf = build_hf_model(request.param, seed=3)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, ll.load_pretrained(folder)


def hf_scores(hf, prompt, cont):
    """float32 log_softmax of transformers' logits at the continuation's positions [C, V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + cont])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) + len(cont) - 1]
    return lp.numpy()


def test_raw_logprobs_match_transformers(hf_pair):
    """Within 2e-5: the random Llama's float32 logits themselves differ from transformers' by
    up to ~1e-5 (measured 0.9e-5 on tokens, 1.4e-5 on alternatives over three seeds; GPT-2
    and the shipped model stay under 1e-5)."""
    hf, model = hf_pair
    vocab = model.config.vocab_size
    prompts = random_prompts(vocab, [5, 11, 3], seed=4)
    conts = random_prompts(vocab, [4, 1, 9], seed=5)
    out = ll.score(model, prompts, conts, top_logprobs=3)
    for p, c, s in zip(prompts, conts, out, strict=True):
        want = hf_scores(hf, p, c)
        got_tok = want[np.arange(len(c)), c]
        np.testing.assert_allclose(s.raw_logprobs, got_tok, rtol=0, atol=2e-5)
        assert s.is_argmax == [bool(np.argmax(w) == t) for w, t in zip(want, c, strict=True)]
        for j, top in enumerate(s.top_logprobs):
            ids = np.argsort(-want[j], kind="stable")[:3]
            assert list(top) == ids.tolist()
            np.testing.assert_allclose(list(top.values()), want[j, ids], rtol=0, atol=2e-5)
        assert s.raw_logprob_sum == pytest.approx(float(np.sum(got_tok)), abs=1e-4)
    # One-token choices of one prompt (an MMLU answer letter): the shared prompt pass
    # alone, no continuation pass.
    choices = [[t] for t in random_prompts(vocab, [1, 1, 1], seed=6) for t in t]
    out = ll.score(model, [prompts[0]] * 3 + [prompts[1]], choices + [[conts[0][0]]])
    for p, s in zip([prompts[0]] * 3 + [prompts[1]], out, strict=True):
        want = hf_scores(hf, p, s.token_ids)[0, s.token_ids[0]]
        np.testing.assert_allclose(s.raw_logprobs, [want], rtol=0, atol=2e-5)


def test_shipped_model_strings_in_context():
    from transformers import AutoModelForCausalLM

    from logitloop.models.loading import SHIPPED_MODEL_DIR

    model = ll.load_pretrained(dtype=jnp.float32)
    tok = model.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL_DIR, dtype=torch.float32).eval()
    pairs = [("The quick brown fox ", "jumps over the lazy dog."), ("Question: 2+2=", " 4")]
    out = ll.score(model, [p for p, _ in pairs], [c for _, c in pairs])
    for (ctx, cont), s in zip(pairs, out, strict=True):
        # lm-evaluation-harness's split: the context's trailing space moves to the
        # continuation, whose ids are those of the whole text after the context's.
        p_ids = tok.encode(ctx.rstrip())
        c_ids = tok.encode(ctx + cont)[len(p_ids) :]
        assert s.prompt_token_ids == p_ids and s.token_ids == c_ids
        want = hf_scores(hf, p_ids, c_ids)
        np.testing.assert_allclose(
            s.raw_logprobs, want[np.arange(len(c_ids)), c_ids], rtol=0, atol=1e-5
        )
        assert s.text == tok.decode(c_ids)


def _table_apply(table, tokens, positions, cache):
    """Logits = table[token fed] for every column: a model whose logits are known."""
    del positions
    return table[tokens], cache


def _table_cache(batch, length):
    return jnp.zeros((batch, 1), jnp.int32)


def table_model(table: np.ndarray, eos=(2,)) -> ll.FunctionModel:
    return ll.FunctionModel(
        apply_fn=_table_apply,
        params=jnp.asarray(table, jnp.float32),
        init_cache=_table_cache,
        vocab_size=table.shape[0],
        max_length=64,
        eos_token_ids=eos,
    )


KNOBS = [
    dict(temperature=0.7, top_k=5, repetition_penalty=1.3),
    dict(temperature=1.2, top_p=0.8, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=0.9, min_p=0.1, logit_bias={4: 3.0}, banned_token_ids=[5]),
    dict(temperature=0.0, repetition_penalty=1.5),
    dict(temperature=1.0, min_tokens=3, top_k=8, top_p=0.9),
]


def test_processed_logprobs_match_float64_reference():
    vocab, eos = 24, 2
    rng = np.random.default_rng(0)
    for _ in range(20):
        table = rng.normal(0.0, 2.0, (vocab, vocab)).astype(np.float32)
        prompts = [rng.integers(3, vocab, size=n).tolist() for n in (3, 5, 2, 4, 6)]
        conts = [rng.integers(0, vocab, size=n).tolist() for n in (6, 4, 5, 3, 5)]
        for c in conts:
            c[0] = int(np.argmax(table[3]))  # greedy and filters keep some tokens
        expect = []
        try:
            for p, c, k in zip(prompts, conts, KNOBS, strict=True):
                row = []
                for j, t in enumerate(c):
                    probs, kept = reference_distribution(
                        table[([*p, *c])[len(p) + j - 1]],
                        **{
                            "banned": k.get("banned_token_ids", ()),
                            "stop_token_ids": [eos],
                            **{key: v for key, v in k.items() if key != "banned_token_ids"},
                        },
                        position=j,
                        prompt_tokens=p,
                        generated_tokens=c[:j],
                        margin=1e-4,
                    )
                    row.append(np.log(probs[t]) if kept[t] else -np.inf)
                expect.append(row)
        except AmbiguousBoundary:
            continue
        break
    else:
        pytest.fail("no unambiguous draw in 20 attempts")
    params = ll.SamplingParams.create(
        5,
        temperature=[k["temperature"] for k in KNOBS],
        top_k=[k.get("top_k", 0) for k in KNOBS],
        top_p=[k.get("top_p", 1.0) for k in KNOBS],
        min_p=[k.get("min_p", 0.0) for k in KNOBS],
        repetition_penalty=[k.get("repetition_penalty", 1.0) for k in KNOBS],
        presence_penalty=[k.get("presence_penalty", 0.0) for k in KNOBS],
        frequency_penalty=[k.get("frequency_penalty", 0.0) for k in KNOBS],
        logit_bias=[k.get("logit_bias", {}) for k in KNOBS],
        banned_token_ids=[k.get("banned_token_ids", []) for k in KNOBS],
        min_tokens=[k.get("min_tokens", 0) for k in KNOBS],
        max_tokens=8,
    )
    out = ll.score(table_model(table, (eos,)), prompts, conts, params, batch_size=4)
    for s, want in zip(out, expect, strict=True):
        got = np.asarray(s.logprobs)
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], np.asarray(want)[finite], rtol=0, atol=1e-5)
    assert any(np.isinf(s.logprobs).any() for s in out)  # some token was filtered out


@pytest.fixture(scope="module")
def llama():
    return small_llama(64, 128, seed=0)


GEN_PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20]]


def _gen_params():
    return ll.SamplingParams.create(
        3, temperature=[0.0, 0.8, 1.1], top_k=[0, 10, 0], top_p=[1.0, 0.9, 0.95],
        repetition_penalty=1.2, max_tokens=6, seed=[1, 2, 3],
    )  # fmt: skip


@pytest.mark.slow
def test_score_what_generate_drew_is_identical(llama):
    """deterministic=True: bit for bit (the prompt pass and the generated tokens' pass are
    those of `generate`, module docstring of `logitloop.decoding.engine.score`)."""
    params = _gen_params()
    gen = ll.generate(llama, GEN_PROMPTS, params, ignore_eos=True, deterministic=True)
    out = ll.score(llama, GEN_PROMPTS, gen.token_ids, params, deterministic=True)
    for r, s in enumerate(out):
        assert s.raw_logprobs == gen.raw_logprobs[r]
        assert s.logprobs == gen.logprobs[r]


def test_score_what_generate_drew(llama):
    """The default mode: other shapes, so float32 rounding apart (the deterministic test
    above, `-m slow`, checks bit identity). And `prompt_logprobs`: the prompts' scores."""
    params = _gen_params()
    gen = ll.generate(llama, GEN_PROMPTS, params, ignore_eos=True, prompt_logprobs=2)
    out = ll.score(llama, GEN_PROMPTS, gen.token_ids, params)
    for r, s in enumerate(out):
        np.testing.assert_allclose(s.raw_logprobs, gen.raw_logprobs[r], rtol=0, atol=1e-5)
        np.testing.assert_allclose(s.logprobs, gen.logprobs[r], rtol=0, atol=1e-5)
    direct = ll.score(llama, [p[:1] for p in GEN_PROMPTS[:2]], [p[1:] for p in GEN_PROMPTS[:2]],
                      top_logprobs=2)  # fmt: skip
    assert gen.prompt_logprobs[:2] == direct
    assert len(direct[1].top_logprobs[0]) == 2
    assert gen.prompt_logprobs[2].token_ids == [] and gen.prompt_logprobs[2].top_logprobs == []


def test_batches_and_progress_do_not_change_scores(llama):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (2, 9, 4, 15, 5)]
    conts = [rng.integers(0, 64, size=n).tolist() for n in (3, 1, 4, 2, 4)]
    seen = []
    small = ll.score(llama, prompts, conts, batch_size=2, progress=lambda d, t: seen.append((d, t)))
    whole = ll.score(llama, prompts, conts, batch_size=8)
    assert seen == [(2, 5), (4, 5), (5, 5)]
    for a, b in zip(small, whole, strict=True):
        assert a.token_ids == b.token_ids and a.prompt_token_ids == b.prompt_token_ids
        np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "prompts, conts, match",
    [
        ([[1, 2]], [[]], r"continuations\[0\] is empty"),
        ([[1, 2], [3]], [[4], [5, 6]] + [[7]], r"prompts has 2 entries but continuations has 3"),
        ([[1, 2], [3] * 100], [[4], [5] * 30], r"continuations\[1\] has 30 tokens .* 128"),
        ([[1, 2]], [[64]], r"continuations\[0\] holds token id 64"),
        ([[1, 2]], ["text"], r"continuations\[0\] is a string but prompts\[0\] is token ids"),
    ],
)
def test_bad_input_names_the_argument_and_row(llama, prompts, conts, match):
    with pytest.raises(ValueError, match=match):
        ll.score(llama, prompts, conts)


def test_bad_params_and_top_logprobs(llama):
    with pytest.raises(ValueError, match=r"top_logprobs = 21 is outside the allowed range"):
        ll.score(llama, [[1]], [[2]], top_logprobs=21)
    params = ll.SamplingParams.create(2)
    with pytest.raises(ValueError, match=r"params has batch_size 2 but there are 1 pairs"):
        ll.score(llama, [[1]], [[2]], params)


def test_a_pair_one_token_over_the_context_fits_its_last_token_is_never_fed():
    """lm-eval's rolling windows fill the context and score one token more: the last
    continuation token is predicted, never fed, so 64 + 1 tokens fit a 64-token model."""
    vocab = 16
    rng = np.random.default_rng(1)
    table = rng.normal(0.0, 2.0, (vocab, vocab)).astype(np.float32)
    prompt = rng.integers(3, vocab, size=60).tolist()
    cont = rng.integers(3, vocab, size=5).tolist()
    (got,) = ll.score(table_model(table), [prompt], [cont])
    whole = prompt + cont
    logits = table.astype(np.float64)[whole[59:64]]  # the logits each continuation token had
    want = logits[np.arange(5), cont] - np.log(np.exp(logits).sum(axis=1))
    np.testing.assert_allclose(got.raw_logprobs, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"continuations\[0\] has 6 tokens .* never fed"):
        ll.score(table_model(table), [prompt], [cont + [3]])


def _choice_pairs(vocab: int, seed: int, shape=((13, 3), (6, 3), (11, 2))):
    """Questions of (prompt length, choices) as lm-eval's multiple-choice requests come: a
    question's rows share its prompt ids."""
    rng = np.random.default_rng(seed)
    prompts, conts = [], []
    for plen, choices in shape:
        prompt = rng.integers(3, vocab, size=plen).tolist()
        for _ in range(choices):
            prompts.append(prompt)
            conts.append(rng.integers(3, vocab, size=int(rng.integers(1, 5))).tolist())
    return prompts, conts


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_shared_prompts_score_as_unshared_bit_for_bit(dtype):
    """deterministic=True: a question's choices share one prompt pass (each row gathers
    its prompt's cache), and every value is the unshared pair's, bit for bit; batches of 4
    split the second question across two batches. One prompt and continuation bucket, so
    two programs compile (2 shared prompts of 4 rows; 4 rows unshared)."""
    model = small_llama(64, 128, seed=0, dtype=jnp.dtype(dtype))
    prompts, conts = _choice_pairs(64, seed=11)
    kw = dict(deterministic=True, top_logprobs=2, batch_size=4)
    shared = ll.score(model, prompts, conts, **kw)
    alone = ll.score(model, prompts, conts, share_prompts=False, **kw)
    for a, b in zip(shared, alone, strict=True):
        assert (a.raw_logprobs, a.is_argmax, a.top_logprobs) == (
            b.raw_logprobs, b.is_argmax, b.top_logprobs,
        )  # fmt: skip


def test_shared_prompts_groups_a_batch_by_prompt():
    from logitloop.decoding.engine.score import pair_order
    from logitloop.decoding.engine.score_rows import shared_prompts

    prompts, conts = _choice_pairs(64, 2, ((13, 4), (6, 3), (21, 2), (9, 1)))
    order = pair_order(prompts, conts, share=True)
    groups = [tuple(prompts[r]) for r in order]
    assert len(groups) == len(prompts)
    assert [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]] == list(
        dict.fromkeys(groups)
    )  # each prompt's rows are next to each other
    distinct, row_prompt = shared_prompts([prompts[r] for r in order[:7]])
    assert len(distinct) == 4  # 3 prompts in 7 rows, padded to a power of two
    assert [distinct[i] for i in row_prompt] == [prompts[r] for r in order[:7]]
    assert shared_prompts([[1], [2], [3]]) is None  # nothing shared: the plain pass
    assert shared_prompts([[1], [1], [2]], row_multiple=4) is None  # a mesh's 4 rows: none saved


@pytest.mark.parametrize("deterministic", [False, True])
def test_new_lengths_and_row_counts_inside_their_buckets_compile_nothing(
    llama, deterministic, compile_counter
):
    """After one call, other continuation lengths (5..8 tokens: the 8-column bucket),
    prompt lengths (up to 16 columns) and row counts (3..4: the 4-row bucket) compile
    nothing (docs/scoring.md, "What compiles"); the padding rows leave each row's values
    as it has them alone (deterministic: bit for bit)."""
    rng = np.random.default_rng(5)

    def pairs(rows: int, plen: int, clen: int):
        return (
            [rng.integers(3, 64, size=plen - r % 2).tolist() for r in range(rows)],
            [rng.integers(3, 64, size=clen - r % 2).tolist() for r in range(rows)],
        )

    ll.score(llama, *pairs(3, 9, 5), deterministic=deterministic)
    with compile_counter as c:
        for rows, plen, clen in ((4, 12, 8), (3, 16, 6), (4, 5, 7)):
            prompts, conts = pairs(rows, plen, clen)
            out = ll.score(llama, prompts, conts, deterministic=deterministic)
    assert c.count == 0
    (alone,) = ll.score(llama, prompts[1:2], conts[1:2], deterministic=deterministic)
    if deterministic:
        assert alone.raw_logprobs == out[1].raw_logprobs
    else:
        np.testing.assert_allclose(alone.raw_logprobs, out[1].raw_logprobs, rtol=0, atol=1e-5)
