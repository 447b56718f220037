"""Our models against `transformers` on the same tiny random checkpoints.

Logits: each prompt's last-position logits from one left-padded batched call against HF's
unpadded single-prompt forward. Greedy decoding: 32 tokens through the decode-loop
protocol (prefill, then one column per step) against `generate(do_sample=False)`.

Gemma 2's reference is HF's eager attention, the one that soft-caps attention logits as
Gemma 2 does (`build_hf_model`); checked under transformers 5.12.1 (whose default for Gemma 2,
sdpa, drops the cap: every logit differs) and 5.25 (eager by default).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitloop.models import GemmaModel, GPT2Model, LlamaModel, MoeModel, layers, load_pretrained

from .tiny_checkpoints import (
    CASES,
    build_hf_model,
    greedy_generate,
    jitted_forward,
    left_pad,
    random_prompts,
    save_hf_model,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

LENGTHS = [5, 13, 9]
BUCKET = 16
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(case name, HF model, our model loaded from its saved checkpoint)."""
    hf = build_hf_model(request.param)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, load_pretrained(folder)


@pytest.fixture(scope="module")
def forward(pair):
    """The model's jitted forward, shared so each shape compiles once per case."""
    return jitted_forward(pair[2])


def test_loaded_model_matches_architecture(pair):
    case, hf, model = pair
    expected = {
        "gpt2": GPT2Model,
        "gemma2": GemmaModel,
        "gemma3_text": GemmaModel,
        "mixtral": MoeModel,
        "qwen3_moe": MoeModel,
    }
    assert type(model) is expected.get(case, LlamaModel)
    assert model.config.vocab_size == hf.config.vocab_size
    assert model.dtype == jnp.float32


def test_batched_left_padded_logits_match_hf(pair, forward):
    _, hf, model = pair
    prompts = random_prompts(model.config.vocab_size, LENGTHS, seed=1)
    tokens, positions = left_pad(prompts, BUCKET)
    cache = model.init_cache(len(prompts), BUCKET + NEW_TOKENS)
    logits, _ = forward(jnp.asarray(tokens), jnp.asarray(positions), cache)
    assert logits.shape == (len(prompts), model.config.vocab_size)
    assert logits.dtype == jnp.float32
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1].float().numpy()
        np.testing.assert_allclose(np.asarray(logits[row]), want, rtol=0, atol=1e-4)


def test_gemma2_reference_caps_attention_logits():
    """The reference applies `attn_logit_softcapping`, and at these sizes the cap bites: a
    model (or a transformers default) without it fails the logits test above."""
    hf = build_hf_model("gemma2")
    assert hf.config._attn_implementation == "eager"
    prompt = torch.tensor(random_prompts(hf.config.vocab_size, [13], seed=1))
    with torch.no_grad():
        capped = hf(prompt).logits[0, -1]
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = hf(prompt).logits[0, -1]
    assert float((capped - uncapped).abs().max()) > 0.1


def test_greedy_32_tokens_match_hf_generate(pair, forward):
    _, hf, model = pair
    prompts = random_prompts(model.config.vocab_size, LENGTHS, seed=2)
    ours = greedy_generate(model, prompts, NEW_TOKENS, BUCKET, forward)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,  # never stop early: compare all 32 tokens
                pad_token_id=0,
            )
        want = out[0, len(prompt) :].tolist()
        assert len(want) == NEW_TOKENS
        assert ours[row].tolist() == want, f"row {row}"


def test_padding_never_writes_the_cache(pair, forward):
    _, _, model = pair
    prompts = random_prompts(model.config.vocab_size, [3, 13, 7], seed=3)
    tokens, positions = left_pad(prompts, BUCKET)
    cache = model.init_cache(3, BUCKET + NEW_TOKENS)
    _, cache = forward(jnp.asarray(tokens), jnp.asarray(positions), cache)
    for layer in cache:
        for values in (layer["k"], layer["v"]):
            values = np.asarray(values)
            for row, prompt in enumerate(prompts):
                # [B, H, S, D]: slots 0..len-1 hold the prompt; every later slot is zero.
                assert np.all(np.any(values[row, :, : len(prompt)] != 0, axis=(0, -1)))
                assert not np.any(values[row, :, len(prompt) :])


def test_all_padding_row_gives_finite_logits(pair, forward):
    _, _, model = pair
    # Row 1 is nothing but padding; its logits are unused but must not be NaN.
    tokens, positions = left_pad([[5, 6, 7], [], [8]], BUCKET)
    cache = model.init_cache(3, BUCKET + NEW_TOKENS)
    logits, _ = forward(jnp.asarray(tokens), jnp.asarray(positions), cache)
    assert np.all(np.isfinite(np.asarray(logits)))


def test_every_parameter_names_its_logical_axes(pair):
    _, _, model = pair
    from flax import nnx

    params = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert leaves
    for variable in leaves:
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == variable[...].ndim
    specs = jax.tree.leaves(nnx.get_partition_spec(params))
    assert any("heads" in spec for spec in specs)
    assert any("vocab" in spec for spec in specs)


def test_sliding_window_ring_longer_calls_and_columns_taken_back(pair, forward):
    """Gemma 3 (local and global layers mixed): the local layers' cache is a ring of
    window + RING_SLACK = 13 slots. Prompts longer than the ring, then 4 draft columns of
    which 2 are taken back and 2 others written (as speculative verification would), give
    the logits `transformers` gives each whole sequence. (The greedy test above wraps the
    ring too: its positions reach 45.) Same shapes as the tests above: no new compile."""
    case, hf, model = pair
    if case != "gemma3_text":
        pytest.skip("one case with sliding and global layers suffices")
    cache = model.init_cache(3, BUCKET + NEW_TOKENS)
    for layer, window in zip(cache, model.config.sliding_windows, strict=True):
        slots = BUCKET + NEW_TOKENS if window is None else window + layers.RING_SLACK
        assert layer["k"].shape == (3, model.config.num_kv_heads, slots, model.config.head_dim)
        assert ("pos" in layer) == (window is not None)
    assert model.config.sliding_windows[0] + layers.RING_SLACK < 14
    prompts = random_prompts(model.config.vocab_size, [16, 14, 15], seed=7)
    rng = np.random.default_rng(8)
    drafts, redo = rng.integers(3, 150, (4, 3)), rng.integers(3, 150, (2, 3))

    def check(logits, sequences):
        for row, sequence in enumerate(sequences):
            with torch.no_grad():
                want = hf(torch.tensor([sequence])).logits[0, -1].numpy()
            np.testing.assert_allclose(np.asarray(logits[row]), want, rtol=0, atol=1e-4)

    tokens, positions = left_pad(prompts, BUCKET)
    logits, cache = forward(jnp.asarray(tokens), jnp.asarray(positions), cache)
    check(logits, prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    for i, column in enumerate(list(drafts) + list(redo)):
        position = lengths + (i if i < 4 else i - 2)  # the redo columns rewrite drafts 2, 3
        logits, cache = forward(jnp.asarray(column[:, None]), jnp.asarray(position[:, None]), cache)
    final = [p + drafts[:2, r].tolist() + redo[:, r].tolist() for r, p in enumerate(prompts)]
    check(logits, final)
