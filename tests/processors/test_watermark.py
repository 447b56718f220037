"""Watermarks against transformers: `WatermarkLogitsProcessor`, `WatermarkDetector` and
`SynthIDTextWatermarkLogitsProcessor` (with the SynthID paper's mean scores) on the same
inputs, several keys in one batch; a watermarked generation detected; bad input named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.sampling.processors import Step

from .cases import apply_jit, make_history

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 4098  # the shipped model's vocabulary

GREEN = dict(  # per row: both seedings, context widths, gammas, deltas, and an off row
    key=[15485863, 7, None, 2**32 - 1, 123456789, 99],
    gamma=[0.25, 0.5, 0.25, 0.1, 0.3, 0.75],
    delta=[2.0, 1.5, 2.0, 3.0, 0.5, 1.0],
    seeding=["lefthash", "lefthash", "selfhash", "selfhash", "selfhash", "lefthash"],
    context_width=[1, 3, 1, 1, 3, 2],
)


def _rows(key, i):
    return {k: v[i] for k, v in GREEN.items()} if key is None else None


def _hf_green(r):
    return transformers.WatermarkLogitsProcessor(
        V,
        "cpu",
        greenlist_ratio=GREEN["gamma"][r],
        bias=GREEN["delta"][r],
        hashing_key=GREEN["key"][r],
        seeding_scheme=GREEN["seeding"][r],
        context_width=GREEN["context_width"][r],
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_green_list_scores_equal_transformers_per_row(seed):
    rng = np.random.default_rng(seed)
    b = len(GREEN["key"])
    rows = [rng.integers(0, V, size=int(rng.integers(3, 12))).tolist() for _ in range(b)]
    rows[5] = rows[5][:1]  # shorter than its context width: left alone, as transformers does
    logits = rng.normal(size=(b, V)).astype(np.float32)
    wm = ll.GreenListWatermark.create(b, V, **GREEN)
    out = np.asarray(apply_jit(wm, jnp.asarray(logits), make_history(rows, [1] * b, 16)))
    for r in range(b):
        if GREEN["key"][r] is None:
            assert np.array_equal(out[r], logits[r])
            continue
        want = _hf_green(r)(torch.tensor([rows[r]]), torch.tensor(logits[r : r + 1]))[0]
        np.testing.assert_array_equal(out[r], want.numpy(), err_msg=f"row {r}")
    assert (out[0] != logits[0]).sum() == int(V * 0.25)  # lefthash: the whole greenlist
    assert 0 < (out[3] != logits[3]).sum() <= 40  # selfhash: among the 40 best tokens


SYNTH = dict(
    keys=[[654, 400, 836, 123, 340], [1, 2, 3, 4, 5], None, [-5, 2**62, 7, 9, 11]],
    ngram_len=[5, 3, 4, 2],
    sampling_table_seed=[0, 1, 0, 2**40],
    skip_first_ngram_calls=[False, True, False, False],
)


def test_synthid_scores_equal_transformers_over_a_generation():
    """Twelve steps of four rows (one off, one skipping its first n-grams, one whose
    contexts repeat), the processor's state carried as the loop carries it."""
    b, vocab, history_size = 4, 300, 64
    rng = np.random.default_rng(0)
    wm = ll.SynthIDWatermark.create(b, context_history_size=history_size, **SYNTH)
    refs = [
        None
        if SYNTH["keys"][r] is None
        else transformers.SynthIDTextWatermarkLogitsProcessor(
            SYNTH["ngram_len"][r],
            SYNTH["keys"][r],
            2**16,
            SYNTH["sampling_table_seed"][r],
            history_size,
            "cpu",
            skip_first_ngram_calls=SYNTH["skip_first_ngram_calls"][r],
        )
        for r in range(b)
    ]
    apply = jax.jit(lambda w, s, x, st: w.apply(s, x, st))
    update = jax.jit(lambda w, s, t, st: w.update(s, t, st))
    prompts = [rng.integers(0, vocab, size=4).tolist() for _ in range(b)]
    generated: list[list[int]] = [[] for _ in range(b)]
    state = wm.init(b, vocab)
    untouched = np.zeros(b, int)
    for pos in range(12):
        rows = [prompts[r] + generated[r] for r in range(b)]
        step = Step(
            positions=jnp.full((b,), pos, jnp.int32),
            history=make_history(rows, [4] * b, 40),
            done=jnp.zeros((b,), bool),
        )
        logits = rng.normal(size=(b, vocab)).astype(np.float32)
        out = np.asarray(apply(wm, state, jnp.asarray(logits), step))
        for r in range(b):
            if refs[r] is None:
                assert np.array_equal(out[r], logits[r])
                continue
            want = refs[r](torch.tensor([rows[r]]), torch.tensor(logits[r : r + 1]))[0].numpy()
            np.testing.assert_allclose(out[r], want, rtol=1e-5, atol=1e-5, err_msg=f"{pos=} {r=}")
            untouched[r] += np.array_equal(out[r], logits[r])
        tokens = rng.integers(0, vocab, size=b)
        if pos in (5, 6, 7):
            tokens[3] = 17  # row 3 (n = 2) sees the context [17] again: left alone
        state = update(wm, state, jnp.asarray(tokens, jnp.int32), step)
        for r in range(b):
            generated[r].append(int(tokens[r]))
    assert untouched[1] == 2 and untouched[3] >= 2 and untouched[0] == 0


