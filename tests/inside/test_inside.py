"""Inside the decode (issue 72): the residual stream captured during `generate` equals
transformers' `output_hidden_states` on the final sequence, for every row of a left-padded
batch; steering equals transformers' greedy `generate` with a forward hook adding the same
vector after the same layer, per row, steered and unsteered rows in one batch; new vectors,
scales and layers compile nothing; bad input is refused by name before anything runs; a
model of one's own (examples/own_model.py) gets both through `ll.residual`."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import logitloop as ll  # noqa: E402
from logitloop.models.kv import check_marked  # noqa: E402
from logitloop.models.steering import Steering  # noqa: E402
from tests.models.tiny_checkpoints import build_hf_model, random_prompts, save_hf_model  # noqa: E402

TOKENS = 6
ATOL = 2e-4  # float32 states of magnitude ~1-10 (the parity tests' logits take 1e-4)
WIDTH = 64  # the tiny Llama's hidden size (tests/models/tiny_checkpoints.py)


def hf_states(hf, sequence: list[int]) -> list[np.ndarray]:
    """transformers' `output_hidden_states` of one sequence: entry l + 1 is the residual
    stream after decoder layer l (the last one after the final norm), each [T, E]."""
    with torch.no_grad():
        out = hf(torch.tensor([sequence]), output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states]


def test_capture_equals_transformers_hidden_states(setup):
    """Layer 0 and the final norm's output at every fed token of prompt + completion,
    each row of a left-padded batch (prompts 5, 9 and 3 tokens; rows ending after 6, 3
    and 5 tokens); `score` of the same completions captures the same states at the
    completion's positions."""
    prompts = random_prompts(160, [5, 9, 3], 0)
    keywords = dict(temperature=0, max_new_tokens=[TOKENS, 3, 5], ignore_eos=True)
    both = ll.Capture(layers=(0,), prompt=True, final_norm=True)
    out = ll.generate(setup["model"], prompts, capture=both, **keywords)
    scores = ll.score(setup["model"], prompts, out.token_ids,
                      capture=ll.Capture(layers=(0,), final_norm=True))  # fmt: skip
    for row, prompt in enumerate(prompts):
        got = out.captured[row]
        sequence = prompt + out.token_ids[row]
        assert got.shape == (len(sequence) - 1, 2, WIDTH) and got.dtype == np.float32
        hs = hf_states(setup["hf"], sequence)
        want = np.stack([hs[1], hs[-1]], axis=1)[:-1]  # the last token is never fed
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
        scored = scores[row].captured
        np.testing.assert_allclose(scored, want[len(prompt) - 1 :], rtol=0, atol=ATOL)


def test_stream_events_carry_the_states_and_the_steering(setup):
    """`stream`'s events' states, concatenated per row, are `generate`'s; its steered rows
    are `generate`'s (the parity tests' batch shapes: nothing new compiles)."""
    prompts = random_prompts(160, [5, 9, 3], 0)
    keywords = dict(temperature=0, max_new_tokens=[TOKENS, 3, 5], ignore_eos=True)
    both = ll.Capture(layers=(0,), prompt=True, final_norm=True)
    want = ll.generate(setup["model"], prompts, capture=both, **keywords)
    events = list(ll.stream(setup["model"], prompts, capture=both, chunk_steps=2, **keywords))
    for row in range(3):
        got = np.concatenate([e.captured for e in events if e.row == row])
        np.testing.assert_array_equal(got, want.captured[row])
    prompts = random_prompts(160, [5, 8, 4, 6], 2)
    steer = [s or None for s in STEERS]
    keywords["max_new_tokens"] = TOKENS
    events = list(ll.stream(setup["model"], prompts, steer=steer, chunk_steps=2, **keywords))
    want = ll.generate(setup["model"], prompts, steer=steer, **keywords)
    for row in range(4):
        assert sum((e.token_ids for e in events if e.row == row), []) == want.token_ids[row]


