"""User processors in the sampler and the loop (`logitloop.decoding.sampling.processors`).

The model is scripted (`scripted.py`: the next token's logit is 10, every other 0), so the
expected tokens of a greedy row come from a plain NumPy loop that applies each processor's
own reference rule; sampled rows are checked against `sampling_distribution` in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import logitloop as ll

from .scripted import make_model

V = 32


@struct.dataclass
class ForceAt:
    """The issue's example: at generated index `at`, only `token` may be drawn."""

    at: jax.Array  # [B] i32
    token: jax.Array  # [B] i32

    def init(self, batch_size, vocab_size):
        return jnp.zeros((batch_size,), jnp.int32)

    def apply(self, state, logits, step):
        hit = step.positions == self.at
        forced = jnp.where(jnp.arange(logits.shape[1]) == self.token[:, None], 0.0, -jnp.inf)
        return jnp.where(hit[:, None], forced, logits)

    def update(self, state, tokens, step):
        return state + 1


@struct.dataclass
class NoImmediateRepeat:
    """Stateful: bans the row's previous token, remembered in the state (-1: none yet), and
    counts the tokens it saw; `strength` 0 turns it off for the row."""

    strength: jax.Array  # [B] f32

    def init(self, batch_size, vocab_size):
        return {
            "last": jnp.full((batch_size,), -1, jnp.int32),
            "seen": jnp.zeros((batch_size,), jnp.int32),
        }

    def apply(self, state, logits, step):
        hit = jnp.arange(logits.shape[1])[None, :] == state["last"][:, None]
        return logits - jnp.where(hit, self.strength[:, None], 0.0)

    def update(self, state, tokens, step):
        return {"last": tokens, "seen": state["seen"] + 1}


@struct.dataclass
class CountFrom:
    """Stateful in the loop: the row's state counts its tokens from `start`, and the token
    drawn is the count (mod V) - so the tokens show whether the loop carries the state."""

    start: jax.Array  # [B] i32

    def init(self, batch_size, vocab_size):
        return self.start

    def apply(self, state, logits, step):
        hit = jnp.arange(logits.shape[1])[None, :] == (state % logits.shape[1])[:, None]
        return jnp.where(hit, 0.0, -jnp.inf)

    def update(self, state, tokens, step):
        return state + 1


@struct.dataclass
class LateBias:
    """After temperature: adds `bias` to token `token` of the scaled logits."""

    token: jax.Array  # [B] i32
    bias: jax.Array  # [B] f32
    after_temperature = True

    def init(self, batch_size, vocab_size):
        return jnp.zeros((batch_size, 0))

    def apply(self, state, logits, step):
        hit = jnp.arange(logits.shape[1])[None, :] == self.token[:, None]
        return logits + jnp.where(hit, self.bias[:, None], 0.0)

    def update(self, state, tokens, step):
        return state


@struct.dataclass
class FillRows:
    """Overwrites every logit of the chosen rows with `fill` (-inf: all masked; +inf, NaN)."""

    rows: jax.Array  # [B] bool
    fill: jax.Array  # [B] f32

    def init(self, batch_size, vocab_size):
        return jnp.zeros((batch_size, 0))

    def apply(self, state, logits, step):
        return jnp.where(self.rows[:, None], self.fill[:, None], logits)

    def update(self, state, tokens, step):
        return state


@pytest.fixture(scope="module")
def table():
    return np.random.default_rng(7).integers(0, V, size=(V, 128))


@pytest.fixture(scope="module")
def model(table):
    return make_model(table)


def reference(table, prompt, max_tokens, *, force=None, repeat=0.0):
    """Greedy decode in NumPy: logits 10 at table[tok, pos], then the processors' rules."""
    out = []
    tok, pos = prompt[-1], len(prompt) - 1
    last = -1
    while len(out) < max_tokens:
        logits = np.zeros(V)
        logits[table[tok, pos]] = 10.0
        if last >= 0:
            logits[last] -= repeat
        if force is not None and len(out) == force[0]:
            logits = np.where(np.arange(V) == force[1], 0.0, -np.inf)
        nxt = int(np.argmax(logits))
        out.append(nxt)
        last = nxt
        tok, pos = nxt, pos + 1
    return out


PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]


def _force(at, token):
    return ForceAt(at=jnp.asarray(at, jnp.int32), token=jnp.asarray(token, jnp.int32))


def _repeat(strength):
    return NoImmediateRepeat(strength=jnp.asarray(strength, jnp.float32))


