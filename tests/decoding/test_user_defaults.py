"""What a transformers or vLLM user types first: params as a SamplingParams, a dict or
keywords over the checkpoint's defaults, `max_new_tokens`, `generate_many(max_tokens=)` as a
default, per-request text, and `ll.sample`'s top logprobs exactly as wide as asked."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.conversation import CHAT_MAX_TOKENS, chat_params
from logitloop.decoding.engine.plan import sampling_params
from logitloop.models.loading import SHIPPED_MODEL_DIR
from logitloop.models.tokenizer import Tokenizer

from .scripted import expected, make_model

V = 40


@pytest.fixture
def table():
    return np.random.default_rng().integers(0, V, size=(V, 256))


@pytest.fixture
def prompts():
    rng = np.random.default_rng()
    return [rng.integers(0, V, size=int(rng.integers(1, 6))).tolist() for _ in range(3)]


def test_generate_without_params_uses_the_defaults(table, prompts):
    res = ll.generate(make_model(table), prompts)  # no EOS: every row runs to max_tokens
    assert res.num_tokens == [16] * len(prompts)


@pytest.mark.parametrize("form", ["keywords", "dict", "dict+keywords", "SamplingParams"])
def test_settings_as_keywords_dict_or_params_broadcast_to_every_prompt(table, prompts, form):
    model = make_model(table)
    if form == "keywords":
        res = ll.generate(model, prompts, temperature=0.0, max_new_tokens=5)
    elif form == "dict":
        res = ll.generate(model, prompts, {"temperature": 0.0, "max_new_tokens": 5})
    elif form == "dict+keywords":  # keywords win over the dict
        res = ll.generate(model, prompts, {"temperature": 0.0, "max_tokens": 9}, max_tokens=5)
    else:
        params = ll.SamplingParams.create(len(prompts), temperature=0.0, max_tokens=5)
        res = ll.generate(model, prompts, params)
    assert res.token_ids == [expected(table, p, 5)[0] for p in prompts]


def test_stream_takes_keywords(table, prompts):
    model = make_model(table)
    events = list(ll.stream(model, prompts, temperature=0.0, max_new_tokens=4, chunk_steps=2))
    for r, p in enumerate(prompts):
        assert [t for e in events if e.row == r for t in e.token_ids] == expected(table, p, 4)[0]


def test_unknown_keyword_names_it_and_both_accepted_sets(table):
    with pytest.raises(TypeError) as err:
        ll.generate(make_model(table), [[1]], temprature=0.5)
    message = str(err.value)
    assert "'temprature'" in message
    assert "ignore_eos" in message and "max_new_tokens" in message and "top_p" in message


def test_settings_beside_a_sampling_params_are_refused(table):
    with pytest.raises(TypeError, match="temperature"):
        ll.generate(make_model(table), [[1]], ll.SamplingParams.create(1), temperature=0.0)


def test_max_new_tokens_is_max_tokens():
    assert np.asarray(ll.SamplingParams.create(2, max_new_tokens=3).max_tokens).tolist() == [3, 3]
    assert np.asarray(ll.SamplingParams.create(1).max_tokens).tolist() == [16]
    with pytest.raises(ValueError, match="max_tokens = 4 and its alias max_new_tokens = 3"):
        ll.SamplingParams.create(1, max_tokens=4, max_new_tokens=3)
    with pytest.raises(ValueError, match="max_tokens = 0 is outside"):
        ll.SamplingParams.create(1, max_new_tokens=0)


def _checkpoint(folder, **config):
    """A checkpoint folder that holds only its generation_config.json."""
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_checkpoint_defaults_under_the_users_settings(tmp_path):
    folder = _checkpoint(tmp_path, temperature=0.9, top_k=5, max_new_tokens=7)
    params = sampling_params(folder, 2, {"temperature": 0.5}, {"top_p": 0.8})
    assert np.asarray(params.max_tokens).tolist() == [7, 7]
    assert np.asarray(params.top_k).tolist() == [5, 5]
    np.testing.assert_allclose(np.asarray(params.temperature), [0.5, 0.5])
    np.testing.assert_allclose(np.asarray(params.top_p), [0.8, 0.8])


def test_chat_defaults_are_the_checkpoints_else_256_tokens(tmp_path):
    with_max = _checkpoint(tmp_path / "a", max_new_tokens=24)
    without = _checkpoint(tmp_path / "b", top_k=3)
    assert np.asarray(chat_params(with_max, 1).max_tokens).tolist() == [24]
    assert np.asarray(chat_params(without, 1).max_tokens).tolist() == [CHAT_MAX_TOKENS] == [256]
    assert np.asarray(chat_params(without, 1, {"max_new_tokens": 5}).max_tokens).tolist() == [5]
    assert np.asarray(chat_params(without, 1).top_k).tolist() == [3]


@pytest.fixture(scope="module")
def text_model():
    """A scripted model over the shipped tokenizer's vocabulary: results with text."""
    tokenizer = Tokenizer.from_file(SHIPPED_MODEL_DIR / "tokenizer.json")
    vocab = tokenizer.vocab_size
    table = np.random.default_rng().integers(0, vocab, size=(vocab, 64))
    return make_model(table, tokenizer=tokenizer), table


