"""Sort-free truncation and draw in plain JAX (the XLA path, and the reference for kernels).

Input is the temperature-scaled logits `x: [B, V]` float32 (masks, bias and penalties already
applied). Every truncation rule keeps an upper set of `x`, so the kept set is
`x >= threshold` for one per-row threshold:

  top-k   t_k = the k-th largest x (ties with it kept)
  top-p   t_p = the largest value v with mass(x >= v, x >= t_k) >= p * mass(x >= t_k)
  min-p   t_m = max(x) + log(min_p)
  kept    x >= max(t_k, t_p, t_m)

Nothing sorts the vocabulary. The thresholds come from the row's `C` largest entries
(`lax.top_k`, C = `num_candidates`), which settle them whenever they fall inside that
candidate set; a row that needs more (top_k > C, or a nucleus wider than C tokens) finds
its threshold by interval halving over the values (`interval_threshold`), run only when
some row needs it (`lax.cond`). The draw is an exponential race
(`noise.py`) whose noise is a function of (row key, token id) only: it runs among the
candidates when the kept set lies inside them and over the whole vocabulary otherwise, and
both pick the same token, as does any other backend or any vocabulary sharding that uses
the same noise. A row's token never depends on the rest of the batch.

The same functions run inside `jax.shard_map` on a mesh (`sharded.py` wraps them): `axes`
names the mesh axis the vocabulary is split over and the axes the rows are split over, and
every reduction across the vocabulary (max, sums, counts, candidate top-k, the race's
argmax) is reduced over the vocabulary axis as well. With `Axes()` (one device) no
collective is traced and the program is the single-device one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from logitloop.ops.sampling import noise

NUM_CANDIDATES = 256
NEG_INF = float("-inf")
F32_MAX = float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class Axes:
    """Where the operands lie on a mesh when an operator runs inside `jax.shard_map`.

    vocab: the mesh axis the vocabulary is split over (each device holds a contiguous slice
    `[s * V_s, (s + 1) * V_s)` of every row it holds), or None when devices hold whole rows;
    rows: the mesh axes the batch is split over. `Axes()` is one device, outside any mesh.
    """

    vocab: str | None = None
    rows: tuple[str, ...] = ()
    in_mesh: bool = False  # inside `shard_map` though neither rows nor vocabulary are split

    @property
    def partitioned(self) -> bool:
        """Traced for a partitioned program: XLA's SPMD partitioner rejects the
        optimization barriers (a check failure in jax 0.10), so they are left out."""
        return self.in_mesh or self.vocab is not None or bool(self.rows)

    def vocab_size(self, x: jax.Array) -> int:
        """The whole vocabulary of `x`'s rows ([B, V_s] on each device)."""
        return x.shape[-1] * (1 if self.vocab is None else jax.lax.axis_size(self.vocab))

    def offset(self, width: int) -> jax.Array | int:
        """Global id of this device's first column, its slice `width` columns wide."""
        if self.vocab is None:
            return 0
        return jax.lax.axis_index(self.vocab).astype(jnp.int32) * width

    def local_ids(self, ids: jax.Array, width: int) -> jax.Array:
        """Global token ids -> columns of this device's slice, -1 (padding) elsewhere."""
        if self.vocab is None:
            return ids
        local = ids - self.offset(width)
        return jnp.where((ids >= 0) & (local >= 0) & (local < width), local, -1)

    def sum(self, x: jax.Array) -> jax.Array:
        """Per-row partial results summed over the vocabulary axis."""
        return x if self.vocab is None else jax.lax.psum(x, self.vocab)

    def max(self, x: jax.Array) -> jax.Array:
        return x if self.vocab is None else jax.lax.pmax(x, self.vocab)

    def min(self, x: jax.Array) -> jax.Array:
        return x if self.vocab is None else jax.lax.pmin(x, self.vocab)

    def any(self, pred: jax.Array) -> jax.Array:
        """`jnp.any` over the whole batch wherever a branch holds collectives: every
        device of the mesh then takes a `lax.cond` the same way."""
        if self.vocab is None:
            return jnp.any(pred)
        return jax.lax.psum(jnp.any(pred).astype(jnp.int32), (*self.rows, self.vocab)) > 0

    def all(self, pred: jax.Array) -> jax.Array:
        return jnp.all(pred) if self.vocab is None else ~self.any(~pred)

    def barrier(self, x):
        """`lax.optimization_barrier` on one device (see `candidates`), else `x`."""
        return x if self.partitioned else jax.lax.optimization_barrier(x)

    def at(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """x[b, ids[b]] for one global id per row ([B]), whichever device holds it."""
        if self.vocab is None:
            return jnp.take_along_axis(x, ids[:, None], axis=1)[:, 0]
        width = x.shape[1]
        local = ids - self.offset(width)
        mine = (local >= 0) & (local < width)
        val = jnp.take_along_axis(x, jnp.clip(local, 0, width - 1)[:, None], axis=1)[:, 0]
        return self.sum(jnp.where(mine, val, 0))  # one device holds it: the sum is exact


SINGLE = Axes()


@struct.dataclass
class Thresholds:
    """Per-row truncation thresholds in the space of the scaled logits (all [B] f32)."""

    row_max: jax.Array  # max(x); -inf when every token is masked
    top_k: jax.Array  # -inf when top-k is off
    top_p: jax.Array  # -inf when top-p is off
    min_p: jax.Array  # -inf when min-p is off

    @property
    def kept(self) -> jax.Array:
        """[B] the combined threshold: a token is kept iff x >= kept."""
        return jnp.maximum(jnp.maximum(self.top_k, self.top_p), self.min_p)


@struct.dataclass
class Draw:
    tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, log-probability under the final distribution
    log_norm: jax.Array  # [B] f32, final prob of any kept token i = exp(x_i - log_norm)


def sortable_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 whose unsigned order is the float order (NaN-free input)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    flipped = jnp.where(i < 0, ~i, i | jnp.int32(-(2**31)))
    return jax.lax.bitcast_convert_type(flipped, jnp.uint32)


def key_to_float(key: jax.Array) -> jax.Array:
    """Inverse of `sortable_key`."""
    i = jax.lax.bitcast_convert_type(key, jnp.int32)
    bits = jnp.where(i < 0, i & jnp.int32(2**31 - 1), ~i)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def inverse_temperature(temperature: jax.Array) -> jax.Array:
    """[B] f32: 1 / T, and 1 where T == 0 (greedy rows stay unscaled)."""
    return 1.0 / jnp.where(temperature > 0, temperature, 1.0)


def scale_logits(logits: jax.Array, temperature: jax.Array | None) -> jax.Array:
    """The scaled logits x: `logits * (1 / T)` per row (T == 0: unchanged), NaN -> -inf.

    logits: [B, N]; temperature: [B] or None (no scaling). A product with the row's float32
    reciprocal, not a division: XLA rewrites a division by a broadcast row value into
    exactly this product, but divides elementwise where nothing is broadcast, and the two
    can differ in the last bit. Written as a product, every place that scales the same
    logit gets the same bits. Scaling by 1 / T > 0 never reorders values, so the C largest
    scaled logits are the C largest logits, scaled: the sampler finds candidates on the
    unscaled logits and scales only what it reads.

    A finite logit whose product overflows float32 (a temperature near 1.2e-38, a logit
    pushed up by an extreme repetition penalty) saturates at +-F32_MAX instead of becoming
    +-inf, so the row keeps a finite maximum and never turns into NaN; tokens saturated
    together tie. Infinite logits (masked tokens) stay infinite.
    """
    if temperature is None:
        return jnp.where(jnp.isnan(logits), NEG_INF, logits)
    x = logits * inverse_temperature(temperature)[:, None]
    x = jnp.where(jnp.isinf(logits), logits, jnp.clip(x, -F32_MAX, F32_MAX))
    return jnp.where(jnp.isnan(x), NEG_INF, x)


def interval_threshold(
    x: jax.Array,  # [B, V] f32, NaN-free
    weight_fn,  # x -> [B, V] non-negative weights (1 for counts, exp(x - max) for mass)
    target: jax.Array,  # [B]
    upper: jax.Array,  # [B], with W(x > upper) < target, so the answer is <= upper
    need: jax.Array,  # [B] bool, rows to solve; the others return -inf
    c: int,
    axes: Axes = SINGLE,
) -> jax.Array:
    """The largest value v among x with W(x >= v) >= target, per row, without sorting.

    W sums `weight_fn(x)` over a set. Keeps an interval (lo, hi] that holds the answer,
    with W(x > lo) >= target > W(x > hi), and halves it in value, two sums per step (the
    mass above the midpoint and the count between it and hi), until at most `c` values lie
    inside; those are then ordered with `lax.top_k` and the answer read off their running
    sum. On peaked or wide rows alike this takes about ten passes instead of the 32 of a
    bisection over the bits of a float. Rows whose W never reaches the target return -inf.
    """
    finite = x > NEG_INF
    lo0 = axes.min(jnp.min(jnp.where(finite, x, jnp.inf), axis=1)) - 1.0
    lo0 = jnp.where(jnp.isfinite(lo0), lo0, 0.0)
    hi0 = upper

    w = weight_fn(x)  # [B, V], computed once: each step then only compares and sums

    # Counts as float32 sums (exact below 2^24 entries; XLA:CPU sums floats faster than ints).
    one = 1.0 if axes.vocab_size(x) < 2**24 else 1

    def stats(mid, hi):  # W(x > mid) and the count in (mid, hi]
        above = x > mid[:, None]
        inside = above & (x <= hi[:, None])
        w_above = jnp.sum(jnp.where(above, w, 0.0), axis=1)
        return axes.sum(w_above), axes.sum(jnp.sum(jnp.where(inside, one, 0), axis=1))

    w_lo, n_in = stats(lo0, hi0)  # W(x > lo0) and the count in (lo0, hi0]
    w_hi = axes.sum(jnp.sum(jnp.where(x > hi0[:, None], w, 0.0), axis=1))
    reachable = w_lo >= target
    active = need & reachable

    def cond(st):
        step, lo, hi, n_in, _ = st
        return (step < 64) & axes.any(active & (n_in > c) & (lo < hi))

    def body(st):
        step, lo, hi, n_in, w_hi = st
        # Halve in value first (few steps on dense rows), then in the float's bit order,
        # which reaches adjacent floats within 32 steps even where values pile up at 0.
        by_key = key_to_float(sortable_key(lo) + ((sortable_key(hi) - sortable_key(lo)) >> 1))
        mid = jnp.where(step < 16, lo + 0.5 * (hi - lo), by_key)
        split = active & (n_in > c) & (mid > lo) & (mid < hi)  # adjacent floats: stop
        w_mid, n_upper = stats(mid, hi)  # two sums per step; the lower half's count follows
        go_up = w_mid >= target  # the answer is above mid
        lo = jnp.where(split & go_up, mid, lo)
        hi = jnp.where(split & ~go_up, mid, hi)
        n_in = jnp.where(
            split,
            jnp.where(go_up, n_upper, n_in - n_upper),
            jnp.where(active & (n_in > c), 0, n_in),
        )
        w_hi = jnp.where(split & ~go_up, w_mid, w_hi)
        return step + 1, lo, hi, n_in, w_hi

    _, lo, hi, _, w_hi = jax.lax.while_loop(cond, body, (0, lo0, hi0, n_in, w_hi))
    inside = (x > lo[:, None]) & (x <= hi[:, None])
    vals, _ = candidates(jnp.where(inside, x, NEG_INF), c, axes)  # the interval's, descending
    cum = w_hi[:, None] + jnp.cumsum(jnp.where(vals > NEG_INF, weight_fn(vals), 0.0), axis=1)
    first = jnp.sum(cum < target[:, None], axis=1)  # index of the first value reaching it
    found = jnp.take_along_axis(vals, jnp.minimum(first, c - 1)[:, None], axis=1)[:, 0]
    # When the interval shrank to one float (more than c ties), its value is the answer.
    answer = jnp.where((first < c) & (found > NEG_INF), found, hi)
    return jnp.where(active, answer, NEG_INF)


def rows_that_need(fn, need: jax.Array, fill, *args, axes: Axes = SINGLE):
    """`fn` on the rows where `need` holds, one row at a time; `fill` elsewhere.

    fn takes a [rows] bool mask of the rows to solve, then each argument with a batch axis
    of one, and returns a pytree of [1, ...] arrays (`fill` has the same structure). The
    fallbacks below cost passes over the whole vocabulary; run batched, one wide row would
    make every row of the batch pay for them. A row's slice of the arguments is taken
    inside the branch, so rows that do not need `fn` cost no copy of their row.

    With the vocabulary split over a mesh axis, `fn` holds collectives, which every device
    must reach alike: it then runs once on the whole batch (rows that do not need it are
    masked by the mask and by the caller), when any row of the batch needs it.
    """
    batch = need.shape[0]

    def no_row():
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (batch, *a.shape[1:])), fill)

    if axes.vocab is not None:
        return jax.lax.cond(axes.any(need), lambda: fn(need, *args), no_row)

    def one(row):
        i, want = row

        def run():
            rows = (jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0) for a in args)
            return fn(jnp.ones((1,), bool), *rows)

        return jax.lax.cond(want, run, lambda: fill)

    def every_row():
        out = jax.lax.map(one, (jnp.arange(batch), need))
        return jax.tree.map(lambda a: a[:, 0], out)

    return jax.lax.cond(jnp.any(need), every_row, no_row)


