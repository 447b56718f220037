"""Float64 NumPy references for the shipped processors: plain loops over rows and tokens.

Each takes one row (its tokens as a Python list, its float32 logits) and returns the
processed float64 logits of that row. They follow the published algorithms directly and
share no code with `logitloop.processors`.
"""

from __future__ import annotations

import math

import numpy as np

DRY_MAX_MATCH = 50  # text-generation-webui's cap: `while match_length < 50`


def no_repeat_ngram_row(tokens: list[int], logits: np.ndarray, n: int) -> np.ndarray:
    """Ban the last token of every n-gram of `tokens` whose first n - 1 tokens are the
    row's last n - 1 tokens (`n == 0`: off)."""
    out = np.asarray(logits, np.float64).copy()
    if n == 0 or len(tokens) < n:
        return out
    prefix = tokens[len(tokens) - n + 1 :] if n > 1 else []
    for i in range(len(tokens) - n + 1):
        if tokens[i : i + n - 1] == prefix:
            out[tokens[i + n - 1]] = -math.inf
    return out


def dry_row(
    tokens: list[int],
    logits: np.ndarray,
    multiplier: float,
    base: float,
    allowed_length: int,
    penalty_range: int,
    breakers: list[int],
) -> np.ndarray:
    """text-generation-webui's DRYLogitsProcessor, one row, written out step by step."""
    out = np.asarray(logits, np.float64).copy()
    if multiplier == 0 or not tokens:
        return out
    ids = tokens[-penalty_range:] if penalty_range > 0 else list(tokens)
    last = ids[-1]
    if last in breakers:
        return out
    longest: dict[int, int] = {}
    for i in range(len(ids) - 1):  # every earlier occurrence of the last token
        if ids[i] != last:
            continue
        nxt = ids[i + 1]
        if nxt in breakers:
            continue
        length = 1
        while length < DRY_MAX_MATCH:
            j = i - length
            if j < 0:
                break
            prev = ids[-(length + 1)]
            if ids[j] != prev or prev in breakers:
                break
            length += 1
        longest[nxt] = max(length, longest.get(nxt, 0))
    for tok, length in longest.items():
        if length >= allowed_length:
            out[tok] -= float(multiplier) * float(base) ** (length - allowed_length)
    return out


def typical_row(logits: np.ndarray, mass: float) -> tuple[np.ndarray, float]:
    """Locally typical sampling in float64 (`mass >= 1`: off).

    Returns the processed logits and the row's margin: how close the decision came to
    flipping (the distance of the cumulative mass at the boundary from `mass`, and the
    score gap at the boundary). Callers redraw inputs whose margin is tiny, where float32
    and float64 may disagree.
    """
    x = np.asarray(logits, np.float64)
    out = x.copy()
    if mass >= 1 or np.all(np.isneginf(x)):
        return out, math.inf
    finite = x[np.isfinite(x)]
    top = finite.max()
    z = math.log(sum(math.exp(v - top) for v in finite)) + top
    logp = [v - z if math.isfinite(v) else -math.inf for v in x]
    probs = [math.exp(lp) for lp in logp]
    entropy = -sum(p * lp for p, lp in zip(probs, logp, strict=True) if p > 0)
    scores = [abs(-lp - entropy) for lp in logp]
    order = sorted(range(len(x)), key=lambda t: scores[t])
    total, last = 0.0, len(x) - 1
    margin = math.inf
    for rank, t in enumerate(order):
        total += probs[t]
        margin = min(margin, abs(total - mass))
        if total >= mass:
            last = rank
            break
    threshold = scores[order[last]]
    if last + 1 < len(order):
        margin = min(margin, scores[order[last + 1]] - threshold)
    for t in range(len(x)):
        if scores[t] > threshold and t != order[0]:
            out[t] = -math.inf
    return out, margin
