"""RL rollouts (issue 54): with `deterministic=True` the rollout (`generate`), `score` and
the trainer function (`ll.token_logprobs`) give bit-for-bit equal log-probs, in bfloat16
too; the trainer function is differentiable, its gradient that of the computation.

Each exactness case compiles generate, score and the trainer program (~2 min of a shared
2-core machine), so by default only the bad-input checks run; the gradient check against
float64 (80 s there), the matrix (every family and dtype, batch 5 against micro-batches of
2, `n > 1` on shared pages, `generate_many` paged with and without the prefix cache), the
shipped model under grad and the weight-sync test run under `-m slow`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import logitloop as ll
from logitloop.models import fixed_order
from tests.rl.family_models import FAMILIES, VOCAB, family_model, flat_results

PROMPTS = [[1, 5, 7, 9], [3, 4], [11, 12, 13, 14, 15, 16, 2], [8], [20, 21, 22]]


def _params(rows: int = 5) -> ll.SamplingParams:
    return ll.SamplingParams.create(
        rows, temperature=[1.0, 0.8, 1.1, 1.0, 0.7][:rows], top_k=[0, 10, 0, 5, 0][:rows],
        top_p=[1.0, 0.9, 0.95, 1.0, 0.8][:rows], max_tokens=8, seed=[1, 2, 3, 4, 5][:rows],
        logprobs=1,
    )  # fmt: skip


def _rollout_rows(gen, extra: int = 2):
    """`ll.rollout_batch` of a generate result, `extra` padding columns after the longest
    row: token_ids, prompt_lengths, lengths."""
    longest = max(len(p) + len(t) for p, t in zip(gen.prompt_token_ids, gen.token_ids, strict=True))
    batch = ll.rollout_batch(gen, width=longest + extra)
    return batch.token_ids, batch.prompt_lengths, batch.lengths


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def _assert_trainer_equals(model, gen, params) -> None:
    """token_logprobs of what `generate` drew == its raw and processed logprobs, bit for bit."""
    ids, plen, lens = _rollout_rows(gen)
    out = ll.token_logprobs(model, ids, plen, params, lengths=lens)
    for r in range(len(ids)):
        got = slice(plen[r], lens[r])
        np.testing.assert_array_equal(_bits(out.raw_logprobs[r, got]), _bits(gen.raw_logprobs[r]))
        np.testing.assert_array_equal(_bits(out.logprobs[r, got]), _bits(gen.logprobs[r]))
        assert not np.any(np.asarray(out.raw_logprobs[r, : plen[r]]))  # prompt: 0.0
        assert not np.any(np.asarray(out.raw_logprobs[r, lens[r] :]))  # padding: 0.0


def _assert_score_equals(model, prompts, tokens, raw, lp, params) -> None:
    out = ll.score(model, prompts, tokens, params, deterministic=True, batch_size=2)
    for r, s in enumerate(out):
        np.testing.assert_array_equal(_bits(s.raw_logprobs), _bits(raw[r]))
        np.testing.assert_array_equal(_bits(s.logprobs), _bits(lp[r]))


@pytest.mark.parametrize(
    ("family", "dtype"),
    [pytest.param(f, d, marks=pytest.mark.slow) for f in FAMILIES for d in ("bfloat16", "float32")],
)
def test_rollout_score_and_trainer_are_bit_for_bit(family, dtype):
    """Batch 5 against micro-batches of 2: tokens and logprobs equal; `score` (batches of 2)
    and `token_logprobs` (one padded batch) give the rollout's logprobs bit for bit."""
    model = family_model(family, dtype)
    params = _params()
    gen = ll.generate(model, PROMPTS, params, ignore_eos=True, deterministic=True)
    for i in range(0, 5, 2):
        rows = list(range(i, min(i + 2, 5)))
        part = ll.generate(model, PROMPTS[i : i + 2], params.take(rows), ignore_eos=True,
                           deterministic=True)  # fmt: skip
        assert part.token_ids == gen.token_ids[i : i + 2]
        for r, row in enumerate(rows):
            np.testing.assert_array_equal(_bits(part.raw_logprobs[r]), _bits(gen.raw_logprobs[row]))
    _assert_trainer_equals(model, gen, params)
    _assert_score_equals(model, gen.prompt_token_ids, gen.token_ids, gen.raw_logprobs,
                         gen.logprobs, params)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_n_samples_and_paged_batching_are_bit_for_bit(family, dtype):
    """n = 3 samples on shared prefix pages, and generate_many (contiguous slots, a paged
    pool, the prefix cache): the trainer function gives each row's logprobs bit for bit."""
    model = family_model(family, dtype)
    params = _params()
    gen = ll.generate(model, PROMPTS, params, ignore_eos=True, deterministic=True, n=3)
    _assert_trainer_equals(model, gen, params.samples(3))
    settings = dict(temperature=1.0, top_p=0.9, max_tokens=8, logprobs=1)
    reqs = [ll.Request(p, dict(settings, seed=i + 1)) for i, p in enumerate(PROMPTS)]
    seeds = ll.SamplingParams.create(5, seed=[1, 2, 3, 4, 5], **settings).samples(2)
    for kv, prefix in ((None, None), (512, False), (512, True)):
        res = ll.generate_many(model, reqs, deterministic=True, ignore_eos=True, n=2, slots=4,
                               kv_cache_tokens=kv, prefix_cache=prefix)  # fmt: skip
        flat = flat_results(res)
        _assert_trainer_equals(model, flat, seeds)


