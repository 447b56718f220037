"""Continuous batching: every request gets exactly what `generate` gives it alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import logitloop as ll
from logitloop.decoding.engine.batching import Request, generate_many, iter_generate_many
from logitloop.models import LlamaConfig, LlamaModel
from tests.decoding.scripted import ByteTokenizer

from .scripted import expected, make_model

V = 40
EOS = 7


@pytest.fixture(scope="module")
def table():
    return np.random.default_rng(1234).integers(0, V, size=(V, 256))


@pytest.fixture(scope="module")
def model(table):
    return make_model(table, eos=(EOS,))


def alone(model, prompt, knobs, n=1):
    if not isinstance(knobs, ll.SamplingParams):
        knobs = ll.SamplingParams.create(1, **knobs)
    return ll.generate(model, [prompt], knobs, n=n)


def assert_same(got, want, exact=True):
    """Every field of two one-prompt GenerationResults."""
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    assert got.stop_reason == want.stop_reason
    assert got.num_tokens == want.num_tokens
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.texts == want.text  # generate_many: a str for one row, generate: a list
    assert got.error == want.error
    tol = {} if exact else {"rel": 1e-4, "abs": 1e-4}
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a == pytest.approx(b, **tol)
    for a, b in zip(got.raw_logprobs, want.raw_logprobs, strict=True):
        assert a == pytest.approx(b, **tol)
    assert (got.top_logprobs is None) == (want.top_logprobs is None)
    if want.top_logprobs is not None:
        for rows_a, rows_b in zip(got.top_logprobs, want.top_logprobs, strict=True):
            for a, b in zip(rows_a, rows_b, strict=True):
                assert a.keys() == b.keys()
                assert list(a.values()) == pytest.approx(list(b.values()), **tol)


# Every job shares these bounds (and so its compiled programs): P = 16, N = 32.
BOUNDS = dict(slots=4, chunk_steps=4, prefill_batch=2, max_prompt_len=15, max_tokens_bound=32)

# A mix of settings, cycled over the requests: greedy and seeded sampling, truncation,
# penalties, masks, min_tokens, several stop ids, a repetition guard. Every request also
# has one two-token stop sequence (taken from its greedy path, so it often occurs) and
# max_tokens <= 16: the reference runs then all have one shape, and so compile once.
SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=4.0, seed=11),
    dict(temperature=4.0, seed=12, top_k=5),
    dict(temperature=3.0, seed=13, top_p=0.5, min_p=0.05),
    dict(temperature=0.0, repetition_penalty=1.5, logit_bias={3: 9.0, 4: -3.0}),
    dict(temperature=4.0, seed=14, presence_penalty=1.0, frequency_penalty=0.5),
    dict(temperature=4.0, seed=15, allowed_token_ids=[1, 2, 7, 9], min_tokens=3),
    dict(temperature=0.0, stop_token_ids=[5, 9, 11]),
    dict(temperature=4.0, seed=16, banned_token_ids=[1, 2, 3]),
    dict(temperature=0.0, repetition_guard=(4, 2)),
]


def _requests(table, count, rng):
    reqs = []
    for i in range(count):
        knobs = dict(SETTINGS[i % len(SETTINGS)], max_tokens=int(rng.integers(1, 17)))
        prompt = [int(t) for t in rng.integers(0, V, size=int(rng.integers(1, 16)))]
        path = expected(table, prompt, 16)[0]
        start = int(rng.integers(0, 8))
        knobs["stop_sequences"] = [path[start : start + 2]]
        if i % 4 == 3:  # a settings object as vLLM users write one: no batch_size
            knobs = ll.SamplingParams.create(**knobs)
        reqs.append(Request(prompt, knobs, id=f"r{i}"))
    return reqs


def test_scripted_identity_across_slot_reuse(model, table):
    rng = np.random.default_rng(0)
    reqs = _requests(table, 27, rng)
    results = generate_many(model, reqs, **BOUNDS)
    assert len(results) == len(reqs)
    for req, got in zip(reqs, results, strict=True):
        assert_same(got, alone(model, req.prompt, req.params))
    reasons = {r.finish_reason[0] for r in results}
    assert {"stop", "length"} <= reasons <= {"stop", "length", "repetition"}
    assert any(isinstance(r.stop_reason[0], list) for r in results)  # a stop sequence hit
    assert len({r.num_tokens[0] for r in results}) > 10


def greedy(table, prompt, max_tokens):
    return expected(table, [int(t) for t in prompt], max_tokens, stop_ids=(EOS,))[0]


def test_job_defaults_pairs_and_bare_prompts(model, table):
    reqs = [[1, 2, 3], ([4, 5], {"max_tokens": 3}), ([6], None), np.asarray([8, 9])]
    results = generate_many(model, reqs, {"temperature": 0.0, "max_tokens": 20}, **BOUNDS)
    prompts = [[1, 2, 3], [4, 5], [6], [8, 9]]
    for p, m, got in zip(prompts, [20, 3, 20, 20], results, strict=True):
        assert got.token_ids == [greedy(table, p, m)]
        assert got.prompt_token_ids == [p]


JOBS = [([1], 30), ([2], 2), ([3], 3), ([4], 25), ([5], 1), ([6], 9), ([8], 4), ([9], 12)]


def test_generator_input_and_completion_order(model, table):
    consumed = []

    def gen():
        for i, (p, m) in enumerate(JOBS):
            consumed.append(i)
            yield Request(p, {"temperature": 0.0, "max_tokens": m})

    it = iter_generate_many(model, gen(), **BOUNDS)
    first, _ = next(it)
    assert first == 1  # the short request behind the long one finishes first
    # read lazily: the first slots' worth, then one prefill batch ahead while a chunk runs
    assert len(consumed) <= BOUNDS["slots"] + BOUNDS["prefill_batch"] < len(JOBS)
    order = [first] + [i for i, _ in it]
    assert sorted(order) == list(range(len(JOBS)))
    assert order.index(2) < order.index(0)  # completion order, not input order
    got = generate_many(model, gen(), **BOUNDS)  # results in input order
    for (p, m), res in zip(JOBS, got, strict=True):
        assert res.token_ids == [greedy(table, p, m)]


def test_zero_requests(model):
    assert generate_many(model, [], **BOUNDS) == []
    assert generate_many(model, iter(()), **BOUNDS) == []
    assert list(iter_generate_many(model, (r for r in []), max_tokens_bound=8)) == []


def test_more_slots_than_requests(model, table):
    knobs = dict(temperature=0.0, max_tokens=9)
    results = generate_many(model, [([1, 2], knobs), ([3], dict(knobs, max_tokens=30))], **BOUNDS)
    assert results[0].token_ids == [greedy(table, [1, 2], 9)]
    assert results[1].token_ids == [greedy(table, [3], 30)]


def test_n_samples_and_logprobs_added_mid_job(model):
    knobs = dict(temperature=5.0, seed=4, max_tokens=12, logprobs=2)
    reqs = [
        ([4], dict(knobs, logprobs=0, max_tokens=30)),  # these two fill the 4 slots,
        ([5], dict(knobs, logprobs=0, max_tokens=3, seed=6)),  # without logprobs
        ([1], knobs),  # admitted while [4] runs: top logprobs join the live state
        ([2, 3], dict(knobs, seed=5)),
    ]
    results = generate_many(model, reqs, **BOUNDS, n=2)
    for (p, k), got in zip(reqs[2:], results[2:], strict=True):
        assert_same(got, alone(model, p, k, n=2))
    assert len({tuple(t) for t in results[2].token_ids}) > 1  # the samples differ
    for (p, k), got in zip(reqs[:2], results[:2], strict=True):
        assert got.top_logprobs is None  # a request without logprobs gets none
        want = alone(model, p, dict(k, logprobs=2), n=2)  # same tokens, other shape
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs


@pytest.mark.slow  # about 35 s: programs of three widths
def test_top_logprobs_widen_mid_job_and_rows_in_flight_keep_theirs(model):
    """Top logprobs are as wide as the widest request asks: a wider request admitted while
    a narrower one runs widens the slots' buffers, and the running rows keep theirs."""
    knobs = dict(temperature=5.0, seed=4, max_tokens=30, logprobs=2)
    reqs = [
        ([4], knobs),  # these two fill the 4 slots; [4]'s rows run on
        ([5], dict(knobs, logprobs=0, max_tokens=3, seed=6)),
        ([2, 3], dict(knobs, seed=5, logprobs=4, max_tokens=12)),  # admitted while [4] runs
    ]
    results = generate_many(model, reqs, **BOUNDS, n=2)
    for (p, k), got in zip(reqs, results, strict=True):
        assert_same(got, alone(model, p, k, n=2))
    assert [len(d) for d in results[2].top_logprobs[0]] == [4] * results[2].num_tokens[0]


