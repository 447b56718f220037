"""Building blocks the sampler tests share: one row's settings, random logits, a batch.

`Row` holds every knob of one row in the reference's terms; `batch_inputs` turns a list of
rows into the `SamplingParams`, `History` and positions that `ll.sample` takes, and
`Row.reference` runs the float64 reference on the same row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import logitloop as ll

from .reference import AmbiguousBoundary, reference_distribution

# See reference.py: refuse decisions that a float32 rounding could flip. Scaled logits carry
# float32 rounding ~1e-6 at the magnitudes used; cumulative masses ~1e-7 per 1e3 tokens.
MARGIN = 1e-4
MASS_MARGIN = 5e-6
# Fixed widths for the padded id lists and the history buffer, so that batches with different
# settings share one compiled sampler (a new width would recompile, which costs seconds).
LIST_WIDTH = 128
HISTORY_WIDTH = 32


@dataclasses.dataclass(frozen=True)
class Row:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    banned: tuple = ()
    allowed: tuple | None = None
    min_tokens: int = 0
    stop_token_ids: tuple = ()
    position: int = 0
    prompt_tokens: tuple = ()
    generated_tokens: tuple = ()
    seed: int = 0
    logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def reference(self, logits, margin: float | None = None, mass_margin: float | None = None):
        fields = dataclasses.asdict(self)
        del fields["seed"], fields["logprobs"]
        return reference_distribution(
            np.asarray(logits, np.float64), margin=margin, mass_margin=mass_margin, **fields
        )


def make_logits(
    rng: np.random.Generator,
    vocab: int,
    *,
    scale: float = 3.0,
    offset: float = 0.0,
    grid: float | None = None,
    tie_frac: float = 0.1,
    tie_max: bool | None = None,
    neg_inf_frac: float = 0.03,
) -> np.ndarray:
    """[V] float32 logits: normal * scale + offset, with exact ties and some -inf entries.

    `grid` rounds every value to a multiple of it (many ties, clean gaps between values);
    otherwise a `tie_frac` share of the entries copy another entry, and the maximum is copied
    to a second id when `tie_max` says so (None: half the time), so greedy tie-breaking is
    exercised.
    """
    x = rng.normal(size=vocab) * scale + offset
    if grid is not None:
        x = np.round((x - offset) / grid) * grid + offset
    n_ties = int(tie_frac * vocab)
    x[rng.integers(0, vocab, n_ties)] = x[rng.integers(0, vocab, n_ties)]
    if tie_max is None:
        tie_max = rng.random() < 0.5
    if tie_max:
        x[rng.integers(0, vocab)] = x.max()
    x[rng.random(vocab) < neg_inf_frac] = -np.inf
    if not np.isfinite(x).any():
        x[0] = offset
    return x.astype(np.float32)


def unambiguous_logits(rng, row: Row, vocab: int, dtype=jnp.float32, tries: int = 200, **kw):
    """Fresh logits for `row` whose reference kept set is clear-cut in float32.

    Returns (logits as `dtype` [V], reference probs [V] f64, reference kept [V] bool), the
    reference computed on the exact upcast of the `dtype` values.
    """
    for _ in range(tries):
        x = jnp.asarray(make_logits(rng, vocab, **kw), dtype)
        try:
            probs, kept = row.reference(
                np.asarray(x.astype(jnp.float32)), margin=MARGIN, mass_margin=MASS_MARGIN
            )
        except AmbiguousBoundary:
            continue
        return x, probs, kept
    raise RuntimeError(f"no unambiguous logits for {row} in {tries} tries")


def _per_row_ids(rows: Sequence[Row], name: str):
    return [list(getattr(r, name)) for r in rows]


def batch_inputs(rows: Sequence[Row], vocab: int):
    """(params, positions [B] i32, history) for a batch with one `Row` per row.

    Every row must have generated the same number of tokens (`History.append` adds one per
    row per step).
    """
    params = ll.SamplingParams.create(
        batch_size=len(rows),
        temperature=[r.temperature for r in rows],
        top_k=[r.top_k for r in rows],
        top_p=[r.top_p for r in rows],
        min_p=[r.min_p for r in rows],
        repetition_penalty=[r.repetition_penalty for r in rows],
        presence_penalty=[r.presence_penalty for r in rows],
        frequency_penalty=[r.frequency_penalty for r in rows],
        logit_bias=[dict(r.logit_bias or {}) for r in rows],
        banned_token_ids=_per_row_ids(rows, "banned"),
        allowed_token_ids=[None if r.allowed is None else list(r.allowed) for r in rows],
        seed=[r.seed for r in rows],
        max_tokens=[max(16, r.min_tokens) for r in rows],
        min_tokens=[r.min_tokens for r in rows],
        stop_token_ids=_per_row_ids(rows, "stop_token_ids"),
        logprobs=[r.logprobs for r in rows],
        vocab_size=vocab,
    )
    params = pad_lists(params, LIST_WIDTH)
    positions = jnp.asarray([r.position for r in rows], jnp.int32)
    steps = {len(r.generated_tokens) for r in rows}
    assert len(steps) == 1, "every row must have generated the same number of tokens"
    longest = max(len(r.prompt_tokens) for r in rows)
    hist = ll.History.create(
        [list(r.prompt_tokens) for r in rows], vocab_size=vocab, capacity=HISTORY_WIDTH - longest
    )
    for t in range(steps.pop()):
        hist = hist.append(jnp.asarray([r.generated_tokens[t] for r in rows], jnp.int32))
    return params, positions, hist


def pad_lists(params, width: int):
    """The same params with every -1-padded id list widened to `width` slots."""

    def pad(a, fill):
        assert a.shape[1] <= width, a.shape
        return jnp.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)

    return params.replace(
        bias_ids=pad(params.bias_ids, -1),
        bias_values=pad(params.bias_values, 0.0),
        banned_ids=pad(params.banned_ids, -1),
        allowed_ids=pad(params.allowed_ids, -1),
        stop_token_ids=pad(params.stop_token_ids, -1),
    )


def repeat_rows(params, positions, hist, times: int, seeds):
    """Each row repeated `times` times in a row (row-major), with the given new seeds."""
    idx = np.repeat(np.arange(params.batch_size), times)
    params = params.take(idx).replace(seed=jnp.asarray(np.asarray(seeds, np.uint32)))
    hist = jax.tree.map(lambda a: a[idx], hist)
    return params, positions[idx], hist
