"""Host-side checks of the sampling knobs' values, and the power-of-two widths of per-row lists.

`SamplingParams.create` (`logitloop.decoding.sampling.params`) validates every value with
these before anything reaches the device: each raises `ValueError` naming the argument, the
row and the allowed range. Lists whose length varies are padded to a width rounded up to a
power of two (`bucket_width`, at least `MIN_LIST_WIDTH`), so that a new list length
recompiles only when it outgrows its bucket; `Widths` holds a batch's widths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MIN_LIST_WIDTH = 4
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**32 - 1
# The repetition guard's bounds: the periods the loop follows (static: the width of its
# per-row runs, `loop.repetition`), and the repeats (so that every need fits an int32).
MAX_GUARD_PERIOD = 32
MAX_GUARD_REPEATS = 65536
_MAX_INT32 = 2**31 - 1


def bucket_width(n: int, minimum: int = MIN_LIST_WIDTH) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def row_name(name: str, row: int, batch_size: int) -> str:
    """How messages name row `row` of argument `name`: `top_p[2]`, or `top_p` alone when the
    batch has one row (its caller names that row its own way: "prompts.jsonl line 4: ...",
    "requests[3]: ...")."""
    return name if batch_size == 1 else f"{name}[{row}]"


_F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, 1.17549e-38
_F32_MAX = float(np.finfo(np.float32).max)  # 3.40282e+38
_MIN_TEMPERATURE = _F32_TINY  # the smallest T whose 1 / T is finite


def _per_row(name: str, value: Any, batch_size: int) -> list[Any]:
    """Broadcast a scalar knob to the batch or check a per-row list's length."""
    if isinstance(value, (str, bytes, Mapping)) or (
        not isinstance(value, (Sequence, np.ndarray)) and np.ndim(value) == 0
    ):
        return [value] * batch_size
    if hasattr(value, "shape") and len(value.shape) > 1:  # nothing flattened silently
        raise ValueError(
            f"{name} is an array of shape {tuple(value.shape)}: pass a scalar or one value per "
            f"row (shape ({batch_size},))"
        )
    values = list(value)
    if len(values) != batch_size:
        raise ValueError(
            f"{name} has {len(values)} entries but batch_size is {batch_size}: "
            f"pass a scalar or one value per row"
        )
    return values


def _check_range(
    name: str,
    values: Sequence[Any],
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    integer: bool = False,
    normal: bool = True,
    where: str | None = None,
) -> np.ndarray:
    """Validate every row against [lo, hi] (open ends as flagged); NaN always fails.

    A float knob (`integer=False`) is stored as float32, so an unbounded end is the float32
    maximum, and (unless `normal=False`, for a caller with its own lower bound) a nonzero
    value must be a normal float32 (magnitude at least 1.17549e-38): nothing overflows to
    inf or rounds to 0 or a denormal on its way to the device.
    Integer ranges print exactly. `where` names the value in messages instead of
    `row_name(name, row, len(values))`.
    """
    if not integer and hi == math.inf:
        hi, hi_open = _F32_MAX, False
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    allowed = f"{left}{_fmt_bound(lo, integer)}, {_fmt_bound(hi, integer)}{right}"
    out = []
    for row, v in enumerate(values):
        label = row_name(name, row, len(values)) if where is None else where
        if isinstance(v, (bool, np.bool_, str, bytes)) or v is None:
            raise ValueError(f"{label} = {v!r} is not a number; allowed range {allowed}")
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{label} = {v!r} is not a number; allowed range {allowed}") from None
        if integer and (not math.isfinite(f) or f != int(f)):
            raise ValueError(f"{label} = {v!r} is not an integer; allowed range {allowed}")
        ok = not math.isnan(f)
        ok = ok and (f > lo if lo_open else f >= lo)
        ok = ok and (f < hi if hi_open else f <= hi)
        if not ok:
            raise ValueError(f"{label} = {v!r} is outside the allowed range {allowed}")
        if not integer and normal and f != 0 and abs(f) < _F32_TINY:
            raise ValueError(
                f"{label} = {v!r} is outside the allowed range {allowed}: as float32 it "
                f"would be denormal or 0 (a nonzero value needs magnitude >= {_F32_TINY:.6g})"
            )
        out.append(int(f) if integer else f)
    return np.asarray(out)


def _fmt_bound(x: float, integer: bool) -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return str(int(x)) if integer else f"{x:g}"


