"""A fake model with scripted logits: no weights, no randomness.

The next token is `table[last_token, last_position]`: a pure function of the token fed and
its position, so the expected output of any prompt is computed by a plain Python loop
(`expected`). The cache records which token was written at each position, so tests can
check that finished rows are never written again.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import logitloop as ll


def _apply(table, tokens, positions, cache):
    """Module-level, so every scripted model of the same shapes shares one compiled program."""
    vocab = table.shape[0]
    batch, _ = tokens.shape
    slots = cache.shape[1]
    idx = jnp.where(positions >= 0, positions, slots)
    cache = cache.at[jnp.arange(batch)[:, None], idx].set(tokens, mode="drop")
    nxt = table[tokens[:, -1], jnp.maximum(positions[:, -1], 0)]
    logits = jnp.where(jnp.arange(vocab)[None, :] == nxt[:, None], 10.0, 0.0)
    return logits, cache


def _init_cache(batch, length):
    return jnp.full((batch, length), -1, jnp.int32)


def make_model(
    table: np.ndarray, *, eos: tuple[int, ...] = (), max_length: int = 512, tokenizer=None
):
    """The scripted model of `table` ([V, positions]); with `tokenizer` (of V tokens) its
    results carry text."""
    return ll.FunctionModel(
        apply_fn=_apply,
        params=jnp.asarray(table, jnp.int32),
        init_cache=_init_cache,
        vocab_size=table.shape[0],
        max_length=max_length,
        eos_token_ids=eos,
        tokenizer=tokenizer,
    )


def expected(table, prompt, max_tokens, stop_ids=(), stop_seqs=(), min_tokens=0):
    """The greedy continuation of `prompt` under the table, with stop rules applied."""
    out = []
    tok, pos = prompt[-1], len(prompt) - 1
    while len(out) < max_tokens:
        nxt = int(table[tok, pos])
        out.append(nxt)
        if nxt in stop_ids:
            return out, "stop"
        if len(out) >= min_tokens and any(out[-len(s) :] == list(s) for s in stop_seqs):
            return out, "stop"
        tok, pos = nxt, pos + 1
    return out, "length"


class ByteTokenizer:
    """A tokenizer whose token i is the byte string `pieces[i]` (no merges, no specials):
    enough for stop strings."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.vocab_size = len(pieces)

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i]

    def encode(self, text: str) -> list[int]:
        return [self.pieces.index(bytes([b])) for b in text.encode()]

    def decode(self, ids) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