@pytest.mark.slow
def test_values_under_grad_and_keep_mask(shipped_bf16):
    """The shipped model in bfloat16: `nnx.value_and_grad` of a loss over token_logprobs
    sees the rollout's values bit for bit and finite gradients; the keep mask holds every
    drawn token and nothing at prompt or padding positions."""
    model = shipped_bf16
    prompts = ["def f(x):", "import"]
    params = _params(2)
    gen = ll.generate(model, prompts, params, ignore_eos=True, deterministic=True)
    ids, plen, lens = _rollout_rows(gen)

    def loss(m):
        out = ll.token_logprobs(m, ids, plen, params, lengths=lens)
        return jnp.sum(out.logprobs) + jnp.sum(out.raw_logprobs), out

    (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    for r in range(2):
        got = slice(plen[r], lens[r])
        np.testing.assert_array_equal(_bits(out.raw_logprobs[r, got]), _bits(gen.raw_logprobs[r]))
        np.testing.assert_array_equal(_bits(out.logprobs[r, got]), _bits(gen.logprobs[r]))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert any(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))
    keep = np.asarray(ll.token_logprobs(model, ids, plen, params, lengths=lens,
                                        keep_mask=True).keep_mask)  # fmt: skip
    for r in range(2):
        assert all(keep[r, t, ids[r, t]] for t in range(plen[r], lens[r]))
        assert not keep[r, : plen[r]].any() and not keep[r, lens[r] :].any()
    assert keep[1, plen[1]].sum() < keep.shape[2]  # top_p = 0.9 removed tokens


@pytest.fixture(scope="module")
def shipped_bf16():
    return ll.load_pretrained()


# ------------------------------------------------------------------ the gradient, in float64


def _float64_llama(w: dict, config, ids: jax.Array) -> jax.Array:
    """A plain float64 Llama forward (one pass, causal, tied head): `[B, T] -> [B, T, V]`
    log-softmax, written from the architecture, not from logitloop's layers."""
    c = config
    eps, d = c.rms_norm_eps, c.head_dim

    def norm(x, scale):
        return scale * x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps)

    t = ids.shape[1]
    pos = jnp.arange(t, dtype=jnp.float64)
    inv = 1.0 / (c.rope.theta ** (jnp.arange(0, d, 2, dtype=jnp.float64) / d))
    ang = jnp.concatenate([pos[:, None] * inv] * 2, -1)  # [T, D]

    def rope(x):  # [B, T, H, D]
        rot = jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * jnp.cos(ang)[:, None] + rot * jnp.sin(ang)[:, None]

    x = w["embedding"][ids]
    causal = jnp.tril(jnp.ones((t, t), bool))
    group = c.num_heads // c.num_kv_heads
    for blk in (w["layers"][i] for i in range(c.num_layers)):
        h = norm(x, blk["attn_norm"])
        q = rope(jnp.einsum("bte,ehd->bthd", h, blk["wq"]))
        k = jnp.repeat(rope(jnp.einsum("bte,ehd->bthd", h, blk["wk"])), group, axis=2)
        v = jnp.repeat(jnp.einsum("bte,ehd->bthd", h, blk["wv"]), group, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), -1)
        x = x + jnp.einsum("bqhd,hde->bqe", jnp.einsum("bhqk,bkhd->bqhd", p, v), blk["wo"])
        h = norm(x, blk["mlp_norm"])
        x = x + (jax.nn.silu(h @ blk["w_gate"]) * (h @ blk["w_up"])) @ blk["w_down"]
    logits = norm(x, w["final_norm"]) @ w["embedding"].T
    return jax.nn.log_softmax(logits, -1)