def first_argmax(scores: jax.Array, axes: Axes = SINGLE) -> jax.Array:
    """`jnp.argmax(scores, axis=1)` for NaN-free scores: the first (global) index of the
    row max, found over every device of the vocabulary axis.

    XLA:CPU runs argmax as a scalar loop over (value, index) pairs; a max and then a min
    over the indices that reach it are two vectorised reductions, several times faster
    over a whole vocabulary. The scores are computed once (the barrier keeps XLA from
    recomputing them inside each reduction).
    """
    scores = axes.barrier(scores)
    width = scores.shape[1]
    best = axes.max(jnp.max(scores, axis=1, keepdims=True))
    index = jnp.arange(width, dtype=jnp.int32)[None, :] + axes.offset(width)
    vocab = axes.vocab_size(scores)
    first = axes.min(jnp.min(jnp.where(scores == best, index, vocab), axis=1))
    return jnp.minimum(first, vocab - 1)  # all-NaN rows cannot occur; stay in range


def logsumexp(log_w: jax.Array, axes: Axes = SINGLE) -> jax.Array:
    """[B, N] -> [B]: `jax.nn.logsumexp` over the row, its max and sum over every device."""
    if axes.vocab is None:
        return jax.nn.logsumexp(log_w, axis=1)
    mx = axes.max(jnp.max(log_w, axis=1))
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    return jnp.log(axes.sum(jnp.sum(jnp.exp(log_w - mx[:, None]), axis=1))) + mx


