"""`score` in row batches, and the continuation pass that `ll.token_logprobs` shares.

`score` packs its pairs into flat token streams (`packed`); on a mesh (`mesh=`) it runs
them in row batches instead, the layout below. Index bookkeeping, for one row with prompt
[a, b, c] and continuation [x, y, z], the prompt bucketed to P = 4 columns and the
continuation to C = 4:

    prompt pass      [pad, a, b, c]   positions [-1, 0, 1, 2]   -> logits of column 3: x
    continuation     [x, y, pad]      positions [3, 4, -1]      -> logits of x: y, of y: z

so the continuation pass feeds C - 1 columns (its last token is never fed) and the logits
of continuation token j are the prompt pass's last column (j = 0) or column j - 1 of the
continuation pass. The two calls are those of `generate`: prompt tokens go through a
prompt pass and continuation tokens through a pass over generated tokens (a speculative
verification's `forward_columns`), so with `deterministic=True` every logit, and so every
log-probability, is bit for bit the one `generate` computed for the tokens it drew. The LM
head runs on the continuation's positions only.

Pairs with the same prompt ids (a multiple-choice question's choices) share its prompt
pass: a batch runs the prompt pass over its K distinct prompts only, and each row takes
its prompt's last-column logits and KV cache by gathering row `row_prompt[b]` of them
(`shared_prompts`), as `generate(n=...)` prefills each prompt once for its n rows. A
row's values are those of its pair scored alone; with `deterministic=True` bit for bit
(the prompt pass's rows do not depend on the other rows).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine import reuse
from logitloop.decoding.engine.host import (
    MIN_PROMPT_BUCKET,
    bucket,
    constraint_tables,
    prompt_batch,
    row_bucket,
)
from logitloop.decoding.engine.token_scores import NEG_INF, processed_logprobs, token_scores
from logitloop.decoding.loop.decode_loop import forward_prompt
from logitloop.decoding.loop.layout import ONE_DEVICE, Layout
from logitloop.decoding.loop.runner import ModelInfo, ModelRunner, runner_jit
from logitloop.decoding.sampling import constraints
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.models.kv import Rows

MIN_CONTINUATION_BUCKET = 4


def score_rows(rows: int, batch_size: int, layout: Layout) -> int:
    """The rows a call of `rows` pairs, all in one batch, runs: `host.row_bucket` (a power
    of two or three halves of one, a multiple of the layout's data shards), at most
    `batch_size` (already such a multiple). A call of several batches runs every batch at
    `batch_size` rows (its last one too: one program for all of them). Padding rows repeat
    the batch's first pair; a row's values do not depend on them (with `deterministic=True`
    bit for bit)."""
    return min(batch_size, row_bucket(rows, layout.row_multiple))


def shared_prompts(
    ids: list[list[int]], row_multiple: int = 1, width: int | None = None
) -> tuple[list[list[int]], np.ndarray] | None:
    """The distinct prompts of a batch's rows and each row's index among them
    (`row_prompt`, [B] i32), or None where sharing saves no row. The distinct prompts are
    padded (with the first) to a power of two, a multiple of `row_multiple` (a mesh's
    data shards) and at most the batch's rows, so few programs compile; or to `width`."""
    index: dict[tuple[int, ...], int] = {}
    row_prompt = np.asarray([index.setdefault(tuple(p), len(index)) for p in ids], np.int32)
    distinct = [list(p) for p in index]
    if width is None:
        width = -(-bucket(len(distinct), 1) // row_multiple) * row_multiple
    if width >= len(ids) or width < len(distinct):
        return None
    return distinct + [distinct[0]] * (width - len(distinct)), row_prompt


def score_row_batch(
    info: ModelInfo,
    ids: list[list[int]],
    conts: list[list[int]],
    params: SamplingParams | None,
    num_top: int,
    layout: Layout,
    share_prompts: bool = False,
    *,
    rows: int | None = None,
    key: Any = None,
    adapters: tuple[Any, np.ndarray] | None = None,
    capture: tuple[int, ...] = (),
) -> dict[str, np.ndarray]:
    """One batch on device; host arrays [B, C] (and [B, C, K] for the alternatives), B the
    batch's `rows` (default its pairs; padded with its first pair). `key`: the programs'
    key in `reuse` (None: the buckets the batch needs, no reuse). `adapters`: the
    `ll.Adapters` and each pair's slot. `capture`: the layers to record (`Rows.capture`),
    then `out["captured"]` [B, C, len(capture), E]."""
    shape = need = _score_shape(ids, conts, rows or len(ids), share_prompts, layout)
    if key is not None:
        key = (*key, need.distinct > 0)  # a shared prompt pass is a program of its own
        shape = reuse.fit(key, need)
        if shape.distinct >= shape.rows > 1:  # sharing must save rows
            shape = need
        reuse.ran(key, shape)
    pad = shape.rows - len(ids)
    ids, conts = ids + [ids[0]] * pad, conts + [conts[0]] * pad
    if params is not None and pad:
        params = params.take(list(range(len(ids) - pad)) + [0] * pad)
    width, plen = shape.cont, shape.prompt
    # The cache holds the prompt bucket and at least MIN_PROMPT_BUCKET more slots, as
    # `generate`'s does (a multiple of the deterministic attention's slot chunk).
    buffer = bucket(width, MIN_PROMPT_BUCKET, fine=True)
    batch = prompt_batch(ids, buffer, plen)  # the rows' lengths and histories
    prompt, positions, row_prompt = batch.prompt, batch.positions, None
    if shape.distinct:
        distinct, row_prompt = shared_prompts(ids, layout.row_multiple, shape.distinct)
        pass_batch = prompt_batch(distinct, buffer, plen)
        prompt, positions = pass_batch.prompt, pass_batch.positions
    cont = np.zeros((len(ids), width), np.int32)
    for r, c in enumerate(conts):
        cont[r, : len(c)] = c
    lengths = np.asarray([len(c) for c in conts], np.int32)
    automata = fsm = None
    if params is not None:
        automata, fsm = constraint_tables(info, params)
        params = params.device_only()
    row_state = None
    if adapters is not None:
        table, slots = adapters
        slots = np.concatenate([slots, np.full(pad, -1, np.int32)])
        row_state = Rows(jax.device_put(np.asarray(slots, np.int32)), table.table)
    if capture:
        row_state = (row_state or Rows()).replace(capture=capture)
    row_state = layout.place_rows(row_state)
    out = score_batch(
        info.runner, info.weights, prompt, positions, batch.lengths, batch.history,
        cont, lengths, params, automata, fsm, row_prompt, row_state, num_top=num_top,
        layout=layout,
    )  # fmt: skip
    return jax.device_get(layout.host_view(out))


@dataclasses.dataclass(frozen=True)
class ScoreShape:
    """The buckets a scoring batch runs at: `rows` pairs, `cont` continuation columns (1:
    the prompt pass alone), `prompt` prompt columns, and `distinct` prompt-pass rows when
    the batch's pairs share prompts (0: every row its own pass, `shared_prompts`)."""

    rows: int
    cont: int
    prompt: int
    distinct: int


def _score_shape(
    ids: list[list[int]], conts: list[list[int]], rows: int, share: bool, layout: Layout
) -> ScoreShape:
    """The buckets a batch of these pairs needs, padded to `rows` rows."""
    # One-token continuations (the letter of an MMLU answer, a one-token choice) need the
    # prompt pass alone: no continuation pass then.
    longest = max(len(c) for c in conts)
    cont = 1 if longest == 1 else bucket(longest, MIN_CONTINUATION_BUCKET, fine=True)
    plen = bucket(max(len(p) for p in ids), MIN_PROMPT_BUCKET, fine=True)
    padded = ids + [ids[0]] * (rows - len(ids))
    shared = shared_prompts(padded, layout.row_multiple) if share else None
    return ScoreShape(rows, cont, plen, 0 if shared is None else len(shared[0]))


def continuation_logits(
    runner: ModelRunner,
    weights: Any,
    prompt: jax.Array,  # [B, P] i32, left-padded
    positions: jax.Array,  # [B, P] i32, -1 on padding
    prompt_len: jax.Array,  # [B] i32
    cont: jax.Array,  # [B, C] i32, right-padded
    cont_len: jax.Array,  # [B] i32
    cache_len: int,
    layout: Layout = ONE_DEVICE,
    routing: tuple[jax.Array, jax.Array] | None = None,
    row_prompt: jax.Array | None = None,  # [B] i32: row b continues prompt row_prompt[b]
    rows: Rows | None = None,  # the rows' adapters (not with row_prompt)
) -> jax.Array:
    """[B, C, V] f32: the logits each continuation token was predicted from (module
    docstring): the prompt pass's last column, then the continuation's own columns.
    `routing` (a mixture of experts): the experts to replay, `[B, P, L, k]` for the
    prompt's columns and `[B, C, L, k]` for the continuation's (-1: the router's own).
    With `row_prompt`, `prompt` and `positions` (and the prompt's routing) hold the K
    distinct prompts ([K, P]): the prompt pass runs once per prompt, and each row gathers
    its prompt's last-column logits and cache (every cache leaf is per row, [K, ...]).
    Where `rows` captures layers (`Rows.capture`; only the static field, with
    `row_prompt`) it returns `(logits, states)`, states [B, C, len(capture), E] float32
    at the same columns as the logits."""
    width = cont.shape[1]
    prompt_routing, cont_routing = (None, None) if routing is None else routing
    first, cache, *extras = forward_prompt(
        runner, weights, prompt, positions, cache_len, layout, routing=prompt_routing, rows=rows
    )
    capturing = rows is not None and bool(rows.capture)
    states = extras[-1][:, -1:].astype(jnp.float32) if capturing else None  # [B, 1, L, E]
    if row_prompt is not None:
        first = first[row_prompt]
        states = None if states is None else states[row_prompt]
    if width == 1:
        logits = first[:, None].astype(jnp.float32)
        return (logits, states) if capturing else logits
    if row_prompt is not None:
        cache = layout.cache(jax.tree.map(lambda x: x[row_prompt], cache), cont.shape[0])
    col = jnp.arange(width - 1)[None, :]  # [1, C - 1]
    pos = jnp.where(col < cont_len[:, None] - 1, prompt_len[:, None] + col, -1)
    routed = {} if cont_routing is None else {"routing": cont_routing[:, :-1]}
    rest, _, *more = runner.forward_columns(
        weights, cont[:, :-1], pos.astype(jnp.int32), cache, rows=rows, **routed
    )
    logits = jnp.concatenate([first[:, None], rest], axis=1).astype(jnp.float32)
    if not capturing:
        return logits
    return logits, jnp.concatenate([states, more[-1].astype(jnp.float32)], axis=1)


@functools.partial(runner_jit, static_argnames=("runner", "num_top", "layout"))
def score_batch(
    runner: ModelRunner,
    weights: Any,
    prompt: jax.Array,  # [B, P] i32, left-padded
    positions: jax.Array,  # [B, P] i32, -1 on padding
    prompt_len: jax.Array,  # [B] i32
    history: History,  # [B, P + N], N >= C
    cont: jax.Array,  # [B, C] i32, right-padded with 0
    cont_len: jax.Array,  # [B] i32
    params: SamplingParams | None,
    automata: constraints.Automata | None,
    fsm: jax.Array | None,  # [B] i32
    row_prompt: jax.Array | None = None,  # [B] i32; then prompt, positions are [K, P]
    rows: Rows | None = None,  # the rows' adapters (`ll.Rows`), not with row_prompt
    *,
    num_top: int,
    layout: Layout = ONE_DEVICE,
) -> dict[str, jax.Array]:
    """One batch's scores: raw [B, C], is_argmax [B, C], processed [B, C] (with params),
    top_ids / top_values [B, C, num_top]. With `row_prompt` the prompt pass runs over the
    batch's distinct prompts (`continuation_logits`)."""
    batch, width = cont.shape
    prompt, positions = layout.rows((prompt, positions), prompt.shape[0])
    prompt_len, history, cont, cont_len, params, fsm, row_prompt = layout.rows(
        (prompt_len, history, cont, cont_len, params, fsm, row_prompt), batch
    )
    logits = continuation_logits(
        runner, weights, prompt, positions, prompt_len, cont, cont_len,
        history.tokens.shape[1], layout, row_prompt=row_prompt, rows=rows,
    )  # fmt: skip
    states = None
    if rows is not None and rows.capture:
        logits, states = logits
    valid = jnp.arange(width)[None, :] < cont_len[:, None]  # [B, C]
    out = token_scores(logits, cont, valid, num_top)
    if states is not None:
        out["captured"] = states
    if params is not None:
        lp, _ = processed_logprobs(logits, cont, valid, params, history, automata, fsm)
        out["processed"] = jnp.where(valid, lp, NEG_INF)
    return out