@pytest.mark.slow
def test_gradient_matches_a_float64_reference():
    """d/dweights of a weighted sum of completion log-probs (raw, and processed at
    temperature 0.7) against `jax.grad` of a float64 re-implementation, float32 model."""
    model = family_model("llama", "float32", seed=3)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (2, 7)).astype(np.int32)
    plen, lens = np.array([3, 2]), np.array([7, 5])
    coeff = rng.standard_normal(ids.shape)
    params = ll.SamplingParams.create(2, temperature=0.7)
    mask = (np.arange(7)[None] >= plen[:, None]) & (np.arange(7)[None] < lens[:, None])

    def loss(m):
        out = ll.token_logprobs(m, ids, plen, params, lengths=lens)
        return jnp.sum(out.raw_logprobs * coeff) + jnp.sum(out.logprobs * coeff)

    grads = nnx.grad(loss)(model)
    state = nnx.state(model, nnx.Param)
    with jax.enable_x64(True):
        w64 = jax.tree.map(
            lambda p: jnp.asarray(np.asarray(p), jnp.float64), nnx.to_pure_dict(state)
        )

        def ref(w):
            # position t's token given the tokens before it: column t - 1's distribution
            lsm = _float64_llama(w, model.config, jnp.asarray(ids))[:, :-1]  # [B, T-1, V]
            tok = jnp.asarray(ids)[:, 1:, None]
            raw = jnp.take_along_axis(lsm, tok, -1)[..., 0]
            hot = jnp.take_along_axis(jax.nn.log_softmax(lsm / 0.7, -1), tok, -1)[..., 0]
            m = jnp.asarray(mask[:, 1:] * coeff[:, 1:])
            return jnp.sum(raw * m) + jnp.sum(hot * m)

        want = jax.grad(ref)(w64)
    got = nnx.to_pure_dict(nnx.state(grads, nnx.Param))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-3,
                                   atol=2e-3 * float(np.abs(r).max()) + 1e-6)  # fmt: skip


# ------------------------------------------------------------------ weights and bad input


@pytest.mark.slow
def test_new_weights_compile_nothing(compile_counter):
    """nnx.update with weights of the same structure: generate, score and token_logprobs
    compile nothing; float32 weights into a bfloat16 model are refused by name."""
    model = family_model("llama", "bfloat16")
    params = _params(2)
    hand = ll.GenerationResult(
        token_ids=[[5, 6], [7]], finish_reason=[], stop_reason=[], num_tokens=[],
        prompt_token_ids=PROMPTS[:2], raw_logprobs=[[0.0, 0.0], [0.0]],
    )  # fmt: skip
    ids, plen, lens = _rollout_rows(hand)

    def run():
        ll.generate(model, PROMPTS[:2], params, deterministic=True)
        ll.score(model, PROMPTS[:2], [[5, 6], [7]], params, deterministic=True)
        ll.token_logprobs(model, ids, plen, params, lengths=lens)

    run()
    before = ll.token_logprobs(model, ids, plen, lengths=lens).raw_logprobs
    new = family_model("llama", "bfloat16", seed=1)
    nnx.update(model, nnx.state(new))
    with compile_counter as c:
        run()
    assert c.count == 0
    after = ll.token_logprobs(model, ids, plen, lengths=lens).raw_logprobs
    assert not np.array_equal(np.asarray(before), np.asarray(after))
    nnx.update(model, nnx.state(family_model("llama", "float32")))
    with pytest.raises(ValueError, match=r"dtype float32.*model.*bfloat16"):
        ll.token_logprobs(model, ids, plen, lengths=lens)


@pytest.fixture(scope="module")
def llama_bf16():
    return family_model("llama", "bfloat16")


@pytest.fixture(scope="module")
def llama_f32():
    return family_model("llama", "float32")


def test_token_logprobs_inside_a_users_jit_equals_its_own_program(llama_bf16):
    """bfloat16: traced into a user's own `jax.jit` compiled with
    `fixed_order.compiler_options()`, token_logprobs gives its own program's bits (which
    the matrix above pins to the rollout's; tests/rl/test_shipped_exactness.py, `-m
    slow`, against the shipped model's rollout). Without the options this model's
    values differ (by 0.013 nats against a rollout)."""
    ids = np.array([[1, 5, 7, 9, 11, 30, 2, 40], [3, 4, 50, 51, 60, 0, 0, 0]], np.int32)
    plen, lens = np.array([4, 2]), np.array([8, 5])
    graphdef, weights = nnx.split(llama_bf16)

    @jax.jit(compiler_options=fixed_order.compiler_options())
    def users_step(weights):
        model = nnx.merge(graphdef, weights)
        return ll.token_logprobs(model, ids, plen, lengths=lens).raw_logprobs

    own = ll.token_logprobs(llama_bf16, ids, plen, lengths=lens).raw_logprobs
    np.testing.assert_array_equal(_bits(users_step(weights)), _bits(own))


