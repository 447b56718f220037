"""Inside the decode: capture the residual stream, steer it, read it through the LM head.

The host side of the `ll.residual` seam (`logitloop.models.kv`): what a user asks for
(`Capture`, `Steer`), checked against the model before anything runs, turned into the
per-row data the passes carry (`ll.Rows.steer`, `ll.Rows.capture`), and the captured
states cut back into rows (`row_states`). docs/inside.md is the guide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from logitloop.decoding.engine import memory_check
from logitloop.decoding.engine.host import check_count
from logitloop.models import kv as kv_contract
from logitloop.models.steering import EVERYWHERE, Steering

# Bytes a capture buffer may take on a device that does not report its memory (a CPU).
DEFAULT_CAPTURE_BYTES = 2 * 2**30
TOKENS = ("both", "prompt", "generated")


@dataclasses.dataclass(frozen=True)
class Capture:
    """What `generate(..., capture=)` records: the residual stream after decoder layers
    `layers` (each in [0, num_layers)), and with `final_norm=True` the final norm's output
    after them, as float32.

    `result.captured[i]` is then row i's `[T, C, E]` array, C = `len(layers) +
    final_norm`: by default T = the row's generated tokens, entry j the states at the
    token whose logits drew `token_ids[i][j]` (the prompt's last for j = 0, then each
    generated token fed back), so a logit lens of entry j is the lens's guess at token j;
    with `prompt=True` the prompt's tokens before those, T = prompt length - 1 + tokens
    generated (every token of prompt + completion but the last, in order, as transformers'
    `output_hidden_states` gives them for that sequence). `max_bytes`: the largest buffer
    the loop may hold (default: the device's free memory, or 2 GiB where the device does
    not report it); a larger one is refused before anything runs, with its size.
    """

    layers: Sequence[int] = ()
    prompt: bool = False
    final_norm: bool = False
    max_bytes: int | None = None

    def __post_init__(self):
        layers = (self.layers,) if isinstance(self.layers, (int, np.integer)) else self.layers
        object.__setattr__(self, "layers", tuple(layers))

    def model_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers as `ll.residual` numbers them (`num_layers`: the final norm's), each
        checked by name."""
        for k, layer in enumerate(self.layers):
            _check_layer(layer, num_layers, f"capture.layers[{k}]")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"capture.layers has a layer twice: {list(self.layers)}")
        if not self.layers and not self.final_norm:
            raise ValueError("capture= names no layer: give layers=(...) or final_norm=True")
        return (*map(int, self.layers), *((num_layers,) if self.final_norm else ()))


@dataclasses.dataclass(frozen=True)
class Steer:
    """A steering vector (activation addition): `scale * vector` added to the residual
    stream after decoder layer `layer`, at the row's `tokens`: "prompt", "generated" (the
    tokens fed back, from the first generated one on) or "both". `vector`: `[E]`, a float
    array of the model's width. `generate(..., steer=)` takes one for every prompt, or a
    list with one entry per prompt: None, a `Steer`, or a list of them (several layers)."""

    vector: Any
    layer: int
    scale: float = 1.0
    tokens: str = "both"


def _check_layer(layer: Any, num_layers: int | None, name: str) -> None:
    """`layer` a decoder layer of a model of `num_layers` (None: not known yet, before the
    model loads: any layer from 0)."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise ValueError(f"{name} must be an int (a decoder layer), got {layer!r}")
    if num_layers is None:
        if layer < 0:
            raise ValueError(f"{name} = {layer} is out of range: a decoder layer is 0 or more")
        return
    if not 0 <= layer < num_layers:
        raise ValueError(
            f"{name} = {layer} is out of range: the model's layers are [0, {num_layers})"
        )


def _checked_steer(steer: Any, name: str, num_layers: int | None, width: int | None) -> tuple:
    """One `Steer` as (vector [E] float32, layer, scale, start, stop), checked by name."""
    if not isinstance(steer, Steer):
        raise ValueError(f"{name} must be an ll.Steer (or None), got {type(steer).__name__}")
    _check_layer(steer.layer, num_layers, f"{name}.layer")
    vector = np.asarray(jax.device_get(steer.vector))
    if not np.issubdtype(vector.dtype, np.floating):
        raise ValueError(f"{name}.vector must be a float array, got dtype {vector.dtype}")
    want = "[E]" if width is None else f"[{width}] (the model's hidden size)"
    if vector.ndim != 1 or (width is not None and vector.shape[0] != width):
        raise ValueError(f"{name}.vector must have shape {want}, got {vector.shape}")
    if not np.all(np.isfinite(vector)):
        raise ValueError(f"{name}.vector holds NaN or inf")
    try:
        scale = float(steer.scale)
    except (TypeError, ValueError):
        scale = float("nan")
    if isinstance(steer.scale, bool) or not np.isfinite(scale):
        raise ValueError(f"{name}.scale must be a finite float, got {steer.scale!r}")
    if steer.tokens not in TOKENS:
        raise ValueError(f"{name}.tokens must be one of {TOKENS}, got {steer.tokens!r}")
    return vector.astype(np.float32), int(steer.layer), scale, steer.tokens


def steering(
    steer: Any, prompts: Sequence[Sequence[int]], n: int, batch_size: int, num_layers: int,
    width: int | None,
) -> Steering | None:  # fmt: skip
    """The rows' `Steering` for `steer=` (a `Steer` for every prompt, or one entry per
    prompt: None, a `Steer` or a list of them), each prompt's for its `n` rows, none for
    the dummy rows up to `batch_size`; K, the vectors per row, a power of two. None when
    no row steers. `width`: the model's residual width (None: a user's model, whose pass
    checks it when traced). Everything is checked by name before anything runs."""
    arrays = steering_arrays(steer, prompts, n, batch_size, num_layers, width)
    return None if arrays is None else Steering(*map(jax.device_put, arrays))


def steering_arrays(
    steer: Any, prompts: Sequence[Sequence[int]], n: int, batch_size: int, num_layers: int,
    width: int | None,
) -> tuple[np.ndarray, ...] | None:  # fmt: skip
    """`steering`'s host arrays (`steer_arrays`), or None when no row steers."""
    if steer is None:
        return None
    count = len(prompts)
    if isinstance(steer, Steer):
        per_prompt = [[steer]] * count
    elif isinstance(steer, (list, tuple)) and len(steer) == count:
        per_prompt = [[] if s is None else list(s) if isinstance(s, (list, tuple)) else [s]
                      for s in steer]  # fmt: skip
    else:
        raise ValueError(
            f"steer= must be an ll.Steer for every prompt or a list of {count} entries (one "
            f"per prompt: None, an ll.Steer or a list of them), got {type(steer).__name__}"
            + (f" of {len(steer)}" if isinstance(steer, (list, tuple)) else "")
        )
    rows = [
        row_steers(entries, "steer" if isinstance(steer, Steer) else f"steer[{i}]",
                   len(prompts[i]), num_layers, width)
        for i, entries in enumerate(per_prompt)
    ]  # fmt: skip
    if not any(rows):
        return None
    widths = {v.shape[0] for row in rows for v, *_ in row}
    if len(widths) > 1:
        raise ValueError(f"steer= vectors have different widths {sorted(widths)}")
    arrays = steer_arrays(batch_size, vector_bucket(max(len(r) for r in rows)), widths.pop())
    for p, row in enumerate(rows):
        put_steers(arrays, slice(p * n, p * n + n), row)
    return arrays


def row_steers(
    entries: Sequence[Any], name: str, prompt_len: int, num_layers: int | None, width: int | None
) -> list[tuple]:
    """One row's `Steer`s (`entries`, named `name`, `name[k]` when several) as checked
    `(vector [E] float32, layer, scale, start, stop)` tuples for a prompt of `prompt_len`
    tokens (`_span`)."""
    checked = [
        _checked_steer(s, name if len(entries) == 1 else f"{name}[{k}]", num_layers, width)
        for k, s in enumerate(entries)
    ]
    return [(*c[:3], *_span(c[3], prompt_len)) for c in checked]


def vector_bucket(count: int) -> int:
    """K, the vectors a row holds, for a row of `count` (a power of two, at least 1)."""
    return 1 << (max(count, 1) - 1).bit_length()


def steer_arrays(rows: int, k: int, e: int) -> tuple[np.ndarray, ...]:
    """Host arrays of a `Steering` of `rows` rows steering nothing: (vectors [rows, k, e],
    layers, scales, start, stop [rows, k])."""
    return (
        np.zeros((rows, k, e), np.float32), np.full((rows, k), -1, np.int32),
        np.zeros((rows, k), np.float32), np.zeros((rows, k), np.int32),
        np.zeros((rows, k), np.int32),
    )  # fmt: skip


def put_steers(arrays: tuple[np.ndarray, ...], at: Any, steers: Sequence[tuple]) -> None:
    """Write one row's checked steers (`row_steers`) into rows `at` of `steer_arrays`,
    clearing the vectors after them."""
    vectors, layers, scales, start, stop = arrays
    vectors[at], layers[at], scales[at], start[at], stop[at] = 0.0, -1, 0.0, 0, 0
    for j, (vector, layer, scale, lo, hi) in enumerate(steers):
        vectors[at, j], layers[at, j], scales[at, j] = vector, layer, scale
        start[at, j], stop[at, j] = lo, hi


def _span(tokens: str, prompt_len: int) -> tuple[int, int]:
    """The positions [start, stop) that `tokens` steers in a row with `prompt_len` tokens."""
    return {"both": (0, EVERYWHERE), "prompt": (0, prompt_len),
            "generated": (prompt_len, EVERYWHERE)}[tokens]  # fmt: skip


def check_capture_size(
    capture: Capture, layers: int, rows: int, width: int, buffer: int, e: int | None
) -> None:
    """Refuse a capture buffer larger than `capture.max_bytes` (default the device's free
    memory, or `DEFAULT_CAPTURE_BYTES`), saying its size: `rows` x (`width` prompt columns
    with `capture.prompt`, + `buffer` generated) x `layers` x `e` float32 values (None: a
    user's model, which does not say its width: unchecked). A `max_bytes` that is not a
    positive int is refused by name (a NaN would let every size through)."""
    if capture.max_bytes is not None:
        check_count("capture.max_bytes", capture.max_bytes, 1)
    if e is None:
        return
    tokens = buffer + (width if capture.prompt else 0)
    need = rows * tokens * layers * e * 4
    limit = capture.max_bytes
    if limit is None:
        memory = memory_check.device_memory()
        limit = DEFAULT_CAPTURE_BYTES if memory is None else memory[0]
    if need > limit:
        mib = 2**20
        raise ValueError(
            f"capture=: the buffer would take {need / mib:.1f} MiB ({rows} rows x {tokens} "
            f"tokens x {layers} layers x {e} floats x 4 bytes = {need} bytes), over the "
            f"{limit} bytes allowed (capture.max_bytes, default the device's free memory): capture "
            "fewer layers, leave prompt=False, or run fewer rows or tokens at once"
        )


def row_states(
    capture: Any, ids: list[list[int]], num_tokens: list[int], prompt: bool
) -> list[np.ndarray]:
    """Each row's `[T, C, E]` captured states (`Capture`) from the loop's (prompt [B, P, C,
    E] left-padded or None, generated [B, N, C, E])."""
    prompt_states, generated = jax.device_get(capture)
    out = []
    for r, row in enumerate(ids):
        gen = np.asarray(generated[r, : num_tokens[r]])
        if prompt:
            width = prompt_states.shape[1]
            gen = np.concatenate([prompt_states[r, width - len(row) : width - 1], gen])
        out.append(gen)
    return out


def logit_lens(model: Any, states: Any, *, normed: bool = False) -> jax.Array:
    """The LM head's float32 logits `[..., V]` of captured residual states `[..., E]`
    (`result.captured[i][:, c]`): the final norm, then the head, as the model's last layer
    is read (nostalgebraist's logit lens). `normed=True`: the states are the final norm's
    output already (`Capture(final_norm=True)`), so only the head applies. A logitloop
    family only (a user's model has no final norm logitloop knows)."""
    if not all(hasattr(model, f) for f in ("output_norm", "head_weight", "output_logits")):
        raise ValueError(
            "ll.logit_lens needs one of logitloop's model families (its final norm and LM "
            f"head); got {type(model).__name__}"
        )
    x = jnp.asarray(states)
    e = model.config.hidden_size
    if x.ndim < 1 or x.shape[-1] != e:
        raise ValueError(f"ll.logit_lens: states must be [..., {e}], got shape {x.shape}")
    x = x.astype(model.dtype)
    if not normed:
        x = model.output_norm(x)
    return model.output_logits(kv_contract.lm_head(x, model.head_weight()))