# One job shape for every generate_many call below (slots, buffer and prompt buckets): it
# compiles once.
JOB = dict(slots=2, max_tokens_bound=8, max_prompt_len=5)


def test_generate_many_max_tokens_is_the_default_of_requests_without_one(text_model):
    model, table = text_model
    prompts = [np.random.default_rng().integers(0, len(table), size=3).tolist() for _ in range(3)]
    requests = [prompts[0], (prompts[1], {"max_tokens": 7}), (prompts[2], {"max_new_tokens": 2})]
    job = {k: v for k, v in JOB.items() if k != "max_tokens_bound"}  # the bound: 7, from them
    got = ll.generate_many(model, requests, max_tokens=4, temperature=0.0, **job)
    assert [r.num_tokens for r in got] == [[4], [7], [2]]
    for r, p, m in zip(got, prompts, [4, 7, 2], strict=True):
        assert r.token_ids == [expected(table, p, m)[0]]
    with pytest.raises(ValueError, match="over the job's max_tokens_bound = 3"):
        ll.generate_many(model, requests, max_tokens=4, slots=2, max_tokens_bound=3)


def test_max_tokens_over_requests_that_all_set_their_own_warns(text_model):
    model, _ = text_model
    with pytest.warns(DeprecationWarning, match="max_tokens_bound"):
        ll.generate_many(model, [([1], {"max_tokens": 2})], max_tokens=8, slots=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ll.generate_many(model, [[1], ([2], {"max_tokens": 2})], max_tokens=3, **JOB)


def test_per_request_text_is_a_string_when_n_is_1_and_a_list_when_n_is_more(text_model):
    model, _ = text_model
    tokenizer = model.tokenizer
    one = ll.generate_many(model, [[5, 6], [7]], max_tokens=4, **JOB)
    for r in one:
        assert isinstance(r.text, str) and r.text == tokenizer.decode(r.token_ids[0])
        assert r.texts == [r.text]
    (two,) = ll.generate_many(model, [[5, 6]], n=2, max_tokens=4, **JOB)
    assert isinstance(two.text, list) and len(two.text) == 2 and two.texts == two.text
    assert two.text == [tokenizer.decode(ids) for ids in two.token_ids]


def _top_reference(logits: np.ndarray, n: int) -> np.ndarray:
    """The ids of the n largest log-softmax values of a row, in float64."""
    x = logits.astype(np.float64)
    logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
    return np.argsort(-logp, kind="stable")[:n]


def test_sample_top_logprobs_hold_each_rows_n_then_padding():
    """`ll.sample`'s top logprobs are exactly as wide as the widest row asks: row r's first
    n columns are its n best, the rest -1 / -inf."""
    rng = np.random.default_rng()
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    ns = [int(n) for n in rng.integers(1, 21, size=3)]
    out = ll.sample(
        jnp.asarray(logits), ll.SamplingParams.create(3, logprobs=ns), jnp.zeros(3, jnp.int32)
    )
    ids, values = np.asarray(out.top_logprobs.ids), np.asarray(out.top_logprobs.values)
    assert ids.shape == values.shape == (3, max(ns))
    for r, n in enumerate(ns):
        assert ids[r, :n].tolist() == _top_reference(logits[r], n).tolist()
        assert np.all(ids[r, n:] == -1) and np.all(values[r, n:] == -np.inf)
