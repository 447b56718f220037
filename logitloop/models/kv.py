"""The attention contract: how any model, logitloop's own families included, reads and
writes the KV cache (contract version 1, `CONTRACT_VERSION`; docs/own_model.md).

A model is a function of its weights, the tokens and their positions, and a `KV`:

    def apply_fn(params, tokens, positions, kv):  # tokens, positions: [B, T] int32
        ...                                         # the model's own embedding, norms, MLP
        out, kv = ll.attention(q, k, v, kv, layer=i, scale=..., softcap=None)
        ...
        return logits, kv                           # logits [B, T, V] (or [B, V]: last column)

- `positions[b, t]` is the absolute position of column t of row b, -1 for padding (prompts
  are left-padded). The model rotates (RoPE) or embeds by these positions, never by the
  column index: a row's first token in a call is at position 0 only in its first call.
- `ll.attention(q, k, v, kv, layer=i)` with q `[B, T, H, D]`, k and v `[B, T, Hkv, D]`
  writes this call's keys and values into layer i of the cache and returns the attention
  output `[B, T, H, D]` over everything row b holds up to each query's position (causal,
  within the layer's window), with the new `kv`. Every layer of the `KVSpec` is called once
  per forward pass; the model returns the `kv` the last call gave back.
- `kv=None` is plain causal attention over the call's own columns (column t sees columns
  <= t, within `window=`): the same model code then trains, and `check_model` compares the
  cached passes with it.

The library owns the cache behind `KV`: contiguous rows, sliding-window rings or a paged
pool shared by rows (prefix pages, `n > 1`, continuous batching), and picks the attention
implementation (`logitloop.ops.attention`) as for its own families. `KV` is a pytree with
no global state: it passes through `jax.jit`, `jax.checkpoint` (remat) and Python loops
over layers. Its static part records which layers were written, so a layer called twice,
a layer never called, or a `kv` returned that did not come from `ll.attention` is refused
when the pass is traced, naming the layer.

Under `deterministic=True` the attention runs in a fixed order; the model's own products
stay its own, and `dense` is the fixed-order `x @ w` a model calls to keep a row's bits
independent of the batch (a plain product otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from logitloop.models import fixed_order, layers
from logitloop.models import lora as lora_lib
from logitloop.models import steering as steering_lib
from logitloop.models.fixed_order import PLAIN, Numerics
from logitloop.ops import attention as ops_attention

__all__ = [
    "CONTRACT_VERSION",
    "KV",
    "KVSpec",
    "Packed",
    "Rows",
    "attention",
    "dense",
    "lm_head",
    "mean",
    "residual",
]

# The version of the contract above; docs/own_model.md says what changed between versions
# (2: `residual` marks the residual stream, for capture and steering).
CONTRACT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """What a model keeps per token and layer: the cache's shape (static, hashable).

    num_layers: the layers that call `attention` (layer = 0 .. num_layers - 1).
    num_kv_heads, head_dim: the shape of a layer's keys and values per token,
      `[Hkv, D]` (grouped-query attention: the queries' H heads a multiple of Hkv).
    dtype: the cache's dtype; the keys and values a model passes must have it.
    window: a sliding window in tokens (a query at position p sees p - window < s <= p),
      one for every layer or a sequence with one per layer (None: global attention).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = jnp.float32
    window: int | None | tuple[int | None, ...] = None

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"KVSpec.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError as e:
            raise ValueError(f"KVSpec.dtype must be a dtype, got {self.dtype!r}") from e
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"KVSpec.dtype must be a floating dtype, got {dtype}")
        object.__setattr__(self, "dtype", dtype)
        if isinstance(self.window, (list, tuple)) or np.ndim(self.window) == 1:
            if len(self.window) != self.num_layers:
                raise ValueError(
                    f"KVSpec.window has {len(self.window)} entries for {self.num_layers} "
                    "layers: give one window (or None) per layer, or one for all"
                )
            window = tuple(
                checked_window(w, f"KVSpec.window[{i}]") for i, w in enumerate(self.window)
            )
        else:  # one for every layer
            window = (checked_window(self.window, "KVSpec.window"),) * self.num_layers
        object.__setattr__(self, "window", window[0] if len(set(window)) == 1 else window)
        object.__setattr__(self, "_windows", window)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """One window (or None) per layer."""
        return self._windows

    def bytes_per_token(self) -> int:
        """Bytes of keys and values one token holds, every layer together."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def init_cache(self, batch_size: int, max_length: int) -> layers.KVCache:
        """The contiguous cache of `batch_size` rows of `max_length` slots (a ring for a
        window shorter than that, `layers.init_layer_caches`)."""
        return layers.init_layer_caches(
            batch_size, max_length, self.windows, self.num_kv_heads, self.head_dim, self.dtype
        )

    def init_pool(self, num_pages: int | Sequence[int], page_size: int) -> layers.KVCache:
        """A paged pool of zeros: per layer `dict(k_pages, v_pages)`, each `[Hkv, pages,
        page_size, D]` (no tables: the loop keeps those, `decoding.loop.pool.Pool`)."""
        no_tables = jnp.zeros((0, 0), jnp.int32)
        caches = layers.init_paged_caches(
            self.num_layers, num_pages, page_size, no_tables, self.num_kv_heads,
            self.head_dim, self.dtype,
        )  # fmt: skip
        return [{"k_pages": x["k_pages"], "v_pages": x["v_pages"]} for x in caches]


@struct.dataclass
class Rows:
    """Per-row state that reaches inside the model as data (`kv.rows`; None in a pass
    that has none, so a model without adapters runs as before): arrays indexed by row
    inside the compiled step, so a batch mixes them and new values compile nothing.

    adapter: `[B]` int32, each row's slot in `lora` (-1: the base weights), or `[B, T]`,
      one slot per token (a packed pass whose tokens `[1, N]` come from many rows gives
      each token its row's slot); read by `dense(..., lora=(layer, target))`; or None.
    lora: the adapter table (`lora.LoraTable`) shared by the pass's rows, or None.
    steer: the rows' steering vectors (`steering.Steering`, `[B, ...]`), which `residual`
      adds after their layers, or None.
    capture: (static) the layers whose residual stream `residual` records in the pass's
      `kv` (`KV.captured`; `KVSpec.num_layers` is the final norm's output), or ().
    """

    adapter: jax.Array | None = None
    lora: lora_lib.LoraTable | None = None
    steer: steering_lib.Steering | None = None
    capture: tuple[int, ...] = struct.field(pytree_node=False, default=())

    def take(self, index: Any) -> Rows:
        """The state of rows `index` (an index array or a slice over the rows): each
        row's adapter slot and steering vectors; the table and `capture` as they are."""
        steer = None if self.steer is None else jax.tree.map(lambda x: x[index], self.steer)
        adapter = None if self.adapter is None else self.adapter[index]
        return self.replace(adapter=adapter, steer=steer)

    def every(self, n: int) -> Rows:
        """Every n-th row's state (the first of each prompt's `n` rows, which share its
        adapter and steering: a prompt prefilled once for its n rows)."""
        return self.take(slice(None, None, n))


@struct.dataclass
class Packed:
    """How the tokens of a packed pass (tokens `[1, N]` from many rows, each with its
    position in `kv.positions`) see each other: each row's tokens laid out by position,
    so attention runs over rows, `[R, W]`, as a prompt pass over a cache does.

    queries: `[R, W]` int32, the stream column of row r's query at position p (-1: none;
      a prompt shared by several rows is queried in its first row only).
    keys: `[R, W]` int32, the stream column whose key and value row r holds at position
      p (-1: none; a shared prompt's columns in each of its rows).
    rows: `[1, N]` int32, each token's row (its query's; 0 for padding, never read).
    """

    queries: jax.Array
    keys: jax.Array
    rows: jax.Array


@jax.tree_util.register_pytree_node_class
class KV:
    """The cache a forward pass threads through its `attention` calls.

    Hands-off for a model: it passes `kv` to `attention` and returns what that gave back.
    The library builds one per pass (`KV(layers, positions, spec, numerics)`) and reads the
    layers back (`finish`). Children: the layers' caches (`layers.KVCache`, contiguous, ring
    or paged) and the positions `[B, T]`; static: the spec, the pass's numerics policy,
    whether the caller reads every column's logits, and the layers written so far.

    `kv.all_columns` (static): False in a prompt pass or a decode step, where only the last
    column's logits are read: a model may then return `[B, V]` and run its LM head on one
    position per row (as logitloop's families do); True in scoring and speculative
    verification, which need `[B, T, V]`.

    `kv.rows` (a child): the pass's per-row state (`Rows`: each row's LoRA adapter,
    steering vectors, the layers to capture), or None; a model reads it through
    `dense(..., lora=...)` and `residual`, never directly.

    `kv.captured` (a child): `{layer: [B, T, E]}`, the residual stream `residual` recorded
    at the layers `rows.capture` asks for; `kv.marked` (static): the layers `residual` was
    called for so far.

    `kv.packed` (a child, or None): a packed pass (`Packed`): tokens `[1, N]` from many
    rows, which `attention` lets see their own row's keys only; its caches are unused.
    `kv.read` (a child, or None): `[M]` int32, the columns whose logits the caller reads
    (an `all_columns` pass): a model may return `[B, M, V]`, those columns only (as
    logitloop's families do), or all of them.
    """

    def __init__(
        self,
        caches: layers.KVCache,
        positions: jax.Array,
        spec: KVSpec,
        numerics: Numerics = PLAIN,
        all_columns: bool = True,
        written: tuple[int, ...] = (),
        rows: Rows | None = None,
        marked: tuple[int, ...] = (),
        captured: dict[int, jax.Array] | None = None,
        packed: Packed | None = None,
        read: jax.Array | None = None,
    ):
        self.caches = list(caches)
        self.packed = packed
        self.read = read
        self.rows = rows
        self.positions = positions
        self.spec = spec
        self.numerics = numerics
        self.all_columns = all_columns
        self.written = written
        self.marked = marked
        self.captured = {} if captured is None else dict(captured)

    def tree_flatten(self):
        aux = (self.spec, self.numerics, self.all_columns, self.written, self.marked)
        children = (self.caches, self.positions, self.rows, self.captured, self.packed, self.read)
        return children, aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        caches, positions, rows, captured, packed, read = children
        spec, numerics, all_columns, written, marked = aux
        return cls(
            caches, positions, spec, numerics, all_columns, written, rows, marked, captured,
            packed, read,
        )  # fmt: skip

    def _replace(self, **changes: Any) -> KV:
        """This KV with some of its fields changed (the others shared)."""
        fields = dict(
            caches=self.caches, positions=self.positions, spec=self.spec,
            numerics=self.numerics, all_columns=self.all_columns, written=self.written,
            rows=self.rows, marked=self.marked, captured=self.captured, packed=self.packed,
            read=self.read,
        )  # fmt: skip
        return KV(**{**fields, **changes})

    def __repr__(self) -> str:
        shape = getattr(self.positions, "shape", None)
        return f"KV(layers={self.spec.num_layers}, positions={shape}, written={list(self.written)})"

    @property
    def deterministic(self) -> bool:
        """Whether this pass runs its reductions in a fixed order (`deterministic=True`)."""
        return self.numerics.fixed

    def finish(self, where: str = "the model") -> layers.KVCache:
        """The layers' caches after a pass, once every layer wrote exactly once."""
        missing = [i for i in range(self.spec.num_layers) if i not in self.written]
        if missing:
            raise ValueError(
                f"{where} returned a kv in which layer(s) {missing} were never written: every "
                f"layer 0..{self.spec.num_layers - 1} of its KVSpec must call ll.attention once "
                "per forward pass, and the model must return the kv the last call gave back"
            )
        return self.caches


def finish(kv: Any, given: KV, where: str) -> layers.KVCache:
    """`kv.finish` for what a model returned as its kv, refusing anything else by name."""
    if not isinstance(kv, KV):
        raise TypeError(
            f"{where} returned {type(kv).__name__} as its kv: return the kv that "
            "ll.attention gave back (logits, kv)"
        )
    if kv.spec != given.spec:
        raise ValueError(f"{where} returned a kv of another KVSpec ({kv.spec}, not {given.spec})")
    if not kv.written:
        raise ValueError(
            f"{where} returned a kv in which no layer was written: the kv it was handed, not "
            "the one ll.attention gave back (or it never called ll.attention); return the kv "
            "of the last ll.attention call, (logits, kv)"
        )
    return kv.finish(where)


def attention(
    q: jax.Array,  # [B, T, H, D]
    k: jax.Array,  # [B, T, Hkv, D]
    v: jax.Array,  # [B, T, Hkv, D]
    kv: KV | None,
    *,
    layer: int,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> tuple[jax.Array, KV | None]:
    """Causal grouped-query attention of layer `layer` through the library's KV cache.

    Writes this call's keys and values (rows and positions from the pass, `kv.positions`)
    into layer `layer`, then returns `(out [B, T, H, D], kv)`: each query attends the keys
    of its own row at positions up to its own (those of earlier calls and of this one),
    within the layer's window. `scale` multiplies the scores (default `D ** -0.5`);
    `softcap` (None or > 0) caps them as `softcap * tanh(s / softcap)` before the mask
    (Gemma 2). `window`: None or a positive int, as in `KVSpec` (others are refused).

    `kv=None`: plain causal attention over this call's columns (column t sees t' <= t,
    within `window`), `(out, None)`: the model's full forward, for training and checks.
    With a `kv`, `window` may be left out; given, it must equal the spec's for the layer.
    Scores and softmax run in float32; out has q's dtype.
    """
    _check_qkv(q, k, v, kv, layer)
    where = f"ll.attention(layer={layer})"
    window = checked_window(window, f"{where}: window")
    scale = q.shape[-1] ** -0.5 if scale is None else _checked_float(scale, f"{where}: scale")
    if softcap is not None:
        softcap = _checked_float(softcap, f"{where}: softcap", positive=True)
    if kv is None:
        b, t = q.shape[:2]
        columns = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = ops_attention.Mask(columns, None, window)
        keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
        return ops_attention.attention(q, keys, values, mask, scale, softcap), None
    spec_window = kv.spec.windows[layer]
    if window is not None and window != spec_window:
        raise ValueError(
            f"{where}: window={window} but the KVSpec gives layer {layer} window {spec_window}"
        )
    if kv.packed is not None:
        out = packed_attention(
            q, k, v, kv.positions, kv.packed, spec_window, scale, softcap, kv.numerics
        )
        return out, kv._replace(written=(*kv.written, layer))
    cache = kv.caches[layer]
    mask = layers.layer_mask(kv.positions, cache, spec_window)
    out, cache = layers.cached_attention(
        q, k, v, kv.positions, cache, mask, scale, softcap, numerics=kv.numerics
    )
    caches = list(kv.caches)
    caches[layer] = cache
    return out, kv._replace(caches=caches, written=(*kv.written, layer))


def packed_attention(
    q: jax.Array,  # [1, N, H, D]
    k: jax.Array,  # [1, N, Hkv, D]
    v: jax.Array,  # [1, N, Hkv, D]
    positions: jax.Array,  # [1, N]
    packed: Packed,
    window: int | None,
    scale: float,
    softcap: float | None,
    numerics: Numerics,
) -> jax.Array:
    """The attention of a packed pass (`Packed`): the stream's queries, keys and values
    gathered into rows `[R, W]` (slot == position, as in a row's own cache), attended as
    a prompt pass's rows are (the same implementation, so with `deterministic=True` the
    same sums in the same order), and each token's output read back from its row."""
    width = packed.queries.shape[1]

    def rows_of(x, columns):  # [1, N, h, D] -> [R, W, h, D]
        return x[0][jnp.maximum(columns, 0)]

    q_pos = jnp.where(packed.queries >= 0, jnp.arange(width, dtype=jnp.int32), -1)
    keys, values = (rows_of(x, packed.keys).transpose(0, 2, 1, 3) for x in (k, v))
    out = ops_attention.attention(
        rows_of(q, packed.queries),
        keys,  # [R, Hkv, W, D]
        values,
        ops_attention.Mask(q_pos, None, window),
        scale,
        softcap,
        deterministic=numerics.fixed,
    )  # [R, W, H, D]
    return out[packed.rows[0], jnp.maximum(positions[0], 0)][None]  # [1, N, H, D]


def residual(x: jax.Array, kv: KV | None, *, layer: int) -> tuple[jax.Array, KV | None]:
    """Mark the residual stream after decoder layer `layer`: `x, kv = ll.residual(x, kv,
    layer=i)`, x `[B, T, E]` (contract version 2).

    A model calls it once per layer, after the layer's residual adds (`layer = i` in
    0 .. `KVSpec.num_layers - 1`), and optionally on its final norm's output (`layer =
    KVSpec.num_layers`). It returns x plus the rows' steering vectors for this layer
    (`Rows.steer`, `logitloop.models.steering`: x itself for a row without any) and the
    `kv` with x recorded where the pass captures this layer (`Rows.capture`, read back
    from the kv the model returns). Without steering or capture (or with `kv=None`) it
    returns `(x, kv)` unchanged but for the mark. A model that never calls it runs as
    before; capture and steering refuse it by name when its pass is traced.
    """
    if kv is None:
        return x, None
    where = f"ll.residual(layer={layer!r})"
    if not isinstance(kv, KV):
        raise TypeError(
            f"{where}: kv must be the KV the model was handed (or None), got {type(kv).__name__}"
        )
    top = kv.spec.num_layers
    if isinstance(layer, (bool, jax.core.Tracer)) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"{where}: layer must be a Python int in [0, {top}]")
    if not 0 <= layer <= top:
        raise ValueError(
            f"{where}: layer must be in [0, {top}] (a decoder layer, or {top}: the final "
            "norm's output)"
        )
    if layer in kv.marked:
        raise ValueError(f"{where}: layer {layer} was already marked in this forward pass")
    if getattr(x, "ndim", None) != 3 or tuple(x.shape[:2]) != tuple(kv.positions.shape):
        raise ValueError(
            f"{where}: x must be [B, T, E] with B, T = {tuple(kv.positions.shape)} (the "
            f"pass's positions), got shape {tuple(getattr(x, 'shape', ()))}"
        )
    rows, captured = kv.rows, kv.captured
    if rows is not None and rows.steer is not None and layer < top:
        token_rows = None if kv.packed is None else kv.packed.rows
        batch = x.shape[0] if token_rows is None else kv.packed.queries.shape[0]
        if rows.steer.width != x.shape[-1] or rows.steer.vectors.shape[0] != batch:
            raise ValueError(
                f"{where}: the steering vectors are [{rows.steer.vectors.shape[0]}, K, "
                f"{rows.steer.width}] for a residual stream of shape {tuple(x.shape)}"
                + ("" if token_rows is None else f" packed from {batch} rows")
            )
        x = steering_lib.add(x, rows.steer, kv.positions, layer, token_rows)
    if rows is not None and layer in rows.capture:
        captured = {**captured, layer: x}
    return x, kv._replace(marked=(*kv.marked, layer), captured=captured)


def check_marked(kv: KV, where: str) -> None:
    """Refuse a pass that steers or captures through a model that did not mark the layers
    it needs with `residual` (every decoder layer to steer; each layer to capture)."""
    rows = kv.rows
    if rows is None or (rows.steer is None and not rows.capture):
        return
    need = set(rows.capture)
    if rows.steer is not None:
        need |= set(range(kv.spec.num_layers))
    missing = sorted(need - set(kv.marked))
    if missing:
        raise ValueError(
            f"{where} did not mark its residual stream at layer(s) {missing} with "
            "ll.residual (contract version 2): steering needs every decoder layer marked, "
            "capture the layers it records (KVSpec.num_layers: the final norm's output)"
        )


def _check_qkv(q, k, v, kv: KV | None, layer: Any) -> None:
    """Refuse a call whose shapes, dtypes or layer do not fit (at trace time), by name."""
    where = f"ll.attention(layer={layer!r})"
    if kv is not None and not isinstance(kv, KV):
        raise TypeError(
            f"{where}: kv must be the KV the model was handed (or None), got {type(kv).__name__}"
        )
    if isinstance(layer, (bool, jax.core.Tracer)) or not isinstance(layer, (int, np.integer)):
        raise TypeError(
            f"{where}: layer must be a Python int (the layer's index in the KVSpec), got "
            f"{type(layer).__name__}; a model that scans over its layers is not supported by "
            "contract version 1 (loop over them in Python; remat works)"
        )
    if layer < 0:
        raise ValueError(f"{where}: layer must be >= 0 (the layer's index in the KVSpec)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{where}: {name} must be [B, T, heads, head_dim], got shape "
                f"{tuple(getattr(x, 'shape', ()))}"
            )
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"{where}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must "
            "share B, T and head_dim, and k and v their shape"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{where}: {q.shape[2]} query heads is not a multiple of {k.shape[2]} key/value heads"
        )
    if kv is None:
        return
    spec = kv.spec
    if not 0 <= layer < spec.num_layers:
        raise ValueError(f"{where}: layer must be in [0, {spec.num_layers}) (KVSpec.num_layers)")
    if layer in kv.written:
        raise ValueError(
            f"{where}: layer {layer} was already written in this forward pass (its cache "
            "would be written twice); call ll.attention once per layer, each with its own "
            "layer index"
        )
    if k.shape[2] != spec.num_kv_heads or k.shape[3] != spec.head_dim:
        raise ValueError(
            f"{where}: k and v have {k.shape[2]} heads of {k.shape[3]}, but the KVSpec says "
            f"num_kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}"
        )
    if k.dtype != spec.dtype or v.dtype != spec.dtype:
        raise ValueError(
            f"{where}: k is {k.dtype} and v is {v.dtype}, but the KVSpec's dtype is "
            f"{spec.dtype}: cast them (or declare the cache's dtype in the KVSpec)"
        )
    if tuple(q.shape[:2]) != tuple(kv.positions.shape):
        raise ValueError(
            f"{where}: q has B, T = {tuple(q.shape[:2])} but the pass's positions are "
            f"{tuple(kv.positions.shape)}"
        )


def checked_window(value: Any, name: str) -> int | None:
    """A sliding window as `KVSpec` and `attention` take it: None (global attention) or a
    positive int (a Python or NumPy int), else a ValueError naming `name`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"{name} must be None (global attention) or a positive int (tokens), got {value!r}"
        )
    return int(value)


def _checked_float(value: Any, name: str, positive: bool = False) -> float:
    """`scale` or `softcap` as a finite float (`positive`: > 0), else a ValueError naming
    `name`: a zero or negative softcap divides the scores by it (NaN), a NaN scale makes
    every output NaN."""
    try:
        number = None if isinstance(value, (bool, str, bytes)) else float(value)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        number = None
    if number is None or not np.isfinite(number) or (positive and number <= 0):
        kind = "a positive finite float" if positive else "a finite float"
        raise ValueError(f"{name} must be None or {kind}, got {value!r}")
    return number


def dense(
    x: jax.Array,
    w: jax.Array,
    kv: KV | None = None,
    *,
    lora: tuple[int, str] | None = None,
) -> jax.Array:
    """`x @ w`, `[..., K] x [K, N] -> [..., N]`: under `deterministic=True` (a `kv` of a
    deterministic pass) in a fixed order, so a row's result does not depend on how many
    rows the batch has (`fixed_order`); a plain product otherwise. A model's products
    that should keep a row's bits whatever the batch call this with the pass's `kv`.

    `lora=(layer, target)` (e.g. `(3, "q_proj")`, the projection's name in the PEFT
    adapters a user loads): where the pass carries an adapter table with that target,
    each row adds its own adapter's `scale * (x @ A) @ B` (`logitloop.models.lora`; the
    base weights are never copied); without one (or `kv=None`), plain `x @ w`."""
    numerics = PLAIN if kv is None else kv.numerics
    site = None if kv is None or lora is None else adapter_site(kv, *lora)
    return layers.dense(x, w, numerics=numerics, lora=site)


def adapter_site(kv: KV | None, layer: int, target: str) -> lora_lib.Site | None:
    """The pass's adapters of projection `target` of layer `layer` (`lora.Site`, what
    `layers.dense` takes as `lora=`), or None (no `kv`, no table, no such target)."""
    return None if kv is None else lora_lib.site(kv.rows, layer, target)


def lm_head(x: jax.Array, table: jax.Array, kv: KV | None = None) -> jax.Array:
    """The float32 logits `[..., V]` of activations `[..., E]` against a vocabulary table
    `[V, E]` (an LM head, or a tied embedding as it is): float32 out of 16-bit operands
    without a float32 copy of the table, and in a fixed order under a deterministic `kv`
    (`fixed_order.head_product`, the LM head of logitloop's families)."""
    numerics = PLAIN if kv is None else kv.numerics
    shape = tuple(getattr(table, "shape", ()))
    if len(shape) != 2 or shape[1] != x.shape[-1]:
        hint = " (an [E, V] table: pass its transpose)" if shape[:1] == x.shape[-1:] else ""
        raise ValueError(
            f"ll.lm_head: table must be [V, E] (vocabulary, then x's last axis E = "
            f"{x.shape[-1]}), got shape {shape}{hint}"
        )
    rows = x.reshape(-1, x.shape[-1])
    logits = fixed_order.rowwise(
        lambda r: fixed_order.head_product(r, table, numerics=numerics),
        rows,
        numerics=numerics,
        head=True,
        shape=(rows.shape[-1], table.shape[0]),
    )
    return logits.reshape(*x.shape[:-1], table.shape[0])


def mean(x: jax.Array, kv: KV | None = None) -> jax.Array:
    """The mean over the last axis (keeping it), in a fixed order under a deterministic
    `kv` (`fixed_order.mean`; norms that should keep a row's bits whatever the batch)."""
    return fixed_order.mean(x, numerics=PLAIN if kv is None else kv.numerics)
