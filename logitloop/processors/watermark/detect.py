"""Watermark detectors over token ids: `watermark_score(token_ids, watermark)`.

- A `GreenListWatermark` gives transformers' `WatermarkDetector` result: every n-gram of
  the text (n = context_width + 1 for "lefthash", context_width for "selfhash") scores its
  last token green or not under the key; with T scored tokens of which G green,
  `z = (G - gamma T) / sqrt(T gamma (1 - gamma))`, the one-sided p-value
  `erfc(z / sqrt 2) / 2`, and `prediction = z > z_threshold`. A leading `bos_token_id` is
  dropped first; `ignore_repeated_ngrams` counts each distinct n-gram once.
- A `SynthIDWatermark` gives the mean g-value score of the SynthID paper's code
  (`detector_mean.py`, the unweighted and the weighted mean), over the text's n-grams
  masked as transformers' `SynthIDTextWatermarkDetector` masks them: an n-gram whose
  context repeats one of the last `context_history_size` contexts, and every n-gram from
  the first `eos_token_id` on, are left out. Unwatermarked text scores about 0.5; the
  watermark raises it. transformers' own detector feeds these g-values to a trained
  Bayesian model, which is not reproduced here.

The green tests and g-values run in JAX, with the processors' own functions.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from logitloop.decoding.sampling.checks import bucket_width, is_token_id
from logitloop.processors.watermark import green_list, synthid, u64
from logitloop.processors.watermark.green_list import GreenListWatermark
from logitloop.processors.watermark.synthid import SynthIDWatermark


@dataclasses.dataclass(frozen=True)
class GreenListScore:
    """Per text [B], as transformers' `WatermarkDetectorOutput`."""

    num_tokens_scored: np.ndarray  # [B] f64
    num_green_tokens: np.ndarray  # [B] f64
    green_fraction: np.ndarray  # [B] f64
    z_score: np.ndarray  # [B] f64
    p_value: np.ndarray  # [B] f64
    prediction: np.ndarray  # [B] bool, z_score > z_threshold


@dataclasses.dataclass(frozen=True)
class SynthIDScore:
    """Per text [B]: the mean g-value scores (NaN where no n-gram is left to score)."""

    mean: np.ndarray  # [B] f64
    weighted_mean: np.ndarray  # [B] f64, depth weights linspace(10, 1) summing to depth
    num_scored: np.ndarray  # [B] i64, the n-grams scored