def thresholds(
    x: jax.Array,  # [B, V] f32: the scaled logits, or the unscaled ones with `temperature`
    top_k: jax.Array,  # [B] i32
    top_p: jax.Array,  # [B] f32
    min_p: jax.Array,  # [B] f32
    cand_x: jax.Array,  # [B, C] f32, the C largest scaled logits per row, descending
    temperature: jax.Array | None = None,  # [B]: x is unscaled, see `scale_logits`
    axes: Axes = SINGLE,
) -> Thresholds:
    """The per-row thresholds of top-k, top-p (over the top-k survivors) and min-p.

    Passes over the whole vocabulary happen only where the candidates cannot settle a
    threshold: the top-p mass when some top-k survivor may lie outside the candidates, and
    the row-by-row interval searches.
    """
    vocab = axes.vocab_size(x)
    c = cand_x.shape[1]
    row_max = cand_x[:, 0]
    last_cand = cand_x[:, -1]
    t_rows = jnp.zeros_like(row_max) if temperature is None else temperature

    # top-k: read off the candidates, or bisect on counts when k exceeds them.
    k_on = (top_k > 0) & (top_k < vocab)
    k_in_cand = k_on & (top_k <= c)
    t_k_cand = jnp.take_along_axis(cand_x, jnp.clip(top_k - 1, 0, c - 1)[:, None], axis=1)[:, 0]
    k_far = k_on & ~k_in_cand
    no_answer = jnp.full((1,), NEG_INF, jnp.float32)
    t_k_far = rows_that_need(
        lambda need, zr, tr, kr, ur: interval_threshold(
            scale_logits(zr, tr), jnp.ones_like, kr, ur, need, c, axes
        ),
        k_far,
        no_answer,
        x,
        t_rows,
        top_k.astype(jnp.float32),
        last_cand,
        axes=axes,
    )
    t_k = jnp.where(k_in_cand, t_k_cand, jnp.where(k_far, t_k_far, NEG_INF))

    # top-p on the distribution renormalised over the top-k survivors.
    p_on = top_p < 1.0
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[:, None]

    def mass(v, t_k=t_k, m=safe_max):  # [B, N] -> top-k survivors' weights, relative to max
        return jnp.where(v >= t_k[:, None], jnp.exp(v - m), 0.0)

    cum = jnp.cumsum(mass(cand_x), axis=1)
    # When every survivor is a candidate (t_k above the last one), their total is the last
    # running sum; otherwise it takes one pass over the vocabulary, for the rows that need it.
    survivors_in_cand = (t_k > last_cand) | (c == vocab)
    whole_row = p_on & ~survivors_in_cand
    every_token = whole_row & (t_k == NEG_INF)  # top-k off: a plain exp-sum, one fused pass
    some_tokens = whole_row & (t_k > NEG_INF)
    inv = jnp.ones_like(row_max) if temperature is None else inverse_temperature(temperature)
    total = jax.lax.cond(
        axes.any(every_token),
        lambda: axes.sum(jnp.sum(jnp.exp(x * inv[:, None] - safe_max), axis=1)),  # NaN: bad rows
        lambda: jnp.zeros_like(row_max),
    )
    total = jnp.where(
        some_tokens,
        jax.lax.cond(
            axes.any(some_tokens),
            lambda: axes.sum(jnp.sum(mass(scale_logits(x, temperature)), axis=1)),
            lambda: jnp.zeros_like(row_max),
        ),
        total,
    )
    target = top_p * jnp.where(whole_row, total, cum[:, -1])  # [B]
    reach = jnp.sum(cum < target[:, None], axis=1)  # index of the first candidate reaching p
    p_in_cand = p_on & (reach < c)
    t_p_cand = jnp.take_along_axis(cand_x, jnp.minimum(reach, c - 1)[:, None], axis=1)[:, 0]
    p_far = p_on & ~p_in_cand
    t_p_far = rows_that_need(
        lambda need, zr, tr, gr, ur, kr, mr: interval_threshold(
            scale_logits(zr, tr), lambda v: mass(v, kr, mr), gr, ur, need, c, axes
        ),
        p_far,
        no_answer,
        x,
        t_rows,
        target,
        last_cand,
        t_k,
        safe_max,
        axes=axes,
    )
    t_p = jnp.where(p_in_cand, t_p_cand, jnp.where(p_far, t_p_far, NEG_INF))

    t_m = jnp.where(min_p > 0, row_max + jnp.log(jnp.where(min_p > 0, min_p, 1.0)), NEG_INF)
    return Thresholds(row_max=row_max, top_k=t_k, top_p=t_p, min_p=t_m)