def test_weights_of_another_dtype_are_refused_by_every_entry_point(llama_bf16):
    """float32 arrays nnx.update'd into a bfloat16 model: generate, score and
    token_logprobs refuse them by the weight's name before compiling anything (one check,
    in `model_info`)."""
    model = llama_bf16
    state = nnx.state(model)
    wrong = nnx.state(model)
    wrong["layers"][1]["w_up"] = state["layers"][1]["w_up"][...].astype(jnp.float32)
    nnx.update(model, wrong)
    match = r"model weight .*layers.*1.*w_up.* has dtype float32 but the model is bfloat16"
    try:
        with pytest.raises(ValueError, match=match):
            ll.generate(model, PROMPTS[:1], max_tokens=2)
        with pytest.raises(ValueError, match=match):
            ll.score(model, PROMPTS[:1], [[5]])
        with pytest.raises(ValueError, match=match):
            ll.token_logprobs(model, [[1, 2]], [1])
    finally:
        nnx.update(model, state)  # the module's model for the other tests


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(token_ids=[[1, VOCAB]]), rf"token_ids\[0, 1\] = {VOCAB} is outside the vocabulary"),
        (dict(prompt_lengths=[3]), r"prompt_lengths\[0\] = 3 is outside the allowed range"),
        (dict(prompt_lengths=[0]), r"prompt_lengths\[0\] = 0"),
        (dict(prompt_lengths=[1, 1]), r"prompt_lengths must be 1 integers"),
        (dict(token_ids=[1, 2]), r"token_ids must be a \[B, T\] array"),
        (dict(params=ll.SamplingParams.create(2)), r"params has batch_size 2 but token_ids has 1"),
        (dict(keep_mask=True), r"keep_mask .* pass params"),
        (dict(routing=np.zeros((1, 2, 1, 1), np.int32)), "routing is a mixture of experts'"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match, llama_f32):
    model = llama_f32
    args = dict(token_ids=[[1, 2]], prompt_lengths=[1]) | kwargs
    with pytest.raises(ValueError, match=match):
        ll.token_logprobs(model, **args)


def test_return_routing_needs_a_mixture_of_experts(llama_f32):
    with pytest.raises(ValueError, match="return_routing=True needs a mixture-of-experts"):
        ll.generate(llama_f32, PROMPTS[:1], max_tokens=2, return_routing=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_new_widths_and_row_counts_inside_their_buckets_compile_nothing(
    llama_f32, deterministic, compile_counter
):
    """After one call, other widths (9..16 columns) and row counts (3..4) compile nothing:
    the rows are padded to their buckets and the results cut back on the host. Each row of
    the last call (3 rows and 12 columns, padded to 4 x 16) has the values of the row alone
    at the bucket's width, unpadded (other ids past its length; deterministic: bit for
    bit)."""
    rng = np.random.default_rng(3)

    def rows(batch: int, width: int):
        ids = rng.integers(1, VOCAB, size=(batch, 16)).astype(np.int32)
        plen = np.array([2 + r % 3 for r in range(batch)])
        lens = np.array([width - r % 2 for r in range(batch)])
        return ids, plen, lens

    kw = dict(deterministic=deterministic)
    ids, plen, lens = rows(3, 10)
    ll.token_logprobs(llama_f32, ids[:, :10], plen, lengths=lens, **kw)
    with compile_counter as c:
        for batch, width in ((4, 16), (4, 9), (3, 12)):
            ids, plen, lens = rows(batch, width)
            out = ll.token_logprobs(llama_f32, ids[:, :width], plen, lengths=lens, **kw)
            assert out.raw_logprobs.shape == (batch, width)
    assert c.count == 0
    for r in range(3):  # [1, 16]: no padding at all
        alone = ll.token_logprobs(llama_f32, ids[r : r + 1], plen[r : r + 1],
                                  lengths=lens[r : r + 1], **kw).raw_logprobs  # fmt: skip
        got, want = np.asarray(out.raw_logprobs[r]), np.asarray(alone[0, :12])
        assert np.any(got != 0)
        if deterministic:
            np.testing.assert_array_equal(_bits(got), _bits(want))
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