@pytest.mark.slow
def test_logit_lens_of_the_final_norm_is_the_models_logits(setup):
    """Without `prompt=True` one entry per generated token, the states that drew it: the
    lens over the last layer's draws the greedy tokens, with the raw log-probabilities
    the loop reported, and the states are transformers' at those positions."""
    model = setup["model"]
    prompts = random_prompts(160, [4, 7], 1)
    cap = ll.Capture(layers=(1,), final_norm=True)
    out = ll.generate(model, prompts, capture=cap, temperature=0, max_new_tokens=4,
                      ignore_eos=True)  # fmt: skip
    for row, prompt in enumerate(prompts):
        hs = hf_states(setup["hf"], prompt + out.token_ids[row])
        want = hs[-1][len(prompt) - 1 : -1]
        np.testing.assert_allclose(out.captured[row][:, 1], want, rtol=0, atol=ATOL)
        states = out.captured[row]
        lens = np.asarray(ll.logit_lens(model, states[:, 0]))  # final norm + head
        normed = np.asarray(ll.logit_lens(model, states[:, 1], normed=True))
        np.testing.assert_allclose(lens, normed, rtol=0, atol=1e-4)
        assert lens.argmax(-1).tolist() == out.token_ids[row]
        lp = np.asarray(jax.nn.log_softmax(lens, -1))
        got = lp[np.arange(len(lp)), out.token_ids[row]]
        np.testing.assert_allclose(got, out.raw_logprobs[row], rtol=0, atol=1e-4)


def vector(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=WIDTH).astype(np.float32)


def hooked_greedy(hf, prompt: list[int], steers, n: int, **generate) -> list[int]:
    """transformers' greedy `generate` (and `generate`'s other keywords) with a forward
    hook per steer adding `scale * vector` to decoder layer `layer`'s output at the steer's
    tokens."""
    handles = []
    for s in steers:

        def hook(module, args, kwargs, output, s=s):
            h = output[0] if isinstance(output, tuple) else output
            pos = kwargs["position_ids"][..., None]  # [1, T, 1]
            lo, hi = {"both": (0, 2**30), "prompt": (0, len(prompt)),
                      "generated": (len(prompt), 2**30)}[s.tokens]  # fmt: skip
            on = ((pos >= lo) & (pos < hi)).to(h.dtype)
            h = h + on * torch.tensor(s.scale * np.asarray(s.vector))
            return (h, *output[1:]) if isinstance(output, tuple) else h

        handles.append(hf.model.layers[s.layer].register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, **generate)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    return ids[0, len(prompt) :].tolist()


STEERS = [
    [ll.Steer(vector(1), 0, 6.0)],
    [],
    [ll.Steer(vector(2), 1, 8.0, tokens="generated")],
    [ll.Steer(vector(3), 0, -6.0, tokens="prompt"), ll.Steer(vector(4), 1, 5.0)],
]


def test_steering_equals_a_transformers_forward_hook(setup):
    """Rows steered at layer 0 or 1, on all, generated or prompt tokens, with one or two
    vectors, beside an unsteered row: each row's greedy tokens are transformers' with the
    same hooks, and each steered row's differ from transformers' unsteered ones."""
    prompts = random_prompts(160, [5, 8, 4, 6], 2)
    keywords = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    out = ll.generate(setup["model"], prompts, steer=[s or None for s in STEERS], **keywords)
    for row, (prompt, steers) in enumerate(zip(prompts, STEERS, strict=True)):
        assert out.token_ids[row] == hooked_greedy(setup["hf"], prompt, steers, TOKENS), row
        plain = hooked_greedy(setup["hf"], prompt, [], TOKENS)
        assert (out.token_ids[row] == plain) == (not steers), row


def test_guided_rows_steer_their_negative_rows_and_capture_the_real_ones(setup):
    """Guidance beside steering: a guided row's negative row runs under its steering, as a
    transformers forward hook steers the unconditional pass too (greedy tokens equal
    transformers' `generate(guidance_scale=, negative_prompt_ids=)` under the hook); beside
    capture, `captured` holds the real rows only, the states `score` captures of the same
    completions."""
    prompts = random_prompts(160, [5, 7, 6], 12)
    negative = random_prompts(160, [4], 13)[0]
    steers = [[ll.Steer(vector(5), 0, 6.0)], [], [ll.Steer(vector(6), 1, -5.0)]]
    capture = ll.Capture(layers=(1,))
    out = ll.generate(
        setup["model"], prompts, guidance_scale=[2.0, 3.0, None],
        negative_prompt=[negative, None, None], steer=[s or None for s in steers],
        capture=capture, temperature=0, max_new_tokens=TOKENS, ignore_eos=True,
    )  # fmt: skip
    cfg = [dict(guidance_scale=2.0, negative_prompt_ids=torch.tensor([negative])),
           dict(guidance_scale=3.0), {}]  # fmt: skip
    for row, prompt in enumerate(prompts):
        want = hooked_greedy(setup["hf"], prompt, steers[row], TOKENS, **cfg[row])
        assert out.token_ids[row] == want, row
    unsteered = hooked_greedy(setup["hf"], prompts[0], [], TOKENS, **cfg[0])
    assert out.token_ids[0] != unsteered  # the steering reached the guided row
    scored = ll.score(setup["model"], prompts, out.token_ids, steer=[s or None for s in steers],
                      capture=capture)  # fmt: skip
    assert len(out.captured) == 3
    for row in range(3):  # the states that drew each token
        np.testing.assert_allclose(out.captured[row], scored[row].captured, rtol=0, atol=ATOL)