def test_ignore_eos(model, table):
    reqs = [([3], {"temperature": 0.0, "max_tokens": 30})]
    got = generate_many(model, reqs, **BOUNDS, ignore_eos=True)
    assert got[0].token_ids[0] == expected(table, [3], 30)[0]
    assert got[0].finish_reason == ["length"]


def test_stop_strings_added_mid_job(table):
    pieces = [bytes([c]) for c in b"abcdefghij \n.,"] + [b"ab", b"\n\n", b"the", b"\xc3", b"\xa9"]
    pieces += [b"x%d" % i for i in range(V - len(pieces))]
    base = make_model(table % len(pieces), eos=(EOS,))
    model = ll.FunctionModel(
        base.apply_fn, base.params, base.init_cache, V, 512, (EOS,), ByteTokenizer(pieces)
    )
    rng = np.random.default_rng(5)
    reqs = []
    for i in range(16):
        knobs = dict(max_tokens=int(rng.integers(1, 17)), temperature=[0.0, 3.0][i % 2], seed=i)
        if i < 5:  # the first requests run without stop strings; tables appear later
            knobs["temperature"] = 0.0
        else:
            knobs["stop"] = [["a", "b"], ["ab", "the"], ["\n\n"], ["c", "d", "e", "f"]][i % 4]
            knobs["include_stop_str_in_output"] = i % 3 == 0
        prompt = "abc" if i % 5 == 0 else [int(t) for t in rng.integers(0, V, size=3)]
        reqs.append(Request(prompt, knobs))
    results = generate_many(model, reqs, **BOUNDS)
    hits = 0
    for req, got in zip(reqs, results, strict=True):
        if "stop" in req.params:
            assert_same(got, alone(model, req.prompt, req.params))
        else:  # greedy: the scripted path, without the cost of another reference shape
            ids = model.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
            want = expected(table % len(pieces), ids, req.params["max_tokens"], stop_ids=(EOS,))
            assert got.token_ids == [want[0]]
            assert got.text == model.tokenizer.decode([t for t in want[0] if t != EOS])
        hits += isinstance(got.stop_reason[0], str)
    assert hits >= 3


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        eos_token_id=(3,),
    )
    abstract = nnx.eval_shape(lambda: LlamaModel(config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(0)

    # Random weights set from numpy (no compiles), larger than the default init so that the
    # logits are far from flat; norm scales stay 1.
    def init(x):
        if len(x.shape) == 1:
            return jnp.ones(x.shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, 0.3, x.shape).astype(np.float32))

    return nnx.merge(graphdef, jax.tree.map(init, state))


def test_llama_identity_float32(llama):
    rng = np.random.default_rng(2)
    settings = [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=1),
        dict(temperature=0.8, seed=2, top_k=10, top_p=0.9, repetition_penalty=1.2),
        dict(temperature=0.0, stop_token_ids=[5, 6], frequency_penalty=0.5),
    ]
    reqs = []
    for i in range(10):
        prompt = [int(t) for t in rng.integers(4, 96, size=int(rng.integers(1, 14)))]
        reqs.append(Request(prompt, dict(settings[i % 4], max_tokens=int(rng.integers(1, 17)))))
    results = generate_many(
        llama, reqs, slots=3, chunk_steps=4, max_prompt_len=15, max_tokens_bound=16
    )
    for req, got in zip(reqs, results, strict=True):
        assert_same(got, alone(llama, req.prompt, req.params), exact=False)
    assert len({r.num_tokens[0] for r in results}) > 4