def watermark_score(
    token_ids: Sequence[Sequence[int]],
    watermark: GreenListWatermark | SynthIDWatermark,
    *,
    z_threshold: float = 3.0,
    ignore_repeated_ngrams: bool = False,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> GreenListScore | SynthIDScore:
    """Score each text (a list of token ids; the prompt is best left out) under the row of
    `watermark` with its index (a one-row watermark scores every text). See the module
    docstring. `z_threshold`, `ignore_repeated_ngrams`, `bos_token_id`: the green list's;
    `eos_token_id`: SynthID's. Raises ValueError naming the text and what is wrong."""
    texts = _texts(token_ids)
    rows = watermark.on.shape[0]
    if rows not in (1, len(texts)):
        raise ValueError(
            f"watermark has {rows} rows for {len(texts)} texts: pass one row, or one per text"
        )
    pick = [0 if rows == 1 else i for i in range(len(texts))]
    on = np.asarray(watermark.on)
    for i, r in enumerate(pick):
        if not on[r]:
            raise ValueError(f"token_ids[{i}]: watermark row {r} has no key (it is off)")
    if isinstance(watermark, GreenListWatermark):
        return _green_list_score(
            texts, watermark, pick, z_threshold, ignore_repeated_ngrams, bos_token_id
        )
    if isinstance(watermark, SynthIDWatermark):
        return _synthid_score(texts, watermark, pick, eos_token_id)
    raise ValueError(
        f"watermark must be a GreenListWatermark or a SynthIDWatermark, got {type(watermark)!r}"
    )


def _texts(token_ids: Any) -> list[list[int]]:
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError("token_ids must be a non-empty list of texts (lists of token ids)")
    if all(is_token_id(t) for t in token_ids):
        token_ids = [token_ids]
    out = []
    for i, ids in enumerate(token_ids):
        if not isinstance(ids, (list, tuple, np.ndarray)) or not all(is_token_id(t) for t in ids):
            raise ValueError(f"token_ids[{i}] must be a list of token ids (ints)")
        if any(t < 0 for t in ids):
            raise ValueError(f"token_ids[{i}] holds a negative token id")
        out.append([int(t) for t in ids])
    return out


def _green_list_score(texts, wm, pick, z_threshold, ignore_repeated, bos) -> GreenListScore:
    vocab = wm.vocab_size
    key, selfhash, width = (np.asarray(x) for x in (wm.key, wm.selfhash, wm.context_width))
    gamma, size = np.asarray(wm.gamma, np.float64), np.asarray(wm.green_size)
    counts, grams = [], {}  # per text: Counter of n-grams; (row, n-gram) -> index
    for i, (ids, r) in enumerate(zip(texts, pick, strict=True)):
        if bos is not None and ids and ids[0] == bos:
            ids = ids[1:]
        if any(t >= vocab for t in ids):
            raise ValueError(f"token_ids[{i}] holds a token id outside [0, {vocab - 1}]")
        if len(ids) - int(width[r]) < 1:
            raise ValueError(
                f"token_ids[{i}] has {len(ids)} tokens: scoring needs more than "
                f"context_width = {int(width[r])}"
            )
        n = int(width[r]) + 1 - int(selfhash[r])
        c = collections.Counter(tuple(ids[j : j + n]) for j in range(len(ids) - n + 1))
        counts.append(c)
        for g in c:
            grams.setdefault((r, g), len(grams))
    # One batch of green tests, padded to a power of two (few shapes compile).
    num, wide = bucket_width(len(grams), 1), green_list.MAX_CONTEXT_WIDTH + 1
    ctx = np.full((num, wide), -1, np.int32)
    rows = np.zeros(num, np.int64)
    for (r, g), j in grams.items():
        ctx[j, wide - len(g) :] = g
        rows[j] = r
    ctx[len(grams) :, -1] = 0
    flags = np.asarray(
        green_list.green_flags(
            jnp.asarray(key[rows]),
            jnp.asarray(selfhash[rows]),
            jnp.asarray(ctx),
            jnp.asarray(size[rows]),
            jnp.asarray(width[rows]),
            vocab_size=vocab,
        )  # fmt: skip
    )
    scored, green = [], []
    for c, r in zip(counts, pick, strict=True):
        hit = {g: bool(flags[grams[(r, g)]]) for g in c}
        scored.append(len(c) if ignore_repeated else sum(c.values()))
        green.append(
            sum(hit.values()) if ignore_repeated else sum(f * hit[g] for g, f in c.items())
        )
    t, g = np.asarray(scored, np.float64), np.asarray(green, np.float64)
    p = gamma[pick]
    z = (g - p * t) / np.sqrt(t * p * (1 - p))
    return GreenListScore(
        num_tokens_scored=t,
        num_green_tokens=g,
        green_fraction=g / t,
        z_score=z,
        p_value=np.asarray([0.5 * math.erfc(x / math.sqrt(2)) for x in z]),
        prediction=z > z_threshold,
    )


def _hashes(windows: np.ndarray, count: int) -> np.ndarray:
    """[N] int64 accumulate_hash(1, w) of each right-aligned window [N, MAX_NGRAM_LEN - 1]."""
    hi, lo = synthid.context_hash(jnp.asarray(windows), jnp.full(len(windows), count, jnp.int32))
    bits = (np.asarray(hi).astype(np.uint64) << np.uint64(32)) | np.asarray(lo).astype(np.uint64)
    return bits.view(np.int64)


def _synthid_score(texts, wm, pick, eos) -> SynthIDScore:
    ngram = np.asarray(wm.ngram_len)
    width = synthid.MAX_NGRAM_LEN - 1
    means, weighted, scored = [], [], []
    depth = wm.depth
    weights = np.linspace(10, 1, depth)
    weights *= depth / weights.sum()
    for i, (ids, r) in enumerate(zip(texts, pick, strict=True)):
        n = int(ngram[r])
        num = len(ids) - n + 1
        if num < 1:
            raise ValueError(f"token_ids[{i}] has {len(ids)} tokens: scoring needs ngram_len = {n}")
        # Contexts (the n - 1 tokens before each scored token), right-aligned.
        ctx = np.zeros((num, width), np.int64)
        for j in range(num):
            ctx[j, width - (n - 1) :] = ids[j : j + n - 1]
        h = synthid.context_hash(jnp.asarray(ctx, jnp.int32), jnp.full(num, n - 1, jnp.int32))
        last = u64.from_u32(jnp.asarray([ids[j + n - 1] for j in range(num)], jnp.uint32))
        hn = synthid.accumulate(h, last)
        keys = (wm.keys_hi[r][None, :], wm.keys_lo[r][None, :])
        g = np.asarray(
            synthid.g_values(hn, keys, jnp.broadcast_to(wm.table[r], (num, wm.table.shape[1])))
        )
        mask = _repetition_mask(_hashes(ctx.astype(np.int32), n - 1), wm.history_size)
        if eos is not None and eos in ids:
            first = ids.index(eos)
            mask &= np.arange(num) + n - 1 < first
        m = mask.astype(np.float64)
        scored.append(int(m.sum()))
        with np.errstate(invalid="ignore", divide="ignore"):
            means.append(float((g * m[:, None]).sum() / (depth * m.sum())))
            weighted.append(float((g * weights[None, :] * m[:, None]).sum() / (depth * m.sum())))
    return SynthIDScore(np.asarray(means), np.asarray(weighted), np.asarray(scored, np.int64))


def _repetition_mask(hashes: np.ndarray, size: int) -> np.ndarray:
    """[N] bool: the context was not among the last `size` ones (a window that starts as
    `size` zeros, as transformers' history does)."""
    window = collections.deque([0] * size, maxlen=size)
    present = collections.Counter(window)
    out = np.ones(len(hashes), bool)
    for j, h in enumerate(hashes.tolist()):
        out[j] = present[h] == 0
        present[window[-1]] -= 1
        window.appendleft(h)
        present[h] += 1
    return out
