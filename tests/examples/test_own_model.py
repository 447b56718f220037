"""examples/own_model.py (issue 65): a Llama-style decoder written in the example, in
Flax NNX, whose attention is `ll.attention`. Its main runs (`n = 4` on shared pages, a
paged `generate_many`), and its rows are those of plain separate rows; its full forward
(`kv=None`) is its cached decoding; with a logitloop `LlamaModel`'s weights it decodes the
family's tokens. Tiny sizes, greedy, a few tokens: the default suite (11 programs of over
half a second, 20 s of compiling: main's 4, the reference rows' 2, the family's and the
example's `generate` 2 each, one random init; the rest are small eager ones). The
deterministic check is `-m slow`."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import logitloop as ll
from logitloop.models import LlamaConfig, LlamaModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import own_model  # noqa: E402 - an example script, importable once examples/ is on the path

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def run():
    """The example's main, greedy, and the same prompts as plain rows of one `generate`
    (contiguous cache, each row prefilled by itself): the prompt four times, then each
    `generate_many` request with its own `max_tokens`."""
    out = own_model.main(["--temperature", "0", "--max-tokens", str(MAX_TOKENS)])
    prompts = [out["prompt"]] * 4 + [p for p, _ in out["requests"]]
    lengths = [MAX_TOKENS] * 4 + [knobs["max_tokens"] for _, knobs in out["requests"]]
    plain = ll.generate(out["model"], prompts, temperature=0.0, max_tokens=lengths,
                        ignore_eos=True)  # fmt: skip
    return out, plain


def test_main_rows_equal_separate_rows(run):
    """`n = 4` (one prefill, four rows on its pages) and the continuous-batching job on a
    paged pool give the tokens of plain separate rows."""
    out, plain = run
    assert len(set(map(tuple, plain.token_ids[:4]))) == 1  # greedy: four equal rows
    assert len(set(plain.token_ids[0])) > 1  # not a constant row
    assert out["samples"] == plain.token_ids[:4]
    assert out["batch"] == plain.token_ids[4:]
    assert [len(t) for t in out["batch"]] == [k["max_tokens"] for _, k in out["requests"]]


def test_full_forward_equals_cached_decoding(run):
    """The module's own forward with `kv=None` (plain causal attention over the columns),
    over a prompt and its greedy continuation: its argmax at every generated position is
    the token decoding chose, and its log-probability the one decoding reported."""
    out, plain = run
    module = out["model"].module
    row = 5  # an 11-token request: left-padded in its batch of prompts
    tokens = np.asarray(plain.prompt_token_ids[row] + plain.token_ids[row], np.int32)[None]
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    logits, kv = nnx.jit(lambda m, t, p: m(t, p, None))(module, tokens, positions)
    assert kv is None and logits.shape == (1, tokens.shape[1], own_model.Config.vocab_size)
    p = len(plain.prompt_token_ids[row])
    logprobs = jax.nn.log_softmax(logits[0, p - 1 : -1], axis=-1)  # predicts each generated
    assert np.argmax(logprobs, axis=-1).tolist() == plain.token_ids[row]
    chosen = np.take_along_axis(np.asarray(logprobs), tokens[0, p:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(chosen, plain.raw_logprobs[row], atol=2e-5, rtol=1e-5)


@pytest.mark.slow  # the family through the contract: tests/models/test_own_model.py
def test_from_llama_decodes_the_family_tokens():
    """A logitloop `LlamaModel` (random float32 weights, grouped-query heads, a separate
    head) and the example's module with its weights (`from_llama`): the same full-forward
    logits and the same greedy tokens through `from_nnx`."""
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                         rms_norm_eps=1e-5)  # fmt: skip
    llama = LlamaModel(config, dtype=np.float32, rngs=nnx.Rngs(3))
    mine = own_model.from_llama(llama)
    tokens = np.random.default_rng(0).integers(1, 96, (2, 7)).astype(np.int32)
    positions = np.broadcast_to(np.arange(7, dtype=np.int32), (2, 7))
    theirs, _ = nnx.jit(lambda m, t, p: m(t, p, None, all_columns=True))(llama, tokens, positions)
    ours, _ = nnx.jit(lambda m, t, p: m(t, p, None))(mine, tokens, positions)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    model = ll.from_nnx(mine, mine.kv_spec, vocab_size=96, max_length=64)
    prompts = [tokens[0].tolist(), tokens[1, :4].tolist()]
    knobs = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = ll.generate(llama, prompts, **knobs).token_ids
    assert ll.generate(model, prompts, **knobs).token_ids == want
    assert len(set(map(tuple, want))) == 2 and len(set(want[0])) > 1  # not a constant row


@pytest.mark.slow  # its programs; tests/models/test_own_model.py pins the mode by default
def test_deterministic_rows_keep_their_bits_in_a_batch(run):
    """`deterministic=True`: the example's products (`ll.dense`), norms (`ll.mean`) and
    head in a fixed order, so a row's tokens and raw logprobs in a batch of three are bit
    for bit those of the row alone."""
    out, _ = run
    prompts = [p for p, _ in out["requests"][:3]]
    knobs = dict(temperature=0.9, seed=3, max_tokens=6, deterministic=True, ignore_eos=True)
    alone = ll.generate(out["model"], [prompts[1]], **knobs)
    batch = ll.generate(out["model"], prompts, **knobs)
    assert batch.token_ids[1] == alone.token_ids[0]
    assert batch.raw_logprobs[1] == alone.raw_logprobs[0]
