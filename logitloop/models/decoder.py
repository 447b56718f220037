"""The decoder body every model family shares: embedding -> blocks -> final norm -> LM head.

A family (`gpt2.py`, `llama.py`; `gemma.py`, `phi3.py`, `moe.py` build on `llama.py`)
subclasses `DecoderModel`: its `__init__` builds the
parameters under the names its checkpoint map targets and puts its blocks in
`self.layers`, and it fills in what differs between architectures:

  embed(tokens, positions) -> [B, T, E]   token embedding (plus learned positions, GPT-2)
  output_norm(x, numerics) -> x            the final LayerNorm / RMSNorm
  head_weight() -> [V, E]                  the LM head (the embedding when tied)
  output_logits(logits) -> logits          after the head, float32 (soft-capping, Gemma 2)

Each block is called as `block(x, positions, kv) -> (x, kv)` and calls the public
attention contract, `ll.attention(q, k, v, kv, layer=self.layer, ...)` (`logitloop.models.
kv`), exactly as a user's model does; after each block the body marks the residual stream,
`x, kv = ll.residual(x, kv, layer=i)` (steering and capture), and the final norm's output
where a pass captures it: the cache, its layout (contiguous, ring or paged) and
the attention implementation are the library's, behind the pass's `kv`. Under a
deterministic policy, or on a mesh, the block gets `numerics=` too (the pass's
`fixed_order.Numerics`, `kv.numerics`, which the block hands to every layer function it
calls; so does `output_norm`). What happens inside (RoPE or not, the kind of norm and MLP,
biases) is the family's own. The config supplies `num_layers`, `num_kv_heads`, `head_dim`
and `sliding_windows` (one window or None per layer): the model's `kv_spec`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from logitloop.models import kv as kv_contract
from logitloop.models.fixed_order import PLAIN, Numerics
from logitloop.models.kv import KV, KVSpec
from logitloop.models.layers import KVCache


def policy(numerics: Numerics) -> dict[str, Numerics]:
    """The keywords a block and `output_norm` get: `numerics=` under a deterministic policy
    or with the rows over a mesh (a paged pool's layers split its pages the same way), none
    in a plain pass on one device (see the module docstring)."""
    return {"numerics": numerics} if numerics.fixed or numerics.row_mesh is not None else {}


class DecoderModel(nnx.Module):
    """A causal LM that follows the decode-loop model protocol.

    Attributes:
      config: the family's config (a frozen dataclass, static under `jit`).
      tokenizer: a `logitloop.models.Tokenizer`, or None.
      dtype: the parameter dtype; activations are computed in it, logits come back float32.
      layers: the blocks, an `nnx.List`.
    """

    def __init__(self, config, *, dtype: jnp.dtype):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.tokenizer = None

    def embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """`[B, T]` tokens and positions (-1 for padding) -> `[B, T, E]` activations."""
        raise NotImplementedError

    def output_norm(self, x: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        """The final norm, applied to the last column only: `[B, E] -> [B, E]`."""
        raise NotImplementedError

    def head_weight(self) -> jax.Array:
        """The LM head, `[V, E]`."""
        raise NotImplementedError

    def output_logits(self, logits: jax.Array) -> jax.Array:
        """The float32 `[B, V]` logits after the LM head -> what the model returns
        (identity; Gemma 2 soft-caps them)."""
        return logits

    @property
    def kv_spec(self) -> KVSpec:
        """What the model keeps per token and layer (`ll.KVSpec`): the config's layers, KV
        heads, head size and windows, in the parameter dtype."""
        c = self.config
        return KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, c.sliding_windows)

    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """Zeros: per layer `dict(k=[B, Hkv, S, D], v=[B, Hkv, S, D])`, S = max_length, or
        for a sliding-window layer whose window is shorter than that a ring of fewer slots
        (`KVSpec.init_cache`, `layers.init_layer_caches`)."""
        spec = self.kv_spec if dtype is None else dataclasses.replace(self.kv_spec, dtype=dtype)
        return spec.init_cache(batch_size, max_length)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32, -1 for (left) padding
        cache: KV | KVCache | None,
        *,
        all_columns: bool | None = None,
        numerics: Numerics | None = None,
        routing: jax.Array | None = None,
    ) -> tuple[jax.Array, ...]:
        """Run T columns through the model, writing their keys/values into `cache`.

        The model follows the public attention contract (`logitloop.models.kv`): `cache`
        is the pass's `ll.KV`, which every block's attention goes through (`ll.attention`),
        or None (plain causal attention over the call's columns, for training). A list of
        layer caches (`init_cache`) is taken too, as the `KV` of a pass with `numerics`
        (default plain), and comes back as a list.

        Returns the float32 logits of the last column, `[B, V]`, and the updated cache.
        Only the last column goes through the final norm and LM head: prompts are
        left-padded, so that column is every row's last real token. `all_columns=True`
        returns every column's logits, `[B, T, V]` (speculative verification), or those of
        the columns the `KV` reads (`kv.read`, `[B, M, V]`: a packed scoring pass); default:
        what the `KV` asks for (`kv.all_columns`), else False. Padding columns
        (-1) compute finite values that are never used. `numerics`: how the layers reduce
        (`fixed_order.Numerics`, given by `decoding.loop.runner.ModelRunner.forward` for
        the pass; default plain XLA ops).

        Each real token's key/value goes to cache slot == its position (padding is never
        written), or in a sliding-window ring to slot position % R; each query at position
        q attends the positions s <= q of its own row (within the sliding window, if any),
        including those written by this call. A row's real columns in one call are
        consecutive positions (left padding first). Positions must be below the
        `max_length` the cache was made for; `logitloop.models.layers` walks through an
        example and describes the ring.
        Pure in (parameters, tokens, positions, cache): safe under `jit` and `while_loop`.

        `routing` (a mixture of experts, `moe.py`): `[B, T, L, k]` int32, for each token
        and each of the L `routed_layers()` the k experts to send it to (routing replay;
        a token whose first id is -1 goes where the router sends it); the call then
        returns `(logits, cache, routing used)`, the last `[B, T, L, k]` (pass all -1 to
        record the router's choices).
        """
        kv = self.pass_kv(cache, positions, numerics)
        numerics = PLAIN if kv is None else kv.numerics
        if all_columns is None:
            all_columns = isinstance(cache, KV) and cache.all_columns
        if routing is None:
            x, kv = self.hidden_states(tokens, positions, kv)  # [B, T, E]
        else:
            x, kv, used = self.hidden_states(tokens, positions, kv, routing=routing)
        new_cache = kv.finish("the model") if kv is not None and not isinstance(cache, KV) else kv
        read = kv.read if all_columns and isinstance(cache, KV) else None

        def columns(a):  # the columns whose logits the caller reads (`KV.read`)
            return (a if read is None else a[:, read]) if all_columns else a[:, -1]

        if kv is not None and kv.rows is not None and len(self.layers) in kv.rows.capture:
            # The final norm's output of every column, recorded (`ll.residual`).
            normed, kv = kv_contract.residual(
                self.output_norm(x, **policy(numerics)), kv, layer=len(self.layers)
            )
            new_cache = kv if isinstance(cache, KV) else new_cache
            last = columns(normed)
        else:
            last = self.output_norm(columns(x), **policy(numerics))
        logits = self.output_logits(kv_contract.lm_head(last, self.head_weight(), kv))
        return (logits, new_cache) if routing is None else (logits, new_cache, used)

    def routed_layers(self) -> tuple[int, ...]:
        """The layers that route each token to experts (a mixture of experts' sparse
        layers; none in a dense model): the L of a routing record `[B, T, L, k]`."""
        return tuple(i for i, b in enumerate(self.layers) if getattr(b, "sparse", False))

    def pass_kv(self, cache: KV | KVCache | None, positions: jax.Array, numerics=None) -> KV | None:
        """The pass's `KV`: `cache` itself, None, or a list of layer caches wrapped as the
        `KV` of a pass with `numerics` (default plain)."""
        if cache is None or isinstance(cache, KV):
            if numerics is not None:
                raise ValueError("numerics= goes with a list of layer caches; a KV carries its own")
            return cache
        return KV(cache, positions, self.kv_spec, PLAIN if numerics is None else numerics)

    def hidden_states(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32, -1 for (left) padding
        kv: KV | KVCache | None,
        numerics: Numerics | None = None,
        routing: jax.Array | None = None,  # [B, T, L, k] i32 (`__call__`)
    ) -> tuple[jax.Array, ...]:
        """The blocks' output at every column, `[B, T, E]` (before the final norm) and the
        updated `kv` (as `__call__` takes and returns it), and with `routing` the experts
        used, `[B, T, L, k]`: `__call__` without the head, for training (which needs every
        column's logits: `output_norm` and `head_weight` apply to `[B, T, E]` as well)."""
        given = kv
        kv = self.pass_kv(kv, positions, numerics)
        keywords = policy(PLAIN if kv is None else kv.numerics)
        x = self.embed(tokens, positions)  # [B, T, E]
        used = []
        routed = self.routed_layers() if routing is not None else ()
        for i, block in enumerate(self.layers):
            if i in routed:
                r = routing[:, :, routed.index(i)]
                x, kv, experts = block(x, positions, kv, routing=r, **keywords)
                used.append(experts)
            else:
                x, kv = block(x, positions, kv, **keywords)
            x, kv = kv_contract.residual(x, kv, layer=i)  # steering, capture
        if kv is not None and not isinstance(given, KV):
            kv = kv.finish("the model")
        if routing is None:
            return x, kv
        return x, kv, jnp.stack(used, axis=2)