def test_score_under_steering_is_generate_under_it(setup, compile_counter):
    """`score(steer=)` of what a steered `generate` drew: the raw log-probabilities bit for
    bit under `deterministic=True` (prompt, generated and both spans, two vectors, an
    unsteered pair in the same packed pass); other vectors compile nothing."""
    model = setup["model"]
    prompts = random_prompts(160, [5, 8, 4, 6], 2)
    steer = [s or None for s in STEERS]
    keywords = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True, deterministic=True)
    out = ll.generate(model, prompts, steer=steer, **keywords)
    scored = ll.score(model, prompts, out.token_ids, steer=steer, deterministic=True)
    for row, result in enumerate(scored):
        np.testing.assert_array_equal(result.raw_logprobs, out.raw_logprobs[row], err_msg=row)
    plain = ll.score(model, prompts, out.token_ids, deterministic=True)
    same = [p.raw_logprobs == s.raw_logprobs for p, s in zip(plain, scored, strict=True)]
    assert same == [not s for s in STEERS]
    other = [[ll.Steer(vector(9), 1, 3.0)], None, None, [ll.Steer(vector(8), 0, -2.0)] * 2]
    with compile_counter as c:
        again = ll.score(model, prompts, out.token_ids, steer=other, deterministic=True)
    assert c.count == 0 and again[0].raw_logprobs != scored[0].raw_logprobs


def test_new_vectors_scales_and_layers_compile_nothing(setup, compile_counter):
    """New vectors, scales, layers and token spans, and rows with fewer vectors or none,
    in a batch of the same shape (its first call is the parity test's shape: run after
    it, that call compiles nothing either)."""
    model = setup["model"]
    prompts = random_prompts(160, [5, 6, 3, 7], 3)
    keywords = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    two = [ll.Steer(vector(5), 0, 4.0), ll.Steer(vector(4), 1, 1.0)]  # K = 2 vectors a row
    first = ll.generate(model, prompts, steer=[two] * 4, **keywords)
    with compile_counter as c:
        steer = [ll.Steer(vector(6), 1, -7.0, tokens="generated"), ll.Steer(vector(7), 0, 2.0),
                 None, [ll.Steer(vector(8), 0, 1.0), ll.Steer(vector(9), 1, 3.0)]]  # fmt: skip
        again = ll.generate(model, prompts, steer=steer, **keywords)
    assert c.count == 0
    assert again.token_ids != first.token_ids


@pytest.mark.slow
def test_steering_with_n_samples_shares_the_prompts_vectors(setup):
    """`n = 2` (one prefill on shared pages): each sample is the prompt's steered row."""
    model = setup["model"]
    prompts = random_prompts(160, [5, 7], 4)
    steer = [ll.Steer(vector(8), 0, 6.0), None]
    keywords = dict(temperature=0, max_new_tokens=4, ignore_eos=True)
    one = ll.generate(model, prompts, steer=steer, **keywords)
    two = ll.generate(model, prompts, steer=steer, n=2, **keywords)
    assert two.token_ids == [t for t in one.token_ids for _ in range(2)]


@pytest.mark.slow
def test_speculative_rows_verify_under_their_steering(setup):
    """A draft model (the same model, unsteered) under strict acceptance over steered and
    unsteered rows: the tokens of the plain steered decode (verification steers)."""
    model = setup["model"]
    prompts = random_prompts(160, [6, 7], 7)
    steer = [ll.Steer(vector(10), 0, 6.0), None]
    keywords = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True, steer=steer)
    want = ll.generate(model, prompts, **keywords)
    draft = ll.DraftModel(model=model, num_draft=2, cycle_cost=1.0, min_acceptance=0.0)
    got = ll.generate(model, prompts, speculative=draft, **keywords)
    assert got.token_ids == want.token_ids
    assert sum(r["drafted"] for r in got.speculation) > 0  # drafts were verified