def race_scores(log_w: jax.Array, key: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Exponential-race scores `log w - log E(key, token)`; -inf weights never win.

    log_w: [B, N] log-weights of the tokens `token_ids` ([B, N] or [1, N]); key: [B, 2].
    The noise depends only on (row key, token id), so any subset of the vocabulary that
    contains the winner picks the same winner.
    """
    e = noise.exponential_from_bits(noise.counter_bits(key[:, None, :], token_ids))
    return jnp.where(log_w > NEG_INF, log_w - jnp.log(e), NEG_INF)


def draw(
    x: jax.Array,  # [B, V] f32: the scaled logits, or the unscaled ones with `temperature`
    thr: Thresholds,
    cand_x: jax.Array,  # [B, C] f32, scaled
    cand_i: jax.Array,  # [B, C] i32
    greedy: jax.Array,  # [B] bool
    key: jax.Array,  # [B, 2] u32
    temperature: jax.Array | None = None,  # [B]: x is unscaled, see `scale_logits`
    axes: Axes = SINGLE,
) -> Draw:
    """Draw one token per row from softmax(x) restricted to x >= thr.kept.

    The race among the candidates and the race over the whole vocabulary use the same
    per-token noise, so they pick the same token whenever the kept set lies inside the
    candidates; the whole-vocabulary race runs only for rows whose kept set does not.
    """
    width = x.shape[1]
    vocab = axes.vocab_size(x)
    c = cand_x.shape[1]
    t = thr.kept[:, None]  # [B, 1]
    m = jnp.where(jnp.isfinite(thr.row_max), thr.row_max, 0.0)[:, None]
    inside = (thr.kept > cand_x[:, -1]) | (c == vocab)  # kept set within the candidates
    t_rows = jnp.zeros_like(thr.kept) if temperature is None else temperature

    cand_log_w = jnp.where(cand_x >= t, cand_x - m, NEG_INF)  # [B, C]
    pick = jnp.argmax(race_scores(cand_log_w, key, cand_i.astype(jnp.uint32)), axis=1)
    cand_tok = jnp.take_along_axis(cand_i, pick[:, None], axis=1)[:, 0]
    cand_norm = jax.nn.logsumexp(cand_log_w, axis=1)  # relative to the row max

    def whole_vocab(need, zr, sr, tr, mr, kr):  # rows of x (one row on a single device)
        del need
        xr = scale_logits(zr, sr)
        log_w = jnp.where(xr >= tr, xr - mr, NEG_INF)  # [rows, V]
        ids = jnp.arange(width, dtype=jnp.uint32)[None, :]
        if axes.vocab is not None:
            ids = ids + axes.offset(width).astype(jnp.uint32)
        tok = first_argmax(race_scores(log_w, kr, ids), axes)
        return tok.astype(jnp.int32), logsumexp(log_w, axes)

    far_tok, far_norm = rows_that_need(
        whole_vocab,
        ~inside & ~greedy,
        (jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.float32)),
        x,
        t_rows,
        t,
        m,
        key,
        axes=axes,
    )
    tokens = jnp.where(greedy, cand_i[:, 0], jnp.where(inside, cand_tok, far_tok))
    rel_norm = jnp.where(inside, cand_norm, far_norm)
    x_tok = scale_logits(axes.at(x, tokens)[:, None], temperature)[:, 0]
    # Subtract the row max before the normaliser: at |x| ~ 1e4, x_tok - (m + lse) cancels.
    logprobs = jnp.where(greedy, 0.0, (x_tok - m[:, 0]) - rel_norm)
    return Draw(tokens=tokens.astype(jnp.int32), logprobs=logprobs, log_norm=rel_norm + m[:, 0])


# `candidates` first keeps the blocks of BLOCK consecutive tokens with the largest maxima,
# then takes the top C among those blocks' tokens: two small top_k calls instead of one over
# the whole row (XLA:CPU's TopK costs about 3.5x a softmax pass at 64 x 128256).
BLOCK = 16


def candidates(x: jax.Array, c: int, axes: Axes = SINGLE) -> tuple[jax.Array, jax.Array]:
    """The C largest entries per row, descending, ties in index order: [B, C] values, ids.

    Exactly `lax.top_k(x, c)`, found in two steps. Each token among the top C lies in a
    block whose maximum ranks among the C largest block maxima (ties to the lower block,
    as top_k orders them): otherwise C blocks ranked above its own would each hold a token
    ranked above it. The tokens of those C blocks, gathered in index order (with the
    leftover tail of the row), go through `lax.top_k` once more.

    The barriers keep XLA:CPU on its TopK routine: without them, slicing the result (as
    the thresholds do) lets XLA rewrite top_k into a full sort of the row.

    With the vocabulary split over a mesh axis, each device takes its own top C (with
    global ids); the gathered lists, ordered by device and so by id, go through one more
    `lax.top_k`: a device holding k of the global top C has them among its own top C, so
    the result is the same C values and ids, in the same order, as on one device.
    """
    if axes.vocab is not None:
        width = x.shape[1]
        vals, idx = jax.lax.top_k(x, min(c, width))
        ids = idx.astype(jnp.int32) + axes.offset(width)
        all_vals = jax.lax.all_gather(vals, axes.vocab, axis=1, tiled=True)  # [B, n * c]
        all_ids = jax.lax.all_gather(ids, axes.vocab, axis=1, tiled=True)
        top_vals, pos = jax.lax.top_k(all_vals, c)
        return top_vals, jnp.take_along_axis(all_ids, pos, axis=1)
    batch, vocab = x.shape
    num_blocks = vocab // BLOCK
    if num_blocks <= 2 * c:  # small vocabularies: one top_k is as cheap
        vals, ids = axes.barrier(jax.lax.top_k(x, c))
        return vals, ids.astype(jnp.int32)
    main = num_blocks * BLOCK
    block_max = jnp.max(x[:, :main].reshape(batch, num_blocks, BLOCK), axis=2)
    block_vals, blocks = axes.barrier(jax.lax.top_k(block_max, c))
    blocks = jnp.sort(blocks.astype(jnp.int32), axis=1)  # index order, for top_k's ties
    ids = (blocks[:, :, None] * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)).reshape(batch, -1)
    if main < vocab:
        tail = jnp.arange(main, vocab, dtype=jnp.int32)
        ids = jnp.concatenate([ids, jnp.broadcast_to(tail, (batch, vocab - main))], axis=1)
    # Only tokens at or above the C-th block maximum can rank among the top C (the C blocks'
    # maxima are C such tokens); masking the rest spares TopK most of its heap updates.
    gathered = jnp.take_along_axis(x, ids, axis=1)
    gathered = jnp.where(gathered >= block_vals[:, -1:], gathered, NEG_INF)
    vals, pos = axes.barrier(jax.lax.top_k(gathered, c))
    return vals, jnp.take_along_axis(ids, pos, axis=1)


def rules_off_on_greedy(top_k, top_p, min_p, greedy):
    """top_k, top_p, min_p with every filter off on greedy rows (their token is the argmax)."""
    return (
        jnp.where(greedy, 0, top_k),
        jnp.where(greedy, 1.0, top_p),
        jnp.where(greedy, 0.0, min_p),
    )


def filter_and_sample(
    x: jax.Array,  # [B, V] f32: the scaled logits, or the unscaled ones with `temperature`
    top_k: jax.Array,  # [B] i32
    top_p: jax.Array,  # [B] f32
    min_p: jax.Array,  # [B] f32
    greedy: jax.Array,  # [B] bool
    key: jax.Array,  # [B, 2] u32
    *,
    num_candidates: int = NUM_CANDIDATES,
    temperature: jax.Array | None = None,
    axes: Axes = SINGLE,
) -> tuple[Draw, Thresholds]:
    """Truncate each row by its own top-k/top-p/min-p and draw one token (XLA path).

    With `temperature` ([B]), `x` holds the unscaled logits and the operator works on
    `scale_logits(x, temperature)` without writing that [B, V] array out: the result is
    the same as passing the scaled logits.

    On greedy rows the filters are not evaluated (their token is the argmax): thresholds
    -inf, log-probability 0, `log_norm` the row maximum. A batch of greedy rows takes only
    the first candidate (one pass for the block maxima, then one block per row) and skips
    the thresholds and races.

    `axes`: inside `shard_map`, where `x` is this device's slice of the vocabulary (see
    `Axes`); the results are the same on every device of the vocabulary axis.
    """
    top_k, top_p, min_p = rules_off_on_greedy(top_k, top_p, min_p, greedy)

    def every_rule():
        c = min(num_candidates, axes.vocab_size(x))
        cand_z, cand_i = candidates(x, c, axes)
        cand_x = scale_logits(cand_z, temperature)
        thr = thresholds(x, top_k, top_p, min_p, cand_x, temperature, axes)
        return draw(x, thr, cand_x, cand_i, greedy, key, temperature, axes), thr

    def argmax_only():
        best_z, best_i = candidates(x, 1, axes)  # the first of the candidates, alone
        row_max = scale_logits(best_z, temperature)[:, 0]
        token = best_i[:, 0]
        off = jnp.full_like(row_max, NEG_INF)
        m = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        drawn = Draw(tokens=token, logprobs=jnp.zeros_like(row_max), log_norm=m)
        return drawn, Thresholds(row_max=row_max, top_k=off, top_p=off, min_p=off)

    return jax.lax.cond(axes.all(greedy), argmax_only, every_rule)