def is_token_id(x: Any) -> bool:
    """An int (not a bool, not a float even when whole): nothing is coerced into an id."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) or (isinstance(x, np.ndarray) and x.ndim == 1)


def _is_id_list(value: Any) -> bool:
    """True for a flat list of token ids (applies to every row)."""
    return _is_list(value) and all(is_token_id(x) for x in value)


def _not_an_id(name: str, x: Any) -> ValueError:
    return ValueError(f"{name} holds {x!r}, which is not a token id (an int)")


def _id_lists(name: str, value: Any, batch_size: int) -> list[list[int]]:
    """None, one id or one list of ids for all rows, or one list (or id, or None) per row."""
    if value is None:
        return [[] for _ in range(batch_size)]
    if is_token_id(value):
        return [[int(value)] for _ in range(batch_size)]
    if not _is_list(value):
        raise ValueError(
            f"{name} must be a list of token ids or one list (or None) per row, got {value!r}"
        )
    value = list(value)
    if not any(x is None or _is_list(x) for x in value):  # one flat list for every row
        for x in value:
            if not is_token_id(x):
                raise _not_an_id(name, x)
        return [[int(x) for x in value] for _ in range(batch_size)]
    if len(value) != batch_size:
        raise ValueError(f"{name} has {len(value)} per-row lists but batch_size is {batch_size}")
    rows = []
    for row, ids in enumerate(value):
        if ids is None:
            rows.append([])
        elif is_token_id(ids):
            rows.append([int(ids)])
        elif _is_list(ids):
            for x in ids:
                if not is_token_id(x):
                    raise _not_an_id(row_name(name, row, batch_size), x)
            rows.append([int(x) for x in ids])
        else:
            raise ValueError(
                f"{row_name(name, row, batch_size)} must be a list of token ids (or None), "
                f"got {ids!r}"
            )
    return rows


def _check_ids(name: str, rows: Sequence[Sequence[int]], vocab_size: int | None) -> None:
    hi = _MAX_INT32 if vocab_size is None else vocab_size - 1
    for row, ids in enumerate(rows):
        for tok in ids:
            if tok < 0 or tok > hi:
                raise ValueError(
                    f"{row_name(name, row, len(rows))} holds token id {tok}, outside the "
                    f"vocabulary range [0, {hi}]"
                )


def _pad_ids(rows: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    width = bucket_width(max((len(r) for r in rows), default=0)) if width is None else width
    out = np.full((len(rows), width), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _bias_rows(value: Any, batch_size: int) -> list[dict[int, float]]:
    if value is None:
        return [{} for _ in range(batch_size)]
    if isinstance(value, Mapping):
        return [dict(value) for _ in range(batch_size)]
    value = list(value)
    if len(value) != batch_size:
        raise ValueError(
            f"logit_bias has {len(value)} per-row dicts but batch_size is {batch_size}"
        )
    rows = []
    for row, d in enumerate(value):
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            raise ValueError(
                f"{row_name('logit_bias', row, batch_size)} must be a dict of token id -> bias, "
                f"got {d!r}"
            )
        rows.append(dict(d))
    return rows


def check_text(name: str, text: str) -> None:
    """Raise ValueError unless `text` can be encoded as UTF-8 (no lone surrogates: what
    Python makes of bytes that are not UTF-8 in argv, or of a JSON "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = (
            f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8,"
            if 0xDC80 <= code <= 0xDCFF
            else f"the lone surrogate U+{code:04X}, which is not a character,"
        )
        raise ValueError(
            f"{name} is not valid text: it holds {what} at character {e.start}"
        ) from None


def _stop_strings(value: Any, batch_size: int) -> tuple[tuple[str, ...], ...]:
    if value is None:
        return tuple(() for _ in range(batch_size))
    if isinstance(value, str):
        value = [value]
    if not _is_list(value):
        raise ValueError(
            f"stop must be a string, a list of strings or one list per row, got {value!r}"
        )
    value = list(value)
    if not any(r is None or _is_list(r) for r in value):  # one list for every row
        for s in value:
            if not isinstance(s, str):
                raise ValueError(f"stop holds {s!r}; stop strings must be non-empty str")
        rows = [value] * batch_size
    else:
        if len(value) != batch_size:
            raise ValueError(f"stop has {len(value)} per-row lists but batch_size is {batch_size}")
        rows = []
        for row, r in enumerate(value):
            if r is not None and not isinstance(r, str) and not _is_list(r):
                raise ValueError(
                    f"{row_name('stop', row, batch_size)} holds {r!r}; stop strings must be "
                    "non-empty str"
                )
            rows.append([] if r is None else ([r] if isinstance(r, str) else list(r)))
    out = []
    for row, strings in enumerate(rows):
        for s in strings:
            if not isinstance(s, str) or s == "":
                raise ValueError(
                    f"{row_name('stop', row, batch_size)} holds {s!r}; stop strings must be "
                    "non-empty str"
                )
            check_text(f"{row_name('stop', row, batch_size)} {s!r}", s)
        out.append(tuple(strings))
    return tuple(out)


