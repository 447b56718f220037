"""Packed scoring passes: many (prompt, continuation) pairs as one flat stream of tokens.

`score` (and so the lm-eval backend) runs its pairs through passes whose program depends
on token budgets, not on how the tokens split into rows: a pass is the tokens `[1, N]` of
several pairs, each token with its position and its row, and the model sees them as one
row (`ll.Packed` in its `kv` keeps each row's tokens to themselves; docs/scoring.md).

Layout of one pass, for pairs 0 ([a, b, c] + [x, y]) and 1 ([d, e] + [z]):

    stream   a  b  c  d  e  pad .. | x  pad ..        prompt region (Np), then the
    position 0  1  2  0  1  -1     | 3  -1            continuation region (Nc)
    row      0  0  0  1  1  0      | 0  0
    reads    c (-> x), x (-> y), e (-> z)             the columns whose logits score

The dense work (embedding, projections, MLP, LM head on the reads) runs over the stream;
attention gathers each row's tokens by position, `[R, W]` (row 0: a b c x, row 1: d e),
and runs as a prompt pass over a cache does (`ll.Packed`, `kv.packed_attention`): a
row's keys in the slots its own cache would give them.

The prompt region holds every pair's prompt once per distinct prompt (the choices of a
multiple-choice question share their question's tokens: queried in the first choice's
row, its keys in every choice's row), the continuation region every continuation but
its last token (never fed). With `deterministic=True` the prompt region's products run
as a prompt pass's and the continuation region's as a decode step's (`Numerics.
prompt_rows`), and attention sums a row's keys in its own cache's order, so a pair's
bits are those of `generate` for the same tokens, whatever else the pass holds and
wherever it lands.

What compiles: one program per shape `PackShape` (each region's tokens, the attention's
rows and window, the scored columns, each a power of two; with `params` also the
continuation width and history, whose `[rows, width]` layout the processed
log-probabilities scan), padded up by `reuse` to a shape that already ran where one fits.
A pass holds at most `token_budget` tokens and `batch_size` pairs; a pair longer than the
budget runs in a pass of its own, as long as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine.host import MIN_PROMPT_BUCKET, bucket
from logitloop.decoding.loop.runner import ModelRunner
from logitloop.models.kv import Packed, Rows

# The smallest bucket of the prompt region, and of the continuation region and the scored
# columns: a pass of a few short pairs runs at these (8 pairs of 16 prompt and 12
# continuation tokens fit), larger passes at powers of two above them.
MIN_TOKENS = 256
MIN_CONT = 128
# ... and of the attention's rows and window (8 pairs of up to 64 positions).
MIN_ROWS = 8
MIN_WINDOW = 64
# The default `token_budget` of `score`: the tokens (both regions) one pass holds at most.
TOKEN_BUDGET = 2048


@dataclasses.dataclass(frozen=True)
class PackShape:
    """The buckets of one packed pass: `prompt_tokens` and `cont_tokens` in the two
    regions (`cont_tokens` 0: no continuation is fed, every pair's is one token; `reuse`
    may run such a pass at any continuation bucket), `rows` x `window` the attention's
    layout (pairs, and the most positions one holds, a multiple of 16), `reads` scored
    columns, and with `params` the `width` of the pairs' continuations and the `history`
    width their processed log-probabilities read (0 without)."""

    prompt_tokens: int
    cont_tokens: int
    rows: int
    window: int
    reads: int
    width: int = 0
    history: int = 0


@dataclasses.dataclass
class PackedBatch:
    """One pass's host arrays (module docstring) and where each pair's scores land:
    pair i's continuation tokens are scored at read columns `starts[i] ..
    starts[i] + len(conts[i])`."""

    tokens: np.ndarray  # [1, N] i32
    positions: np.ndarray  # [1, N] i32, -1 on padding
    queries: np.ndarray  # [R, W] i32 (`ll.Packed`)
    keys: np.ndarray  # [R, W] i32
    rows: np.ndarray  # [1, N] i32
    read: np.ndarray  # [M] i32
    targets: np.ndarray  # [M] i32
    valid: np.ndarray  # [M] bool
    adapter: np.ndarray | None  # [1, N] i32 (-1: the base), or None
    starts: list[int]
    shape: PackShape


def pass_tokens(prompt: Sequence[int], cont: Sequence[int], shared: bool) -> int:
    """A pair's tokens in a pass: its continuation but the last, and its prompt unless it
    shares an earlier pair's (`shared`)."""
    return (0 if shared else len(prompt)) + len(cont) - 1


def group_key(ids: Sequence[int], slot: int) -> tuple[int, ...]:
    """Pairs whose prompt ids and adapter slot are equal share one prompt in a pass."""
    return (slot, *ids)


def split_passes(
    ids: list[list[int]],
    conts: list[list[int]],
    order: list[int],
    token_budget: int,
    pairs_per_pass: int,
    slots: np.ndarray | None,
    share: bool,
) -> list[list[int]]:
    """The pairs of each pass, in `order`: a pass takes pairs while their tokens (a shared
    prompt counted once) fit `token_budget` and it holds fewer than `pairs_per_pass`; a
    pair alone over the budget gets a pass of its own."""
    passes: list[list[int]] = []
    current: list[int] = []
    used = 0
    seen: set[tuple[int, ...]] = set()
    for r in order:
        key = group_key(ids[r], -1 if slots is None else int(slots[r]))
        cost = pass_tokens(ids[r], conts[r], share and key in seen)
        if current and (used + cost > token_budget or len(current) >= pairs_per_pass):
            passes.append(current)
            current, used, seen = [], 0, set()
            cost = pass_tokens(ids[r], conts[r], False)
        current.append(r)
        seen.add(key)
        used += cost
    if current:
        passes.append(current)
    return passes


def pack(
    ids: list[list[int]],
    conts: list[list[int]],
    *,
    share: bool = True,
    slots: np.ndarray | None = None,
    with_params: bool = False,
    shape: PackShape | None = None,
) -> PackedBatch:
    """The pass of these pairs (module docstring) at `shape`, by default the buckets they
    need (the result's `shape` is always the need). `slots`: each pair's adapter slot
    (-1: the base), or None; `share`: pairs of equal prompt ids and slot share one
    prompt, fed and queried once (in the first such pair's row), its keys in each row."""
    p_tok: list[int] = []
    p_pos: list[int] = []
    p_row: list[int] = []
    p_adapter: list[int] = []
    c_tok: list[int] = []
    c_pos: list[int] = []
    c_row: list[int] = []
    c_adapter: list[int] = []
    # Per row: (in the prompt region, index there) of each position's query and key.
    queries: list[list[tuple[bool, int] | None]] = []
    keys: list[list[tuple[bool, int]]] = []
    reads: list[tuple[bool, int]] = []
    targets: list[int] = []
    starts: list[int] = []
    groups: dict[tuple[int, ...], int] = {}  # key -> the prompt's start
    for row, (prompt, cont) in enumerate(zip(ids, conts, strict=True)):
        slot = -1 if slots is None else int(slots[row])
        key = group_key(prompt, slot)
        length, fed = len(prompt), len(cont) - 1
        owner = not (share and key in groups)
        if owner:
            groups[key] = len(p_tok)
            p_tok += prompt
            p_pos += range(length)
            p_row += [row] * length
            p_adapter += [slot] * length
        start = groups[key]
        c_start = len(c_tok)
        c_tok += cont[:-1]
        c_pos += range(length, length + fed)
        c_row += [row] * fed
        c_adapter += [slot] * fed
        prompt_cols = [(True, start + p) for p in range(length)]
        cont_cols = [(False, c_start + j) for j in range(fed)]
        keys.append(prompt_cols + cont_cols)
        queries.append((prompt_cols if owner else [None] * length) + cont_cols)
        starts.append(len(reads))
        reads += [(True, start + length - 1), *cont_cols]
        targets += cont
    width = history = 0
    if with_params:
        width = bucket(max(len(c) for c in conts), 4)
        history = bucket(max(len(p) for p in ids), MIN_PROMPT_BUCKET, fine=True)
    need = PackShape(
        prompt_tokens=bucket(len(p_tok), MIN_TOKENS),
        cont_tokens=0 if not c_tok else bucket(len(c_tok), MIN_CONT),
        rows=bucket(len(ids), MIN_ROWS),
        window=bucket(max(len(k) for k in keys), MIN_WINDOW),
        reads=bucket(len(reads), MIN_CONT),
        width=width,
        history=history,
    )
    shape = need if shape is None else shape
    n_p, n_c = shape.prompt_tokens, shape.cont_tokens

    def stream(prompt_part: list[int], cont_part: list[int], fill: int) -> np.ndarray:
        out = np.full((1, n_p + n_c), fill, np.int32)
        out[0, : len(prompt_part)] = prompt_part
        out[0, n_p : n_p + len(cont_part)] = cont_part
        return out

    def column(where: tuple[bool, int] | None) -> int:
        return -1 if where is None else where[1] if where[0] else n_p + where[1]

    def by_row(cols: list[list[tuple[bool, int] | None]]) -> np.ndarray:
        out = np.full((shape.rows, shape.window), -1, np.int32)
        for r, row in enumerate(cols):
            out[r, : len(row)] = [column(c) for c in row]
        return out

    read = np.zeros(shape.reads, np.int32)
    read[: len(reads)] = [column(r) for r in reads]
    tgt = np.zeros(shape.reads, np.int32)
    tgt[: len(targets)] = targets
    return PackedBatch(
        tokens=stream(p_tok, c_tok, 0),
        positions=stream(p_pos, c_pos, -1),
        queries=by_row(queries),
        keys=by_row(keys),
        rows=stream(p_row, c_row, 0),
        read=read,
        targets=tgt,
        valid=np.arange(shape.reads) < len(reads),
        adapter=None if slots is None else stream(p_adapter, c_adapter, -1),
        starts=starts,
        shape=need,
    )


def forward(
    runner: ModelRunner,
    weights: Any,
    tokens: jax.Array,  # [1, N] i32
    positions: jax.Array,  # [1, N] i32, -1 on padding
    packed: Packed,
    read: jax.Array,  # [M] i32
    rows: Rows | None,
    *,
    prompt_rows: int,
) -> tuple[jax.Array, ...]:
    """The float32 logits `[M, V]` of a packed pass's read columns (`PackedBatch`), and
    where `rows` captures layers their residual streams there, `[M, C, E]` float32.
    `prompt_rows`: the prompt region's tokens (`PackShape.prompt_tokens`)."""
    if rows is not None and rows.adapter is not None and rows.adapter.ndim == 1:
        raise ValueError("a packed pass takes one adapter slot per token, [1, N]")
    logits, *captured = runner.forward_packed(
        weights, tokens, positions, packed, read, prompt_rows=prompt_rows, rows=rows
    )
    logits = logits[0].astype(jnp.float32)
    if not captured:
        return (logits,)
    return logits, captured[0][0][read].astype(jnp.float32)