def test_per_row_values_against_numpy(model, table):
    at, token, strength = [0, 3, 5, 100], [7, 0, 31, 2], [20.0, 0.0, 20.0, 5.0]
    params = ll.SamplingParams.create(4, temperature=0.0, max_tokens=8)
    got = ll.generate(model, PROMPTS, params, processors=[_force(at, token), _repeat(strength)])
    for r, p in enumerate(PROMPTS):
        want = reference(table, p, 8, force=(at[r], token[r]), repeat=strength[r])
        assert got.token_ids[r] == want, r
    # The processors changed something: without them the rows differ.
    plain = ll.generate(model, PROMPTS, params)
    assert plain.token_ids != got.token_ids


def test_the_loop_carries_each_rows_state(model):
    params = ll.SamplingParams.create(4, temperature=[0.0, 1.0, 0.0, 2.0], max_tokens=[6, 3, 9, 5])
    starts = [3, 30, 0, 17]
    got = ll.generate(model, PROMPTS, params, processors=[CountFrom(jnp.asarray(starts))])
    assert got.token_ids == [
        [(s + i) % V for i in range(n)] for s, n in zip(starts, [6, 3, 9, 5], strict=True)
    ]


def test_new_values_compile_nothing(model, compile_counter):
    params = ll.SamplingParams.create(4, temperature=0.0, max_tokens=8)
    ll.generate(model, PROMPTS, params, processors=[_force([1, 2, 3, 4], [5, 5, 5, 5])])
    with compile_counter as c:
        ll.generate(model, PROMPTS, params, processors=[_force([0, 6, 2, 9], [1, 2, 3, 4])])
    assert c.count == 0


def test_stateful_state_follows_the_drawn_tokens(model):
    logits = jnp.zeros((2, V)).at[:, 3].set(5.0)
    params = ll.SamplingParams.create(2, temperature=0.0)
    proc = _repeat([100.0, 0.0])
    out = ll.sample(logits, params, jnp.zeros(2, jnp.int32), processors=[proc])
    assert out.tokens.tolist() == [3, 3]
    (state,) = out.states
    assert state["last"].tolist() == [3, 3] and state["seen"].tolist() == [1, 1]
    out2 = ll.sample(logits, params, jnp.ones(2, jnp.int32), processors=[proc], states=out.states)
    assert out2.tokens.tolist() == [0, 3]  # row 0 may not repeat 3: the lowest id of the rest
    assert out2.states[0]["seen"].tolist() == [2, 2]


def test_generate_stream_and_generate_many_agree(model):
    knobs = dict(temperature=0.9, seed=[3, 4, 5, 6], max_tokens=[9, 4, 12, 7])
    params = ll.SamplingParams.create(4, **knobs)
    procs = [_force([2, 0, 5, 1], [9, 8, 7, 6]), _repeat([3.0, 0.0, 50.0, 1.0])]
    want = ll.generate(model, PROMPTS, params, processors=procs)
    streamed = [[] for _ in PROMPTS]
    for ev in ll.stream(model, PROMPTS, params, processors=procs, chunk_steps=3):
        streamed[ev.row] += ev.token_ids
    assert streamed == want.token_ids
    requests = [
        ll.Request(
            p,
            params.take([r]),
            processors=[jax.tree.map(lambda x, r=r: x[r : r + 1], q) for q in procs],
        )
        for r, p in enumerate(PROMPTS)
    ]
    many = ll.generate_many(model, requests, slots=2, chunk_steps=2)
    assert [m.token_ids[0] for m in many] == want.token_ids
    assert [m.logprobs[0] for m in many] == want.logprobs


def test_n_samples_repeat_the_processor_rows(model):
    params = ll.SamplingParams.create(2, temperature=8.0, seed=[1, 2], max_tokens=6)
    got = ll.generate(model, PROMPTS[:2], params, n=2, processors=[_force([3, 1], [30, 29])])
    assert [row[3] for row in got.token_ids[:2]] == [30, 30]
    assert [row[1] for row in got.token_ids[2:]] == [29, 29]
    assert got.token_ids[0] != got.token_ids[1]  # two samples of one prompt