def _stop_sequences(value: Any, batch_size: int, vocab_size: int | None) -> np.ndarray:
    """Per-row lists of token-id sequences -> [B, Q, L] int32, right-aligned, -1 padded."""
    if value is None:
        rows: list[list[list[int]]] = [[] for _ in range(batch_size)]
    else:
        if not _is_list(value):
            raise ValueError(
                f"stop_sequences must be a list of token-id lists (or one such list per row), "
                f"got {value!r}"
            )
        value = list(value)
        if all(_is_list(s) and len(s) > 0 and not any(_is_list(t) for t in s) for s in value):
            for seq in value:  # one list of sequences for every row
                for t in seq:
                    if not is_token_id(t):
                        raise _not_an_id("stop_sequences", t)
            rows = [[[int(t) for t in s] for s in value] for _ in range(batch_size)]
        else:
            if len(value) != batch_size:
                raise ValueError(
                    f"stop_sequences has {len(value)} per-row lists but batch_size is {batch_size}"
                )
            rows = []
            for row, r in enumerate(value):
                at = row_name("stop_sequences", row, batch_size)
                if r is not None and not _is_list(r):
                    raise ValueError(f"{at} must be a list of token-id lists, got {r!r}")
                for seq in r if r is not None else []:
                    if not _is_list(seq):
                        raise ValueError(
                            f"{at} holds {seq!r}; each stop sequence is a list of token ids"
                        )
                    for t in seq:
                        if not is_token_id(t):
                            raise _not_an_id(at, t)
                rows.append([[int(t) for t in seq] for seq in (r if r is not None else [])])
    for row, seqs in enumerate(rows):
        if any(len(s) == 0 for s in seqs):
            raise ValueError(
                f"{row_name('stop_sequences', row, batch_size)} holds an empty sequence"
            )
    # Every id in [0, vocab_size) (or [0, 2**31 - 1]): negative ids are not ids either.
    _check_ids("stop_sequences", [[t for s in seqs for t in s] for seqs in rows], vocab_size)
    n_seq = bucket_width(max((len(r) for r in rows), default=0), minimum=1)
    seq_len = bucket_width(max((len(s) for r in rows for s in r), default=0), minimum=1)
    out = np.full((batch_size, n_seq, seq_len), -1, np.int32)
    for i, seqs in enumerate(rows):
        for j, s in enumerate(seqs):
            out[i, j, seq_len - len(s) :] = s
    return out


def _repetition_guard(value: Any, batch_size: int) -> tuple[list[int], list[int]]:
    """`repetition_guard`: None, one `(max_period, min_repeats)` pair, or one pair (or None)
    per row -> per-row periods (0 = off) and repeats."""
    name = "repetition_guard"
    if value is None:
        return [0] * batch_size, [0] * batch_size

    def is_pair(x: Any) -> bool:
        return _is_list(x) and len(x) == 2 and not any(_is_list(v) or v is None for v in x)

    if is_pair(value):
        rows = [value] * batch_size
    elif _is_list(value) and all(v is None or is_pair(v) for v in value):
        rows = list(value)
        if len(rows) != batch_size:
            raise ValueError(
                f"{name} has {len(rows)} per-row pairs but batch_size is {batch_size}: pass "
                "one (max_period, min_repeats) pair, or one pair (or None) per row"
            )
    else:
        raise ValueError(
            f"{name} must be a (max_period, min_repeats) pair or one pair (or None) per row, "
            f"got {value!r}"
        )
    periods, repeats = [], []
    for row, pair in enumerate(rows):
        if pair is None:
            periods.append(0)
            repeats.append(0)
            continue
        at = row_name(name, row, batch_size)
        where = f"{at} max_period"
        period = _check_range(name, [pair[0]], 1, MAX_GUARD_PERIOD, integer=True, where=where)
        where = f"{at} min_repeats"
        times = _check_range(name, [pair[1]], 2, MAX_GUARD_REPEATS, integer=True, where=where)
        period, times = int(period[0]), int(times[0])
        periods.append(period)
        repeats.append(times)
    return periods, repeats


def child_seed(seed: int, child: int) -> int:
    """Seed of sample `child` of a prompt: child 0 keeps the seed, others mix it (splitmix)."""
    if child == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + child * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class Widths:
    """The shapes of a batch's per-row lists, each a power of two as `create` buckets them.

    Params of several requests stack into one batch once widened to the same widths
    (`SamplingParams.widen`, `concat`); a long-lived batch (`generate_many`) keeps the union
    of what it has seen, so a request whose lists fit compiles nothing.
    """

    bias: int = MIN_LIST_WIDTH  # logit_bias entries per row
    banned: int = MIN_LIST_WIDTH
    allowed: int = MIN_LIST_WIDTH
    stop_ids: int = MIN_LIST_WIDTH
    sequences: int = 1  # stop sequences per row
    sequence_len: int = 1  # longest stop sequence
    stop_strings: int = 0  # stop strings per row; 0 = no stop-string tables at all
    stop_len: int = 16  # longest stop string, in bytes
    top_logprobs: int = 0  # the widest row's logprobs (exact: 0 to MAX_TOP_LOGPROBS)

    def union(self, other: Widths) -> Widths:
        return Widths(
            *(max(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self))
        )
