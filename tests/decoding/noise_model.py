"""A weightless model for the constraint tests: the shipped tokenizer, logits wider than it.

The logits are a fixed base vector plus noise that is a function of (last token, position),
so every row still follows its own random stream, compile time is small, and the ids past the
tokenizer's vocabulary get a large logit: a mask that let them through would draw them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import logitloop as ll
from logitloop.decoding.loop.runner import model_info

EXTRA = 64  # logits columns past the tokenizer's vocabulary
EXTRA_LOGIT = 12.0


def _apply(base, tokens, positions, cache):
    vocab = base.shape[0]
    keys = jax.vmap(lambda t, p: jax.random.fold_in(jax.random.key(7), t * 4099 + p))(
        tokens[:, -1], jnp.maximum(positions[:, -1], 0)
    )
    noise = jax.vmap(lambda k: jax.random.normal(k, (vocab,)))(keys)
    return base[None, :] + 2.0 * noise, cache


def _init_cache(batch, length):
    return jnp.zeros((batch, 1), jnp.int32)


@functools.lru_cache(maxsize=1)
def shipped_tokenizer():
    return model_info(ll.load_pretrained()).tokenizer


@functools.lru_cache(maxsize=1)
def noise_model() -> ll.FunctionModel:
    tok = shipped_tokenizer()
    base = np.zeros(tok.vocab_size + EXTRA, np.float32)
    base[tok.vocab_size :] = EXTRA_LOGIT
    return ll.FunctionModel(
        apply_fn=_apply,
        params=jnp.asarray(base),
        init_cache=_init_cache,
        vocab_size=base.shape[0],
        max_length=512,
        eos_token_ids=tuple(tok.eos_token_ids),
        tokenizer=tok,
    )
