"""Stop strings: matched on device after every token, trimmed exactly on the host.

A stop string can span several tokens and begin or end inside one, so the loop matches it on
bytes, not tokens. From the tokenizer's vocabulary we precompute, once per tokenizer, the
bytes each token contributes (`TokenBytes`: `[V, Lt]`). Each row carries a window of the last
`W` bytes of its generated text; after a token, the window shifts by that token's byte length
and the token's bytes are appended, and every stop string of the row is compared against
every position where an occurrence would end inside the new bytes. `W = Ls - 1 + Lt`
(longest stop string, longest token) is exactly enough for any occurrence that ends in the
new bytes. Bytes before the first generated token are a sentinel (256) that matches
nothing, so a stop string inside the prompt does not count.

Text is the UTF-8 decoding of the generated tokens' bytes (`Detokenizer`). When a stop string
ended the row, the host cuts at the occurrence that ended it: the earliest occurrence of any of
the row's stop strings that ends after the text of its first `min_tokens - 1` tokens (the loop
does not count occurrences that end before; `include_stop_str_in_output` keeps the stop string).
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from logitloop.decoding.sampling.checks import Widths, bucket_width

SENTINEL = 256  # not a byte: never equal to a stop-string byte

_TABLE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@struct.dataclass
class TokenBytes:
    """The bytes of every token id, padded: `bytes[v, :length[v]]`."""

    bytes: jax.Array  # [V, Lt] i32
    length: jax.Array  # [V] i32


@struct.dataclass
class StopStrings:
    """Per-row stop strings as bytes plus the vocabulary's byte table."""

    tokens: TokenBytes
    strings: jax.Array  # [B, Q, Ls] i32, left-aligned, SENTINEL-padded
    lengths: jax.Array  # [B, Q] i32, 0 = unused slot

    @property
    def window(self) -> int:
        return self.strings.shape[2] - 1 + self.tokens.bytes.shape[1]


def token_bytes(tokenizer, vocab_size: int) -> TokenBytes:
    """The device byte table of a tokenizer (built once per tokenizer object)."""
    cached = _TABLE_CACHE.get(tokenizer)
    if cached is not None and cached.length.shape[0] == vocab_size:
        return cached
    pieces = [
        tokenizer.token_bytes(i) if i < tokenizer.vocab_size else b"" for i in range(vocab_size)
    ]
    width = bucket_width(max(len(p) for p in pieces), 4)
    table = np.zeros((vocab_size, width), np.int32)
    for i, p in enumerate(pieces):
        table[i, : len(p)] = np.frombuffer(p, np.uint8)
    lengths = np.asarray([len(p) for p in pieces], np.int32)
    out = jax.device_put(TokenBytes(bytes=table, length=lengths))  # compiles nothing
    _TABLE_CACHE[tokenizer] = out
    return out


def build(
    stop: Sequence[Sequence[str]], tokens: TokenBytes, widths: Widths | None = None
) -> StopStrings:
    """Tables for per-row stop strings (`SamplingParams.stop`), at least `widths` wide."""
    encoded = [[s.encode("utf-8") for s in row] for row in stop]
    q = bucket_width(max(len(r) for r in encoded), 4)
    ls = bucket_width(max((len(s) for r in encoded for s in r), default=1), 16)
    if widths is not None:
        q, ls = max(q, widths.stop_strings), max(ls, widths.stop_len)
    strings = np.full((len(stop), q, ls), SENTINEL, np.int32)
    lengths = np.zeros((len(stop), q), np.int32)
    for i, row in enumerate(encoded):
        for j, s in enumerate(row):
            strings[i, j, : len(s)] = np.frombuffer(s, np.uint8)
            lengths[i, j] = len(s)
    return StopStrings(tokens=tokens, **jax.device_put(dict(strings=strings, lengths=lengths)))


def empty_window(batch: int, tables: StopStrings) -> jax.Array:
    return jnp.full((batch, tables.window), SENTINEL, jnp.int32)


def advance(
    window: jax.Array,  # [B, W] i32, the last W bytes of each row's text
    tables: StopStrings,
    tokens: jax.Array,  # [B] i32, the new token of each row
    active: jax.Array,  # [B] bool, rows that really appended the token
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Append each token's bytes; report rows whose text now contains a stop string.

    Returns (window [B, W], hit [B] bool, which [B] i32 index of a matching stop string).
    """
    _, width = window.shape
    new_bytes = tables.tokens.bytes[tokens]  # [B, Lt]
    n = jnp.where(active, tables.tokens.length[tokens], 0)  # [B]
    combined = jnp.concatenate([window, new_bytes], axis=1)  # [B, W + Lt]
    idx = n[:, None] + jnp.arange(width)[None, :]  # last W bytes of window ++ new[:n]
    window = jnp.take_along_axis(combined, idx, axis=1)

    ls = tables.strings.shape[2]
    # Every occurrence ends at window[e], e in [W - n, W); it starts at e - len + 1.
    ends = width - 1 - jnp.arange(tables.tokens.bytes.shape[1])  # candidate end offsets
    lengths = tables.lengths  # [B, Q]
    starts = ends[None, None, :] - lengths[:, :, None] + 1  # [B, Q, E]
    cols = starts[..., None] + jnp.arange(ls)[None, None, None, :]  # [B, Q, E, Ls]
    rows = jnp.arange(window.shape[0])[:, None, None, None]
    got = window[rows, jnp.clip(cols, 0, width - 1)]  # [B, Q, E, Ls]
    inside = jnp.arange(ls)[None, None, None, :] < lengths[:, :, None, None]
    equal = (got == tables.strings[:, :, None, :]) | ~inside
    in_new = (width - 1 - ends)[None, None, :] < n[:, None, None]  # end lies in the new bytes
    found = jnp.all(equal, axis=3) & in_new & (lengths[:, :, None] > 0) & (starts >= 0)
    per_string = jnp.any(found, axis=2)  # [B, Q]
    return window, jnp.any(per_string, axis=1) & active, jnp.argmax(per_string, axis=1)


# ----------------------------------------------------------------------------- host side


def first_stop(text: str, stops: Sequence[str], after: int = 0) -> tuple[int, str] | None:
    """(start index, stop string) of the earliest occurrence in `text` that ends after
    character `after` (exclusive end index > after); ties: the longer."""
    best = None
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def trim(text: str, stops: Sequence[str], include: bool, after: int = 0) -> tuple[str, str | None]:
    """Cut `text` at its earliest stop string ending after character `after`.

    Returns (text, the stop string or None).
    """
    hit = first_stop(text, stops, after)
    if hit is None:
        return text, None
    start, s = hit
    return text[: start + len(s)] if include else text[:start], s


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could still begin a stop string."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return keep


class Detokenizer:
    """Incremental UTF-8 text of one row's generated tokens.

    Feeds token bytes through an incremental decoder, so an incomplete multi-byte sequence
    is never turned into text until its last byte arrives.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def feed(self, ids: Sequence[int]) -> str:
        piece = self._decoder.decode(b"".join(self._tokenizer.token_bytes(int(i)) for i in ids))
        self.text += piece
        return piece

    def finish(self) -> str:
        piece = self._decoder.decode(b"", final=True)
        self.text += piece
        return piece


def detokenize(tokenizer, ids: Sequence[int]) -> str:
    d = Detokenizer(tokenizer)
    d.feed(ids)
    d.finish()
    return d.text