@pytest.mark.parametrize(
    "keywords, match",
    [
        (dict(steer=ll.Steer(np.zeros(WIDTH, np.float32), 2)), r"steer\.layer = 2 is out of range"),
        (dict(steer=[None, ll.Steer(np.zeros(WIDTH + 1, np.float32), 0)]),
         r"steer\[1\]\.vector must have shape \[64\]"),
        (dict(steer=ll.Steer(np.zeros(WIDTH, np.int32), 0)), r"steer\.vector must be a float"),
        (dict(steer=ll.Steer(np.full(WIDTH, np.nan, np.float32), 0)), "NaN or inf"),
        (dict(steer=ll.Steer(np.zeros(WIDTH, np.float32), 0, float("inf"))), "scale must be"),
        (dict(steer=ll.Steer(np.zeros(WIDTH, np.float32), 0, tokens="all")), "tokens must be"),
        (dict(steer=[None]), "a list of 2 entries"),
        (dict(capture=ll.Capture(layers=(0, 5))), r"capture\.layers\[1\] = 5 is out of range"),
        (dict(capture=ll.Capture()), "names no layer"),
        (dict(capture=ll.Capture(layers=0, prompt=True, max_bytes=1000)),
         r"capture=: the buffer would take .* MiB \(\d+ rows x \d+ tokens x 1 layers x 64"),
        (dict(capture=ll.Capture(layers=0), n=2), "n > 1"),
        (dict(capture=ll.Capture(layers=0, max_bytes=float("nan"))),
         r"capture\.max_bytes must be an int"),
        (dict(capture=ll.Capture(layers=0, max_bytes=-1)),
         r"capture\.max_bytes = -1 is outside the allowed range"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_by_name(setup, keywords, match, compile_counter):
    with compile_counter as c, pytest.raises((ValueError, NotImplementedError), match=match):
        ll.generate(setup["model"], [[1, 2, 3], [4, 5]], max_new_tokens=2, **keywords)
    assert c.count == 0  # refused before anything runs


@pytest.mark.parametrize(
    "call",
    [
        lambda m: ll.score(
            m,
            [[1, 2]],
            [[3]],
            steer=ll.Steer(np.zeros(WIDTH), 0),
            mesh=jax.make_mesh((1, 1), ("data", "model")),
        ),
        lambda m: ll.generate(
            m, [[1, 2]], capture=ll.Capture(layers=0), mesh=jax.make_mesh((1, 1), ("data", "model"))
        ),
        lambda m: ll.score(m, [[1, 2]], [[3]], capture=ll.Capture(layers=0, prompt=True)),
    ],
)
def test_not_yet_is_refused_by_name(setup, call):
    with pytest.raises((NotImplementedError, TypeError), match="capture|steer"):
        call(setup["model"])


def test_residual_adds_each_rows_vectors_and_records_the_stream():
    """The seam itself, eagerly: `ll.residual` after layer 1 adds row 0's vector for layer
    1 (scaled) at the positions it steers, nothing to row 1 or to padding, and records x
    after the addition in the kv; a pass that steers but marked no layer is refused."""
    rng = np.random.default_rng(0)
    spec = ll.KVSpec(num_layers=2, num_kv_heads=1, head_dim=4)
    positions = np.array([[-1, 0, 1, 2], [0, 1, 2, 3]], np.int32)
    v = rng.normal(size=(2, 2, 8)).astype(np.float32)
    steer = Steering(
        v,
        np.array([[1, 0], [0, -1]], np.int32),
        np.array([[2.0, 5.0], [1.0, 0.0]], np.float32),
        np.zeros((2, 2), np.int32),
        np.array([[2, 9], [9, 9]], np.int32),
    )
    rows = ll.Rows(steer=steer, capture=(1,))
    kv = ll.KV(spec.init_cache(2, 8), positions, spec, rows=rows)
    x = rng.normal(size=(2, 4, 8)).astype(np.float32)
    y, kv = ll.residual(x, kv, layer=1)
    want = x.copy()
    want[0, 1:3] += 2.0 * v[0, 0]  # positions 0 and 1 (< stop 2); padding untouched
    np.testing.assert_array_equal(np.asarray(y), want)
    np.testing.assert_array_equal(np.asarray(kv.captured[1]), want)
    with pytest.raises(ValueError, match=r"did not mark .* layer\(s\) \[0\]"):
        check_marked(kv, "the model")


@pytest.mark.slow
def test_own_model_gets_capture_and_steering_through_ll_residual(setup):
    """examples/own_model.py marks its residual stream: with the tiny Llama's weights its
    captured states and steered tokens are the family's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import own_model

    llama = setup["model"]
    mine = ll.from_nnx(own_model.from_llama(llama), vocab_size=160, max_length=64)
    prompts = random_prompts(160, [5, 3], 5)
    keywords = dict(
        temperature=0, max_new_tokens=4, ignore_eos=True, capture=ll.Capture(layers=(1,)),
        steer=[ll.Steer(np.random.default_rng(9).normal(size=64).astype(np.float32), 0, 5.0),
               None],
    )  # fmt: skip
    want = ll.generate(llama, prompts, **keywords)
    got = ll.generate(mine, prompts, **keywords)
    assert got.token_ids == want.token_ids
    for a, b in zip(got.captured, want.captured, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen2", "gemma2", "mixtral", "gpt2"])
def test_other_families_capture_and_steer_like_transformers(case, tmp_path):
    """Capture after layer 0 equals transformers' hidden states (prompt + completion, a
    left-padded batch), and a row steered after layer 0 decodes transformers' tokens with
    the same forward hook, beside an unsteered row, in Qwen2, Gemma 2, Mixtral and GPT-2."""
    hf = build_hf_model(case)
    model = ll.load_pretrained(str(save_hf_model(hf, tmp_path)))
    layers = hf.model.layers if hasattr(hf, "model") else hf.transformer.h
    vocab, width = hf.config.vocab_size, model.config.hidden_size
    prompts = random_prompts(vocab, [5, 8], 6)
    v = np.random.default_rng(1).normal(0, 4.0, width).astype(np.float32)
    keywords = dict(temperature=0, max_new_tokens=4, ignore_eos=True)
    out = ll.generate(model, prompts, capture=ll.Capture(layers=(0,), prompt=True), **keywords)
    steer = [ll.Steer(v, 0, 1.0), None]
    steered = ll.generate(model, prompts, steer=steer, **keywords)
    for row, prompt in enumerate(prompts):
        sequence = prompt + out.token_ids[row]
        with torch.no_grad():
            hs = hf(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        np.testing.assert_allclose(out.captured[row][:, 0], hs[1][0, :-1].numpy(), rtol=0,
                                   atol=1e-3 * max(1.0, float(hs[1].abs().max())))  # fmt: skip
        want = _hooked(hf, layers, prompt, steer[row], 4)
        assert steered.token_ids[row] == want, (case, row)
    assert steered.token_ids[0] != _hooked(hf, layers, prompts[0], None, 4)  # it steers


@pytest.mark.slow
def test_shipped_model_captures_and_steers_like_transformers():
    """The shipped model (a Llama checkpoint), both sides in float32: captured layer 1 and
    the final norm's output equal transformers' hidden states 2 and 4 (3 rows, left-padded;
    4 layers, so state 4 is after the final norm), and rows
    steered after layer 2 decode transformers' hooked tokens beside an unsteered row."""
    import jax.numpy as jnp
    import transformers

    from logitloop.models.loading import SHIPPED_MODEL_DIR

    model = ll.load_pretrained(dtype=jnp.float32)
    hf = transformers.LlamaForCausalLM.from_pretrained(SHIPPED_MODEL_DIR, dtype=torch.float32)
    hf.eval()
    prompts = [model.tokenizer.encode(t) for t in ("The for statement", "A dict", "x = 1")]
    keywords = dict(temperature=0, max_new_tokens=6, ignore_eos=True)
    cap = ll.Capture(layers=(1,), prompt=True, final_norm=True)
    out = ll.generate(model, prompts, capture=cap, **keywords)
    v = np.random.default_rng(2).normal(0, 3.0, 256).astype(np.float32)
    steer = [ll.Steer(v, 2, 1.0), None, ll.Steer(v, 2, -1.0, tokens="prompt")]
    steered = ll.generate(model, prompts, steer=steer, **keywords)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            hs = hf(torch.tensor([prompt + out.token_ids[row]]), output_hidden_states=True)
        want = np.stack([hs.hidden_states[2][0], hs.hidden_states[4][0]], axis=1)[:-1]
        np.testing.assert_allclose(out.captured[row], want, rtol=0, atol=1e-3)
        steers = [] if steer[row] is None else [steer[row]]
        assert steered.token_ids[row] == hooked_greedy(hf, prompt, steers, 6), row


def _hooked(hf, layers, prompt, steer, n):
    """transformers' greedy tokens with `steer` (or nothing) added after layer 0."""
    handle = None
    if steer is not None:

        def hook(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            h = h + torch.tensor(steer.scale * steer.vector)
            return (h, *output[1:]) if isinstance(output, tuple) else h

        handle = layers[steer.layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)  # fmt: skip
    finally:
        if handle is not None:
            handle.remove()
    return ids[0, len(prompt) :].tolist()