def test_watermarks_run_after_the_filters_as_in_transformers():
    """With temperature, top-k, top-p and min-p on, the distribution a row draws from is
    transformers' warpers followed by its watermark processor, softmaxed: the filters
    choose their set from the unwatermarked logits. Green list rows (both seedings) and
    SynthID rows, one row per filter alone and one with all of them."""
    b, vocab = 4, V
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, vocab, size=6).tolist() for _ in range(b)]
    logits = (2.0 * rng.normal(size=(b, vocab))).astype(np.float32)
    knobs = dict(temperature=[0.7, 1.3, 0.9, 0.8], top_k=[40, 0, 0, 60],
                 top_p=[1.0, 0.8, 1.0, 0.9], min_p=[0.0, 0.0, 0.05, 0.02])  # fmt: skip
    params = ll.SamplingParams.create(b, **knobs)
    history = make_history(rows, [6] * b, 16)
    positions = jnp.zeros((b,), jnp.int32)
    keys = [[654, 400, 836, 123, 340]] * b
    for kind in ("lefthash", "selfhash", "synthid"):
        if kind == "synthid":
            wm = ll.SynthIDWatermark.create(b, keys=keys, ngram_len=3)
        else:
            wm = ll.GreenListWatermark.create(b, vocab, key=15485863, seeding=kind, gamma=0.5)
        got = np.asarray(ll.sampling_distribution(
            jnp.asarray(logits), params, positions, history, processors=[wm]))  # fmt: skip
        for r in range(b):
            chain = [transformers.TemperatureLogitsWarper(knobs["temperature"][r])]
            if knobs["top_k"][r]:
                chain.append(transformers.TopKLogitsWarper(knobs["top_k"][r]))
            if knobs["top_p"][r] < 1:
                chain.append(transformers.TopPLogitsWarper(knobs["top_p"][r]))
            if knobs["min_p"][r]:
                chain.append(transformers.MinPLogitsWarper(knobs["min_p"][r]))
            if kind == "synthid":
                chain.append(transformers.SynthIDTextWatermarkLogitsProcessor(
                    3, keys[r], 2**16, 0, 1024, "cpu"))  # fmt: skip
            else:
                chain.append(transformers.WatermarkLogitsProcessor(
                    vocab, "cpu", greenlist_ratio=0.5, hashing_key=15485863,
                    seeding_scheme=kind))  # fmt: skip
            ids, x = torch.tensor([rows[r]]), torch.tensor(logits[r : r + 1])
            for step in chain:
                x = step(ids, x)
            want = torch.softmax(x, dim=-1)[0].numpy()
            assert ((got[r] > 0) == (want > 0)).all(), (kind, r)
            np.testing.assert_allclose(got[r], want, rtol=1e-4, atol=1e-6, err_msg=f"{kind} {r}")


