"""`ll.check_model`: does a model follow the attention contract (`logitloop.models.kv`)?

A model that decodes well in one pass can still be wrong in the cached passes `generate`
runs: it rotates by the column index instead of `positions`, it masks on its own, it
treats `kv=None` and a `kv` differently. `check_model` runs the model on random tokens
three ways and compares the logits of every real column:

- (a) its own full forward, `kv=None` (plain causal attention over the call's columns:
  the reference; `ModelRunner.full_forward`);
- (b) the library's contiguous cache: one prefill call of left-padded prompts (row 0
  unpadded, the others padded by -1 positions), then decode steps of one token a row;
- (c) the same calls over a paged pool whose pages interleave across rows.

Each comparison names its likely cause (`Finding`): the unpadded row already differs
from (a) (the model treats a kv and kv=None differently, or masks itself); a left-padded
row or a decode step differs while the unpadded prompt matches (positions ignored); (c)
differs from (b) (paged differs from contiguous). A logit that is NaN, or infinite on one
side only, is a finding of its own (`NON_FINITE`): the tolerance scales with the largest
finite logit, so a masked entry (-inf on both sides) neither fails nor hides the others'
differences. Errors the contract raises when a pass is traced (logits of the wrong shape,
a kv not from `ll.attention`, a layer written twice or never, heads or dtype not those of
the `KVSpec`) come back as findings with their message, which names the layer and the
mismatch.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.loop import pool as pool_lib
from logitloop.decoding.loop.runner import OWN_CACHE_REFUSAL, model_info

__all__ = ["CheckReport", "Finding", "check_model", "tolerances"]

# Kinds of finding: the contract refused the model (or it failed) when a pass was traced;
# the unpadded prompt in one call differs from kv=None; a left-padded row or a decode step
# differs while that prompt matches; the paged pool differs from the contiguous cache.
REFUSED, KV_NONE, POSITIONS, PAGED = "refused", "kv=None", "positions", "paged"
# A logit that is NaN on either side, or infinite on one side only (or +inf on one and -inf
# on the other): no tolerance covers it, whatever the finite logits do.
NON_FINITE = "non-finite"

_CAUSES = {
    KV_NONE: (
        "the model computes otherwise with a kv than with kv=None: it masks or mixes "
        "columns itself (ll.attention already masks causally), takes another path when kv "
        "is None, or reads the kv other than through ll.attention"
    ),
    "padded": (
        "positions ignored: a left-padded row (positions -1, then 0..n-1) differs while the "
        "unpadded row matches; the model likely embeds or rotates by the column index "
        "(jnp.arange(T)) instead of `positions`, or lets padding columns reach real ones"
    ),
    "decode": (
        "positions ignored: a decode step (one column at position n) differs while the "
        "whole prompt in one call matches; the model likely rotates (RoPE) or embeds by "
        "the column index (jnp.arange(T)) instead of `positions`"
    ),
    "after": "follows from the unpadded prompt's difference above",
    PAGED: (
        "the same calls over a paged pool give other logits than over the contiguous "
        "cache: the model reads or writes the cache other than through ll.attention, or "
        "depends on its layout (if it only calls ll.attention, a logitloop bug: report it)"
    ),
    NON_FINITE: (
        "the logits hold NaN (an overflow, a division by zero, a softmax over no columns, "
        "NaN weights), or one side gives an infinite logit where the other gives another "
        "value; a masked vocabulary entry must be -inf in every pass"
    ),
}


def tolerances(dtype: Any) -> tuple[float, float]:
    """The default `(atol, rtol)` for a model whose cache has this dtype: a logit agrees
    when `|got - want| <= atol + rtol * max|want|`, the max over its row's finite logits (a
    logit's rounding error scales with the row's largest logits, not with its own); an
    infinite logit agrees only with the same infinity, and NaN with nothing.
    float32 and wider: 1e-4 and 1e-3 (the cached passes sum in another order than the full
    forward: the shipped model differs by under 1e-5 of its largest logit); 16-bit floats:
    1e-2 and 5e-2 (bfloat16 keeps 8 bits of mantissa and each layer rounds: the shipped
    model's decode steps differ by under 1e-2, a 2-layer random Llama with 25x weights by
    2e-2). A model that ignores positions is off by tenths of its largest logit or more."""
    if jnp.dtype(dtype).itemsize >= 4:
        return 1e-4, 1e-3
    return 1e-2, 5e-2


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing wrong: `kind` (`REFUSED`, `KV_NONE`, `POSITIONS`, `PAGED`, `NON_FINITE`),
    `what` (the comparison, with the largest difference's row and position, or the pass
    that raised), `max_abs_diff` (None for an error; over the logits finite on both sides)
    and the likely `cause` (for an error, its message, which names the layer and the
    mismatch)."""

    kind: str
    what: str
    max_abs_diff: float | None
    cause: str

    def __str__(self) -> str:
        diff = "" if self.max_abs_diff is None else f" (max |diff| {self.max_abs_diff:.3g})"
        label = "the error" if self.kind == REFUSED else "likely cause"
        cause = textwrap.fill(f"{label}: {self.cause}", 96, initial_indent="    ",
                              subsequent_indent="      ", break_long_words=False)  # fmt: skip
        return f"[{self.kind}] {self.what}{diff}\n{cause}"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One comparison that ran: its `name`, the largest difference `max_abs_diff` between
    logits finite on both sides, where (`row`, `position`), whether every finite logit was
    within tolerance (`ok`), and `non_finite`: how many logits were NaN on either side or
    infinite on one side only (or of opposite signs), and where the first one is
    (`non_finite_at`, `(row, position)`; None when none)."""

    name: str
    max_abs_diff: float
    row: int
    position: int
    ok: bool
    non_finite: int = 0
    non_finite_at: tuple[int, int] | None = None

    @property
    def passed(self) -> bool:
        return self.ok and not self.non_finite


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """What `check_model` found: `ok` when nothing (`findings` empty); `comparisons` the
    comparisons that ran; the settings they ran with. `str(report)` reads as a summary."""

    findings: tuple[Finding, ...]
    comparisons: tuple[Comparison, ...]
    dtype: str
    atol: float
    rtol: float
    batch: int
    prompt_len: int
    steps: int
    page_size: int

    @property
    def ok(self) -> bool:
        return not self.findings

    def __str__(self) -> str:
        head = "OK" if self.ok else f"{len(self.findings)} problem(s)"
        lines = [
            f"check_model: {head} ({self.dtype} cache, atol={self.atol:g}, rtol={self.rtol:g}; "
            f"{self.batch} rows, prompts of {self.prompt_len}, {self.steps} decode steps, "
            f"pages of {self.page_size})"
        ]
        for c in self.comparisons:
            mark = "ok  " if c.passed else "FAIL"
            lines.append(
                f"  {mark} {c.name:<44} max |diff| {c.max_abs_diff:.3g}"
                + ("" if c.ok else f" (row {c.row}, position {c.position})")
                + (f"; {c.non_finite} logit(s) NaN or inf on one side" if c.non_finite else "")
            )
        lines += [f"  {f}".replace("\n", "\n  ") for f in self.findings]
        return "\n".join(lines)


@functools.partial(jax.jit, static_argnums=0)
def _full_forward(runner, weights, tokens, positions):
    return runner.full_forward(weights, tokens, positions)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _cached_pass(runner, weights, tokens, positions, cache, columns: bool):
    if columns:
        return tuple(runner.forward_columns(weights, tokens, positions, cache)[:2])
    return tuple(runner.forward(weights, tokens, positions, cache)[:2])


class _Refused(Exception):
    """A pass raised when traced or run: the finding to report."""

    def __init__(self, finding: Finding):
        self.finding = finding


def _run(what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported, with its message
        raise _Refused(Finding(REFUSED, f"{what} raised {type(e).__name__}", None, str(e))) from e


def check_model(
    model: Any,
    *,
    batch: int = 2,
    prompt_len: int = 6,
    steps: int = 3,
    page_size: int = 4,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
) -> CheckReport:
    """Check that `model` gives the same logits through the library's caches as its own
    full forward (`kv=None`), and say what differs and why (module docstring).

    model: an `ll.FunctionModel` with a `kv_spec`, an `ll.from_nnx` / `ll.from_linen`
    model, or a logitloop family. Random tokens (`seed`) in `batch` rows: row b's prompt
    has `prompt_len - b * prompt_len // batch` real tokens, left-padded to `prompt_len`
    (row 0 unpadded), then `steps` decode steps; the paged pool has pages of `page_size`
    tokens. Every real column's logits must agree: `|got - want| <= atol + rtol *
    max|want|` (the max over the row's finite logits; an infinite logit must be the same
    infinity on both sides, NaN never agrees: kind "non-finite"), by default from the
    cache's dtype (`tolerances`: atol 1e-4 and rtol 1e-3 for float32, 1e-2 and 5e-2 for
    bfloat16 and float16; given, each a finite float >= 0). A sliding window
    (`KVSpec.window`) is exercised only where `prompt_len + steps` exceeds it: pass a
    longer `prompt_len` to check a window (the model must give `ll.attention` the same
    `window=` with `kv=None`, where no `KVSpec` says it).

    Cheap: each pass is jitted once per shape (five programs; a model that returns only
    the last column's logits, `[B, V]`, needs one full forward per prefix length). A pass
    the contract refuses when traced is reported (kind "refused", its message) and the
    passes after it are not run. Returns a `CheckReport` (`report.ok`, `print(report)`).
    """
    info = model_info(model)
    runner, weights = info.runner, info.weights
    if runner.kv_spec is None:
        raise ValueError(OWN_CACHE_REFUSAL.format(what="ll.check_model"))
    for name, value, low in (
        ("batch", batch, 1), ("prompt_len", prompt_len, 2), ("steps", steps, 1),
        ("page_size", page_size, 1), ("seed", seed, 0),
    ):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"check_model: {name} must be an int >= {low}, got {value!r}")
    length = prompt_len + steps
    if length > info.max_length:
        raise ValueError(
            f"check_model: prompt_len + steps = {length} exceeds the model's max_length "
            f"{info.max_length}"
        )
    dtype = runner.kv_spec.dtype
    default_atol, default_rtol = tolerances(dtype)
    atol = default_atol if atol is None else _tolerance("atol", atol)
    rtol = default_rtol if rtol is None else _tolerance("rtol", rtol)
    settings = dict(
        dtype=str(dtype), atol=atol, rtol=rtol, batch=int(batch), prompt_len=int(prompt_len),
        steps=int(steps), page_size=int(page_size),
    )  # fmt: skip
    findings: list[Finding] = []
    comparisons: list[Comparison] = []
    try:
        _check(runner, weights, info.vocab_size, settings, seed, findings, comparisons)
    except _Refused as e:
        findings.append(e.finding)
    return CheckReport(tuple(findings), tuple(comparisons), **settings)


def _tolerance(name: str, value: Any) -> float:
    """`atol` or `rtol` as a finite float >= 0 (a NaN or infinite one passes everything)."""
    try:
        number = None if isinstance(value, (bool, str)) else float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not np.isfinite(number) or number < 0:
        raise ValueError(f"check_model: {name} must be None or a finite float >= 0, got {value!r}")
    return number


def _check(runner, weights, vocab, settings, seed, findings, comparisons) -> None:
    """The passes and comparisons of `check_model`, appending to `findings` and
    `comparisons`; raises `_Refused` at the first pass that raised."""
    b, p, steps = settings["batch"], settings["prompt_len"], settings["steps"]
    length = p + steps
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, vocab, (b, length), dtype=np.int32)  # each row's real tokens
    pads = np.array([r * p // b for r in range(b)])
    real = p - pads
    columns_at = np.arange(p)[None, :] - pads[:, None]  # [B, P]: positions, < 0 padding
    prompt_positions = np.where(columns_at >= 0, columns_at, -1).astype(np.int32)
    taken = np.take_along_axis(seq, np.maximum(columns_at, 0), 1)
    prompt = np.where(columns_at >= 0, taken, 0).astype(np.int32)  # padding: token 0
    put = jax.device_put
    full_positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length))

    shape = _run("the full forward (kv=None)", _full_forward.eval_shape, runner, weights,
                 put(seq), put(full_positions))  # fmt: skip
    columns = len(shape.shape) == 3

    def passes(cache, name):
        """Prefill then decode steps over `cache`: logits `[B, L, V]` (NaN where none)."""
        out = np.full((b, length, vocab), np.nan, np.float32)
        logits, cache = _run(
            f"the prefill over the {name}", _cached_pass, runner, weights, put(prompt),
            put(prompt_positions), cache, columns,
        )  # fmt: skip
        logits = np.asarray(logits, np.float32)
        for r in range(b):
            if columns:
                out[r, : real[r]] = logits[r, pads[r] :]
            else:
                out[r, real[r] - 1] = logits[r]
        for s in range(steps):
            positions = (real + s).astype(np.int32)[:, None]
            tokens = np.take_along_axis(seq, positions, 1)
            logits, cache = _run(
                f"decode step {s} over the {name}", _cached_pass, runner, weights,
                put(tokens), put(positions), cache, columns,
            )  # fmt: skip
            logits = np.asarray(logits, np.float32).reshape(b, vocab)
            out[np.arange(b), positions[:, 0]] = logits
        return out

    contiguous = passes(runner.init_cache(weights, b, length), "contiguous cache")
    prefilled = np.zeros((b, length), bool)  # the positions the prefill gave logits for
    decoded = np.zeros((b, length), bool)  # and the decode steps
    for r in range(b):
        prefilled[r, : real[r]] = columns
        prefilled[r, real[r] - 1] = True
        decoded[r, real[r] : real[r] + steps] = True

    full = np.full((b, length, vocab), np.nan, np.float32)
    if columns:
        full[:] = _run("the full forward (kv=None)", _full_forward, runner, weights,
                       put(seq), put(full_positions))  # fmt: skip
    else:  # the last column only: one full forward per prefix length
        for t in sorted({int(x) + 1 for x in np.nonzero(prefilled | decoded)[1]}):
            full[:, t - 1] = _run(
                "the full forward (kv=None)", _full_forward, runner, weights,
                put(np.ascontiguousarray(seq[:, :t])), put(full_positions[:, :t]),
            )  # fmt: skip

    def compare(name, got, want, where) -> Comparison | None:
        if not where.any():
            return None
        c = compare_logits(name, got, want, where, settings["atol"], settings["rtol"])
        comparisons.append(c)
        if c.non_finite:
            row, position = c.non_finite_at
            what = f"{c.name}: row {row}, position {position}: {c.non_finite} logit(s) NaN or inf"
            findings.append(Finding(NON_FINITE, what, None, _CAUSES[NON_FINITE]))
        return c

    unpadded = prefilled & (pads == 0)[:, None]
    first = compare("unpadded prompt in one call vs kv=None", contiguous, full, unpadded)
    kv_none_ok = first is None or first.passed
    checks = (
        (first, KV_NONE),
        (compare("left-padded prompt vs kv=None", contiguous, full, prefilled & ~unpadded),
         "padded"),
        (compare("decode steps vs kv=None", contiguous, full, decoded), "decode"),
    )  # fmt: skip
    for c, cause in checks:
        if c is not None and not c.ok:
            kind = KV_NONE if cause == KV_NONE else POSITIONS
            if cause != KV_NONE and not kv_none_ok:
                kind, cause = KV_NONE, "after"
            what = f"{c.name}: row {c.row}, position {c.position} differs"
            findings.append(Finding(kind, what, c.max_abs_diff, _CAUSES[cause]))

    page_size = settings["page_size"]
    entries = -(-length // page_size)
    # Page numbers interleaved across rows and reversed: row r's e-th page is far from
    # its (e-1)-th, as in a pool shared by rows that grew in turn.
    tables = b * entries - 1 - (np.arange(entries)[None, :] * b + np.arange(b)[:, None])
    pool = runner.init_pool(weights, b * entries, page_size)
    paged = passes(pool_lib.attach(pool, put(tables.astype(np.int32))), "paged pool")
    c = compare("paged pool vs contiguous cache", paged, contiguous, prefilled | decoded)
    if not c.ok:
        what = f"{c.name}: row {c.row}, position {c.position} differs"
        findings.append(Finding(PAGED, what, c.max_abs_diff, _CAUSES[PAGED]))


def compare_logits(
    name: str,
    got: np.ndarray,  # [B, L, V]
    want: np.ndarray,  # [B, L, V]
    where: np.ndarray,  # [B, L] bool: the positions compared
    atol: float,
    rtol: float,
) -> Comparison:
    """`got` against `want` at `where`: the finite logits within `atol + rtol * max|want|`
    (the max over the position's finite `want`: an infinite or NaN logit must not widen
    the tolerance of the others), and the logits that are NaN on either side or infinite
    on one side only counted apart (`Comparison.non_finite`): a masked entry, -inf on both
    sides, agrees."""
    where = where[..., None]
    finite = np.isfinite(got) & np.isfinite(want)
    same_inf = np.isinf(want) & (got == want)
    odd = where & ~finite & ~same_inf  # NaN anywhere, or inf facing another value
    diff = np.abs(np.where(finite, got, 0.0) - np.where(finite, want, 0.0))
    scale = np.max(np.where(np.isfinite(want), np.abs(want), 0.0), axis=-1, keepdims=True)
    bad = (diff > atol + rtol * scale) & where
    masked = np.where(where, diff, -np.inf)
    row, position, _ = np.unravel_index(np.argmax(masked), masked.shape)
    at = None
    if odd.any():
        r, p, _ = np.argwhere(odd)[0]
        at = (int(r), int(p))
    return Comparison(
        name, float(masked.max()), int(row), int(position), not bad.any(), int(odd.sum()), at
    )