def test_second_job_compiles_nothing(model, compile_counter):
    # The first job uses the same kinds of knobs (list shapes), with other values.
    first = [
        ([1, 2, 3], dict(temperature=0.0, max_tokens=30, stop_sequences=[[1, 2]])),
        ([4], dict(temperature=1.0, seed=1, max_tokens=5, stop_token_ids=[9])),
        ([5, 6], dict(temperature=0.0, max_tokens=12, logit_bias={5: -1.0})),
        ([7, 8, 9, 10], dict(temperature=2.0, top_k=3, max_tokens=20, banned_token_ids=[2])),
        ([11], dict(temperature=0.0, max_tokens=2)),
    ]
    generate_many(model, first, **BOUNDS)
    second = [
        ([12] * 11, dict(temperature=1.5, seed=9, top_p=0.8, min_p=0.1, max_tokens=31)),
        ([13, 14], dict(temperature=0.0, repetition_penalty=1.3, max_tokens=3, min_tokens=2)),
        ([15], dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=-0.5, seed=2)),
        ([16, 17, 18], dict(temperature=0.0, logit_bias={3: 2.0}, banned_token_ids=[4])),
        ([19], dict(temperature=0.0, stop_token_ids=[1, 2], stop_sequences=[[5, 6]])),
        ([20, 21], dict(temperature=3.0, seed=5, max_tokens=25)),
    ]
    with compile_counter as c:
        results = generate_many(model, second, **BOUNDS)
    assert c.count == 0
    assert len(results) == len(second)


@pytest.mark.parametrize(
    "reqs, kwargs, match",
    [
        ([[1], ([2], {"top_p": 2.0})], {}, r"requests\[1\]: top_p = 2.0 is outside"),
        ([[1], Request([V], id="q")], {}, r"requests\[1\] \(id 'q'\): the prompt holds token id"),
        ([[1], [2] * 16], {}, r"requests\[1\]: the prompt has 16 tokens, over max_prompt_len"),
        ([([1], {"max_tokens": 40})], {}, r"requests\[0\]: max_tokens = 40 is over"),
        (["hello"], {}, r"requests\[0\]: .*no tokenizer"),
        ([[1]], {"slots": 0}, r"slots = 0 is outside the allowed range"),
        ([[1]], {"prefill_batch": 5, "slots": 4}, r"prefill_batch = 5 is outside"),
    ],
)
def test_bad_input(model, reqs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_many(model, reqs, **{**BOUNDS, **kwargs})