def test_green_list_detector_equals_transformers():
    rng = np.random.default_rng(3)
    texts = [rng.integers(2, V, size=50).tolist() for _ in range(2)]
    texts.append([1] + texts[0][:15] * 3)  # a leading BOS and repeated n-grams
    config = transformers.LlamaConfig(vocab_size=V, bos_token_id=1)
    for seeding, width in [("lefthash", 1), ("lefthash", 2), ("selfhash", 1), ("selfhash", 3)]:
        wm = ll.GreenListWatermark.create(1, V, key=12345, seeding=seeding, context_width=width)
        cfg = transformers.WatermarkingConfig(
            hashing_key=12345, seeding_scheme=seeding, context_width=width
        )
        for unique in (False, True):
            got = ll.watermark_score(texts, wm, ignore_repeated_ngrams=unique, bos_token_id=1)
            detector = transformers.WatermarkDetector(
                config, "cpu", cfg, ignore_repeated_ngrams=unique
            )
            for i, ids in enumerate(texts):
                want = detector(torch.tensor([ids]), return_dict=True)
                what = f"{seeding} {width} {unique} text {i}"
                assert got.num_tokens_scored[i] == want.num_tokens_scored[0], what
                assert got.num_green_tokens[i] == want.num_green_tokens[0], what
                np.testing.assert_allclose(got.z_score[i], want.z_score[0], err_msg=what)
                np.testing.assert_allclose(got.p_value[i], want.p_value[0], err_msg=what)
                assert got.prediction[i] == want.prediction[0], what


def test_synthid_mean_scores_equal_the_reference():
    """transformers' g-values and masks, scored as the SynthID paper's detector_mean.py."""
    rng = np.random.default_rng(4)
    texts = [rng.integers(0, V, size=40).tolist() for _ in range(3)]
    texts[1] = texts[1][:10] * 4  # repeated contexts are masked
    eos = texts[2][25]
    keys = [654, 400, 836, 123, 340, 443, 597, 160, 57]
    for n in (2, 5):
        wm = ll.SynthIDWatermark.create(1, keys=keys, ngram_len=n)
        ref = transformers.SynthIDTextWatermarkLogitsProcessor(n, keys, 2**16, 0, 1024, "cpu")
        ids = torch.tensor(texts)
        g = ref.compute_g_values(ids).numpy()
        mask = ref.compute_context_repetition_mask(ids).numpy()
        mask = mask * ref.compute_eos_token_mask(ids, eos).numpy()[:, n - 1 :]
        depth = len(keys)
        weights = np.linspace(10, 1, depth)
        weights *= depth / weights.sum()
        mean = (g * mask[:, :, None]).sum((1, 2)) / (depth * mask.sum(1))
        weighted = (g * weights * mask[:, :, None]).sum((1, 2)) / (depth * mask.sum(1))
        got = ll.watermark_score(texts, wm, eos_token_id=eos)
        np.testing.assert_allclose(got.mean, mean, err_msg=f"{n=}")
        np.testing.assert_allclose(got.weighted_mean, weighted, err_msg=f"{n=}")
        assert list(got.num_scored) == mask.sum(1).tolist()
        assert got.num_scored[1] < got.num_scored[0]  # the repeats were left out