def test_after_temperature_against_float64():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, V)).astype(np.float32)
    temps = np.asarray([0.5, 1.0, 2.0], np.float32)
    params = ll.SamplingParams.create(3, temperature=temps.tolist())
    late = LateBias(token=jnp.asarray([1, 2, 3]), bias=jnp.asarray([2.0, 0.0, -1.5]))
    got = np.asarray(
        ll.sampling_distribution(logits, params, jnp.zeros(3, jnp.int32), processors=[late])
    )
    x = logits.astype(np.float64) / temps[:, None].astype(np.float64)
    x[np.arange(3), [1, 2, 3]] += [2.0, 0.0, -1.5]
    want = np.exp(x - x.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # Before temperature the same bias would be divided by T: a different distribution.
    early = logits.astype(np.float64)
    early[np.arange(3), [1, 2, 3]] += [2.0, 0.0, -1.5]
    early /= temps[:, None]
    early = np.exp(early - early.max(1, keepdims=True))
    early /= early.sum(1, keepdims=True)
    assert np.abs(got[0] - early[0]).max() > 1e-4  # 300 x the tolerance above


def test_every_token_masked_or_inf_is_an_error_row(model):
    params = ll.SamplingParams.create(4, temperature=[0.0, 1.0, 0.0, 1.0], max_tokens=5)
    fill = FillRows(
        rows=jnp.asarray([False, True, True, True]),
        fill=jnp.asarray([0.0, -jnp.inf, jnp.inf, jnp.nan]),
    )
    got = ll.generate(model, PROMPTS, params, processors=[fill])
    # NaN everywhere reads as every token masked: an error row too.
    assert got.finish_reason == ["length", "error", "error", "error"]
    assert got.token_ids[1:] == [[], [], []]
    assert all(np.isfinite(v) for v in got.logprobs[0])
    logits = jnp.zeros((4, V))
    out = ll.sample(logits, ll.SamplingParams.create(4), jnp.zeros(4, jnp.int32), processors=[fill])
    assert out.status.tolist() == [
        ll.STATUS_OK,
        ll.STATUS_ALL_MASKED,
        ll.STATUS_BAD_LOGITS,
        ll.STATUS_ALL_MASKED,
    ]


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            ForceAt(at=jnp.zeros((3,), jnp.int32), token=jnp.zeros((4,), jnp.int32)),
            r"processors\[0\] \(ForceAt\): leaf .at has shape \(3,\)",
        ),
        (
            ForceAt(at=jnp.zeros((4,), jnp.int32), token=jnp.int32(0)),
            r"processors\[0\] \(ForceAt\): leaf .token has shape \(\)",
        ),
        ("not a processor", r"processors\[0\] \(str\) has no init\(\) method"),
    ],
)
def test_bad_processors_are_named(model, bad, match):
    params = ll.SamplingParams.create(4, temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError, match=match):
        ll.generate(model, PROMPTS, params, processors=[bad])


def test_requests_of_one_job_share_a_structure(model):
    one = [_force([1], [2])]
    other = [_repeat([1.0])]
    with pytest.raises(ValueError, match=r"requests\[1\]: its processors have the tree structure"):
        ll.generate_many(
            model, [ll.Request([1], processors=one), ll.Request([2], processors=other)], slots=2
        )


def test_explain_shows_the_processors_stage(model):
    from logitloop.decoding.engine import explain as ex

    params = ll.SamplingParams.create(1, temperature=1.0, seed=4)
    bias = NoImmediateRepeat(strength=jnp.asarray([0.0]))  # no effect: the stage equals "adjusted"
    plain = ex.explain_next_token(model, [1, 2, 3], params, processors=[bias])
    np.testing.assert_allclose(plain.processed, plain.adjusted, atol=1e-7)
    assert [t for t, _ in plain.stages()][:3] == ["raw", "masks/bias/pen", "processors"]
    forced = ex.explain_next_token(model, [1, 2, 3], params, processors=[_force([0], [5])])
    want = np.zeros(V)
    want[5] = 1.0
    np.testing.assert_allclose(forced.processed, want, atol=1e-7)
    np.testing.assert_allclose(forced.final, want, atol=1e-7)
    assert forced.sampled_token == 5
    cut = forced.cut
    assert cut[5] == ex.KEPT and all(cut[t] == ex.CUT_PROCESSOR for t in range(V) if t != 5)
    assert ex.explain_next_token(model, [1, 2, 3], params).processed is None


def test_shipped_processors_in_the_loop(model, table):
    """NoRepeatNGram(2) and TypicalP inside generate: the greedy row never repeats a bigram
    of its prompt and output (a NumPy loop gives the expected tokens); mass 1 is off."""
    prompts = [[1, 2, 3, 1], [4, 5]]
    params = ll.SamplingParams.create(2, temperature=0.0, max_tokens=24)
    got = ll.generate(
        model,
        prompts,
        params,
        processors=[ll.NoRepeatNGram.create(2, size=[2, 0]), ll.TypicalP.create(2, mass=1.0)],
    )
    seq = list(prompts[0])
    for _ in range(24):
        logits = np.zeros(V)
        logits[table[seq[-1], len(seq) - 1]] = 10.0
        for i in range(len(seq) - 1):
            if seq[i] == seq[-1]:
                logits[seq[i + 1]] = -np.inf
        seq.append(int(np.argmax(logits)))
    assert got.token_ids[0] == seq[len(prompts[0]) :]
    pairs = list(zip(seq[:-1], seq[1:], strict=True))
    assert len(pairs) == len(set(pairs))
    assert got.token_ids[1] == ll.generate(model, prompts[1:], params.take([1])).token_ids[0]
