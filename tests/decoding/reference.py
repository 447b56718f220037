"""A plain float64 NumPy reference of the sampler, one row at a time, for the tests.

This is the second copy of the sampling semantics (DESIGN.md, "Sampling semantics"); it is
written for reading, not speed: it sorts, it loops, it works in float64. Per row, in order:

1. `allowed` (everything else -> -inf), `banned` -> -inf, `logit_bias` added (a masked token
   stays -inf whatever its bias).
2. `min_tokens`: while `position < min_tokens`, every stop token id -> -inf.
3. Repetition penalty once per distinct token of prompt + generated text (positive logits
   divided, negative multiplied); then `logit -= frequency * count + presence * (count > 0)`
   over the generated tokens only.
4. Temperature: divide by T. `T == 0` or `top_k == 1` is greedy: one-hot at the argmax of
   the step-3 logits, ties to the lowest token id.
5. top-k: keep every token whose scaled logit is >= the k-th largest (ties kept);
   `top_k <= 0` or `>= V` disables it.
6. top-p over the top-k survivors renormalised: sort descending, keep the shortest prefix
   whose mass reaches p (cumulative >= p) plus every token tied with the last one kept;
   `top_p == 1` disables it.
7. min-p: keep tokens with `prob >= min_p * max_prob`; `min_p == 0` disables it.
8. The final distribution is the softmax of the scaled logits over the kept set.

Knobs are rounded to float32 first, as `SamplingParams` stores them, so both sides use the
same numbers. `margin` (optional) makes the reference refuse inputs whose kept set hinges on
a float32 rounding: a near-tie (closer than `margin` in scaled-logit units, i.e. in log
probability) at the top-k, top-p, min-p or greedy boundary, or a top-p cumulative mass within
`mass_margin` (default: `margin`) of p. Exact ties are never ambiguous (they stay ties in
float32). Tests draw fresh logits until the reference accepts them, so every comparison they
make is clear-cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np


class AmbiguousBoundary(ValueError):
    """The kept set depends on float rounding (see the module docstring)."""


def _f32(x: float) -> float:
    return float(np.float32(x))


def adjusted_logits(
    logits,  # [V]
    *,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    banned: Iterable[int] = (),
    allowed: Iterable[int] | None = None,
    min_tokens: int = 0,
    stop_token_ids: Iterable[int] = (),
    position: int = 0,
    prompt_tokens: Iterable[int] = (),
    generated_tokens: Iterable[int] = (),
) -> np.ndarray:
    """Steps 1-3 in float64: masks, bias, min_tokens, penalties. Returns [V] float64."""
    x = np.array(logits, dtype=np.float64)  # copies; bf16/f16 inputs are upcast exactly
    vocab = x.shape[0]
    masked = np.zeros(vocab, bool)
    if allowed is not None:
        masked[:] = True
        masked[list(allowed)] = False
    masked[list(banned)] = True
    for tok, bias in (logit_bias or {}).items():
        x[tok] += _f32(bias)
    x[masked] = -np.inf

    if position < min_tokens:
        x[list(stop_token_ids)] = -np.inf

    rp = _f32(repetition_penalty)
    for tok in sorted(set(prompt_tokens) | set(generated_tokens)):
        x[tok] = x[tok] / rp if x[tok] > 0 else x[tok] * rp
    counts = np.bincount(np.asarray(list(generated_tokens), np.int64), minlength=vocab)
    x = x - (_f32(frequency_penalty) * counts + _f32(presence_penalty) * (counts > 0))
    return x


def _check_gap(z: np.ndarray, boundary: float, margin: float | None, what: str) -> None:
    """Raise if a finite value other than `boundary` itself lies within `margin` of it."""
    if margin is None or not np.isfinite(boundary):
        return
    near = np.isfinite(z) & (z != boundary) & (np.abs(z - boundary) < margin)
    if near.any():
        raise AmbiguousBoundary(f"{what}: a value lies within {margin} of the boundary")


def reference_distribution(
    logits,  # [V]
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    banned: Iterable[int] = (),
    allowed: Iterable[int] | None = None,
    min_tokens: int = 0,
    stop_token_ids: Iterable[int] = (),
    position: int = 0,
    prompt_tokens: Iterable[int] = (),
    generated_tokens: Iterable[int] = (),
    margin: float | None = None,
    mass_margin: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One row's final distribution: (probs [V] float64, kept [V] bool).

    Every token is masked -> all-zero probs and an empty kept set. Raises `AmbiguousBoundary`
    when `margin` is given and a truncation decision is within `margin` of flipping.
    """
    x = adjusted_logits(
        logits,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias=logit_bias,
        banned=banned,
        allowed=allowed,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        position=position,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated_tokens,
    )
    vocab = x.shape[0]
    finite = np.isfinite(x)
    if not finite.any():
        return np.zeros(vocab), np.zeros(vocab, bool)

    temperature = _f32(temperature)
    if temperature == 0 or top_k == 1:
        best = int(np.argmax(x))  # first occurrence: ties go to the lowest id
        _check_gap(x, x[best], margin, "greedy argmax")
        kept = np.zeros(vocab, bool)
        kept[best] = True
        return kept.astype(np.float64), kept

    z = x / temperature
    kept = finite.copy()

    # 5. top-k: the k-th largest value (counting ties) is the threshold; ties with it stay.
    if 0 < top_k < vocab:
        kth = np.sort(z)[::-1][top_k - 1]
        _check_gap(z, kth, margin, "top-k")
        kept &= z >= kth

    # 6. top-p on the top-k survivors, renormalised.
    top_p = _f32(top_p)
    if top_p < 1.0:
        w = np.where(kept, np.exp(z - z[kept].max()), 0.0)
        p = w / w.sum()
        order = np.argsort(-z[kept], kind="stable")
        sorted_p = p[kept][order]
        sorted_z = z[kept][order]
        cum = np.cumsum(sorted_p)
        last = min(int(np.searchsorted(cum, top_p, side="left")), len(cum) - 1)
        last = int(np.flatnonzero(sorted_z == sorted_z[last])[-1])  # end of the tie group
        if margin is not None:
            mass_margin = margin if mass_margin is None else mass_margin
            first = int(np.flatnonzero(sorted_z == sorted_z[last])[0])
            mass_before = cum[first - 1] if first > 0 else 0.0
            if abs(cum[last] - top_p) < mass_margin or abs(mass_before - top_p) < mass_margin:
                raise AmbiguousBoundary("top-p: cumulative mass within margin of p")
            _check_gap(z[kept], sorted_z[last], margin, "top-p")
        kept &= z >= sorted_z[last]

    # 7. min-p: prob >= min_p * max_prob  <=>  z - max(z) >= log(min_p).
    min_p = _f32(min_p)
    if min_p > 0:
        zmax = z[kept].max()
        if margin is not None:
            d = z - zmax - np.log(min_p)
            near = kept & (z != zmax) & (np.abs(d) < margin)
            if near.any():
                raise AmbiguousBoundary("min-p: a value lies within margin of the boundary")
        kept &= np.exp(z - zmax) >= min_p

    w = np.where(kept, np.exp(z - z[kept].max()), 0.0)
    return w / w.sum(), kept


def reference_raw_logprobs(logits) -> np.ndarray:
    """float64 log_softmax of the model's own logits (upcast), [V]."""
    x = np.asarray(logits, dtype=np.float64)
    m = x[np.isfinite(x)].max()
    return x - m - np.log(np.sum(np.exp(x - m)))


def reference_top_logprobs(logits, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n largest raw log-probabilities (ids, values), ties in lowest-id order."""
    lp = reference_raw_logprobs(logits)
    ids = np.argsort(-lp, kind="stable")[:n]
    return ids, lp[ids]