def test_int64_arithmetic_on_uint32_pairs_wraps_as_numpy():
    from logitloop.processors.watermark import u64

    rng = np.random.default_rng(6)
    a, b = (rng.integers(-(2**63), 2**63, size=500, dtype=np.int64) for _ in range(2))

    def pair(v):
        bits = v.view(np.uint64)
        return jnp.asarray(bits >> np.uint64(32), jnp.uint32), jnp.asarray(bits, jnp.uint32)

    def back(p):
        hi, lo = (np.asarray(x).astype(np.uint64) for x in p)
        return ((hi << np.uint64(32)) | lo).view(np.int64)

    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(back(u64.mul(pair(a), pair(b))), a * b)
        np.testing.assert_array_equal(back(u64.add(pair(a), pair(b))), a + b)
    for m in (1, 3, 1000, 2**16, 99991, 2**24):  # torch's `%`: the sign of the divisor
        want = np.asarray([int(x) % m for x in a])
        np.testing.assert_array_equal(np.asarray(u64.floor_mod(pair(a), m)), want)


PROMPTS = ["The for statement", "A dictionary", "Once upon a time"]


def _watermarks(green_key, synth_keys):
    green = ll.GreenListWatermark.create(3, V, key=[green_key, None, None])
    synth = ll.SynthIDWatermark.create(3, keys=[None, synth_keys, None], ngram_len=4)
    return [green, synth]


def test_new_keys_compile_nothing(compile_counter):
    """Keys, gammas, deltas and seedings are data: rows with other settings (and rows
    without a watermark) run in the program compiled for the first ones."""
    rng = np.random.default_rng(5)
    history = ll.History.create([[5, 6, 7], [8], [9, 10]], vocab_size=V, capacity=8)
    params = ll.SamplingParams.create(3, temperature=1.0, seed=[1, 2, 3])
    logits = jnp.asarray(rng.normal(size=(3, V)).astype(np.float32))
    positions = jnp.zeros(3, jnp.int32)
    first = ll.sample(logits, params, positions, history, processors=_watermarks(1, [1, 2]))
    other = _watermarks(7, [9, 8])
    other[0] = ll.GreenListWatermark.create(
        3, V, key=[None, 3, 4], gamma=0.5, delta=[0.0, 1.0, 4.0], seeding="selfhash"
    )
    with compile_counter as c:
        second = ll.sample(logits, params, positions, history, processors=other)
    assert c.count == 0, ll.compile_stats().summary()
    assert first.tokens.shape == second.tokens.shape


@pytest.mark.slow
def test_watermarked_generations_are_detected_and_new_keys_compile_nothing(compile_counter):
    """200 sampled tokens of the shipped model: row 0 under a green list, row 1 under
    SynthID, row 2 plain, in one batch. Each watermark finds its row and not the plain
    one; other keys run in the same programs."""
    model = ll.load_pretrained()
    knobs = dict(max_tokens=200, min_tokens=200, temperature=1.0, top_k=0, seed=[1, 2, 3])
    out = ll.generate(model, PROMPTS, processors=_watermarks(15485863, [1, 2, 3, 4, 5, 6]), **knobs)
    assert out.num_tokens == [200, 200, 200]
    ids = out.token_ids
    green = ll.GreenListWatermark.create(1, V, key=15485863)
    z = ll.watermark_score([ids[0], ids[2]], green, ignore_repeated_ngrams=True).z_score
    assert z[0] > 6 and z[1] < 3, z
    synth = ll.SynthIDWatermark.create(1, keys=[1, 2, 3, 4, 5, 6], ngram_len=4)
    mean = ll.watermark_score([ids[1], ids[2]], synth).mean
    assert mean[0] > 0.56 and abs(mean[1] - 0.5) < 0.04, mean
    with compile_counter as c:
        other = ll.generate(model, PROMPTS, processors=_watermarks(7, [9, 8, 7, 6, 5, 4]), **knobs)
    assert c.count == 0, ll.compile_stats().summary()
    assert other.token_ids[2] == ids[2]  # the plain row is its own
    assert other.token_ids[0] != ids[0] and other.token_ids[1] != ids[1]


@pytest.mark.slow
def test_stream_generate_many_and_deterministic_watermark_like_generate():
    """The watermarks ride the common sampler everywhere: stream gives generate's tokens;
    with deterministic=True (a row's tokens independent of its batch) generate_many's
    slots give generate's rows, and the plain row equals a plain generation."""
    model = ll.load_pretrained()
    params = ll.SamplingParams.create(3, max_tokens=24, temperature=1.0, top_k=0, seed=[1, 2, 3])
    procs = _watermarks(15485863, [1, 2, 3, 4, 5, 6])
    want = ll.generate(model, PROMPTS, params, processors=procs)
    got: list[list[int]] = [[] for _ in PROMPTS]
    for ev in ll.stream(model, PROMPTS, params, processors=procs, chunk_steps=5):
        got[ev.row] += ev.token_ids
    assert got == want.token_ids
    det = ll.generate(model, PROMPTS, params, processors=procs, deterministic=True)
    requests = [
        ll.Request(
            p,
            params.take([r]),
            processors=[jax.tree.map(lambda x, r=r: x[r : r + 1], q) for q in procs],
        )
        for r, p in enumerate(PROMPTS)
    ]
    many = ll.generate_many(model, requests, slots=2, chunk_steps=4, deterministic=True)
    assert [m.token_ids[0] for m in many] == det.token_ids
    plain = ll.generate(model, PROMPTS, params, deterministic=True)
    assert det.token_ids[2] == plain.token_ids[2]  # the unwatermarked row is its own
    assert det.token_ids[0] != plain.token_ids[0] and det.token_ids[1] != plain.token_ids[1]


GL, SID, SCORE = ll.GreenListWatermark.create, ll.SynthIDWatermark.create, ll.watermark_score
BAD = [
    (lambda: GL(2, V, gamma=[0.25, 1.0]), r"gamma\[1\] = 1.0 is outside the allowed range \(0, 1"),
    (lambda: GL(2, V, gamma=0.0), r"gamma\[0\] = 0.0 is outside the allowed range \(0, 1\)"),
    (lambda: GL(2, V, delta=[1.0, -0.5]), r"delta\[1\] = -0.5 is outside the allowed range \[0, "),
    (lambda: GL(1, V, key=-1), r"key = -1 is outside the allowed range \[0, 4294967295\]"),
    (lambda: GL(1, V, seeding="hash"), r"seeding = 'hash' is not one of"),
    (lambda: GL(1, V, context_width=0), r"context_width = 0 is outside the allowed range \[1, 6"),
    (lambda: GL(1, 1), r"vocab_size = 1 is outside the allowed range"),
    (lambda: SID(2, keys=[[1, 2, 3], [4, 5]]), r"keys\[1\] has 2 keys but the batch's depth is 3"),
    (lambda: SID(1, keys=[]), r"keys is empty"),
    (lambda: SID(1, keys=[1, 2**63]), r"keys = 9223372036854775808 is outside the allowed range"),
    (lambda: SID(1, keys=[1, 2], ngram_len=1), r"ngram_len = 1 is outside the allowed range \[2"),
    (lambda: SID(1, keys=[1], sampling_table_size=2**25), r"sampling_table_size = 33554432 is out"),
    (lambda: SID(2, keys=[None, None]), r"every row is None"),
    (lambda: SCORE([[1, 2]], GL(1, V, key=None)), r"token_ids\[0\]: watermark row 0 has no key"),
    (lambda: SCORE([[5]], GL(1, V)), r"token_ids\[0\] has 1 tokens: scoring needs more than con"),
    (lambda: SCORE([[1, 2], [3, 4]], GL(3, V)), r"watermark has 3 rows for 2 texts"),
]  # fmt: skip


@pytest.mark.parametrize("build, match", BAD)
def test_bad_input_is_refused_by_name(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_a_watermark_for_another_vocabulary_is_refused():
    model = ll.load_pretrained()
    wm = ll.GreenListWatermark.create(1, 5000)
    with pytest.raises(
        ValueError, match=r"created for vocab_size = 5000, but the logits have V = 4098"
    ):
        ll.generate(model, ["x"], max_tokens=2, processors=[wm])
