"""The Llama family in Flax NNX: Llama 2/3, Mistral, Qwen2 and Qwen3.

One decoder covers all four; `LlamaConfig` switches on what differs (q/k/v biases for
Qwen2, per-head q/k RMSNorm for Qwen3, sliding windows for Mistral, RoPE scaling for
Llama 3.1). Weights are stored head-split (`wq: [E, H, D]`, `wo: [H, D, E]`) so that the
"heads" axis can be laid over a model-parallel mesh axis.

Logical axis names on the parameters:
  "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from logitloop.models import layers
from logitloop.models.config import LlamaConfig
from logitloop.models.layers import CheckpointTensor, KVCache


class LlamaBlock(nnx.Module):
    """One pre-norm decoder block: attention with RoPE and GQA, then a gated MLP."""

    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        e, h, hkv, d, f = (
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
        )

        def p(shape, names, init="normal"):
            return layers.param(rngs, shape, dtype, names, init=init)

        self.attn_norm = p((e,), ("embed",), "ones")
        self.wq = p((e, h, d), ("embed", "heads", "head_dim"))
        self.wk = p((e, hkv, d), ("embed", "kv_heads", "head_dim"))
        self.wv = p((e, hkv, d), ("embed", "kv_heads", "head_dim"))
        self.wo = p((h, d, e), ("heads", "head_dim", "embed"))
        if c.qkv_bias:
            self.bq = p((h, d), ("heads", "head_dim"), "zeros")
            self.bk = p((hkv, d), ("kv_heads", "head_dim"), "zeros")
            self.bv = p((hkv, d), ("kv_heads", "head_dim"), "zeros")
        if c.o_bias:
            self.bo = p((e,), ("embed",), "zeros")
        if c.qk_norm:
            self.q_norm = p((d,), ("head_dim",), "ones")
            self.k_norm = p((d,), ("head_dim",), "ones")
        self.mlp_norm = p((e,), ("embed",), "ones")
        self.w_gate = p((e, f), ("embed", "mlp"))
        self.w_up = p((e, f), ("embed", "mlp"))
        self.w_down = p((f, e), ("mlp", "embed"))
        if c.mlp_bias:
            self.b_gate = p((f,), ("mlp",), "zeros")
            self.b_up = p((f,), ("mlp",), "zeros")
            self.b_down = p((e,), ("embed",), "zeros")
        self.config = config

    def __call__(
        self,
        x: jax.Array,  # [B, T, E]
        positions: jax.Array,  # [B, T] int, -1 for padding
        cache: dict[str, jax.Array],  # k, v: [B, Hkv, S, D]
        mask: jax.Array,  # [B, T, S] bool
        inv_freq,  # [D // 2] numpy
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        c = self.config
        h = layers.rms_norm(x, self.attn_norm[...], c.rms_norm_eps)
        q = layers.split_heads(h, self.wq[...])  # [B, T, H, D]
        k = layers.split_heads(h, self.wk[...])  # [B, T, Hkv, D]
        v = layers.split_heads(h, self.wv[...])  # [B, T, Hkv, D]
        if c.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if c.qk_norm:
            q = layers.rms_norm(q, self.q_norm[...], c.rms_norm_eps)
            k = layers.rms_norm(k, self.k_norm[...], c.rms_norm_eps)
        q = layers.apply_rope(q, positions, inv_freq)
        k = layers.apply_rope(k, positions, inv_freq)
        cache = {
            "k": layers.write_cache(cache["k"], k, positions),
            "v": layers.write_cache(cache["v"], v, positions),
        }
        attn = layers.attend(q, cache["k"], cache["v"], mask, scale=c.head_dim**-0.5)
        attn = layers.merge_heads(attn, self.wo[...])  # [B, T, E]
        if c.o_bias:
            attn = attn + self.bo[...]
        x = x + attn

        h = layers.rms_norm(x, self.mlp_norm[...], c.rms_norm_eps)
        gate = h @ self.w_gate[...]  # [B, T, F]
        up = h @ self.w_up[...]
        if c.mlp_bias:
            gate, up = gate + self.b_gate[...], up + self.b_up[...]
        out = (layers.activation(c.hidden_act, gate) * up) @ self.w_down[...]  # [B, T, E]
        if c.mlp_bias:
            out = out + self.b_down[...]
        return x + out, cache


class LlamaModel(nnx.Module):
    """A Llama-family causal LM that follows the decode-loop model protocol.

    Attributes:
      config: the `LlamaConfig`.
      tokenizer: a `logitloop.models.Tokenizer`, or None.
      dtype: the parameter dtype; activations are computed in it, logits come back float32.
    """

    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.tokenizer = None
        self.embedding = layers.param(
            rngs, (c.vocab_size, c.hidden_size), dtype, ("vocab", "embed")
        )
        self.layers = nnx.List([LlamaBlock(c, dtype=dtype, rngs=rngs) for _ in range(c.num_layers)])
        self.final_norm = layers.param(rngs, (c.hidden_size,), dtype, ("embed",), init="ones")
        if not c.tie_word_embeddings:
            self.lm_head = layers.param(
                rngs, (c.vocab_size, c.hidden_size), dtype, ("vocab", "embed")
            )

    def init_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """Zeros: per layer `dict(k=[B, Hkv, S, D], v=[B, Hkv, S, D])`, S = max_length."""
        c = self.config
        return layers.init_kv_cache(
            batch_size,
            max_length,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.dtype if dtype is None else dtype,
        )

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32, -1 for (left) padding
        cache: KVCache,
    ) -> tuple[jax.Array, KVCache]:
        """Run T columns through the model, writing their keys/values into `cache`.

        Returns the float32 logits of the last column, `[B, V]`, and the updated cache.
        Only the last column goes through the final norm and LM head: prompts are
        left-padded, so that column is every row's last real token.

        Each real token's key/value goes to cache slot == its position (padding is never
        written); each query at position q attends the slots s <= q of its own row (within
        the sliding window, if any), including those written by this call. Positions must
        be below the cache length S; `logitloop.models.layers` walks through an example.
        Pure in (parameters, tokens, positions, cache): safe under `jit` and `while_loop`.
        """
        c = self.config
        inv_freq = layers.rope_inverse_frequencies(c.rope, c.head_dim)
        num_slots = layers.cache_slots(cache)
        masks = {w: layers.attention_mask(positions, num_slots, w) for w in set(c.sliding_windows)}
        # Clip so a pad id outside the vocabulary cannot produce NaN (take fills by default).
        x = jnp.take(self.embedding[...], tokens, axis=0, mode="clip")  # [B, T, E]
        new_cache = []
        for block, layer_cache, window in zip(self.layers, cache, c.sliding_windows, strict=True):
            x, layer_cache = block(x, positions, layer_cache, masks[window], inv_freq)
            new_cache.append(layer_cache)
        last = layers.rms_norm(x[:, -1], self.final_norm[...], c.rms_norm_eps)  # [B, E]
        head = self.embedding[...] if c.tie_word_embeddings else self.lm_head[...]  # [V, E]
        logits = jnp.einsum("be,ve->bv", last, head, preferred_element_type=jnp.float32)
        return logits, new_cache


def checkpoint_tensors(config: LlamaConfig) -> dict[str, CheckpointTensor]:
    """Every tensor a Hugging Face checkpoint of `config` must hold, by name."""
    c = config
    e, h, hkv, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size

    def heads_in(n):  # torch Linear [n * D, E] -> [E, n, D]
        return lambda w: w.T.reshape(e, n, d)

    def transpose(w):  # torch Linear [out, in] -> [in, out]
        return w.T

    out = {
        "model.embed_tokens.weight": CheckpointTensor(("embedding",), (c.vocab_size, e)),
        "model.norm.weight": CheckpointTensor(("final_norm",), (e,)),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = CheckpointTensor(("lm_head",), (c.vocab_size, e))
    for i in range(c.num_layers):
        hf = f"model.layers.{i}."
        t = ("layers", i)
        out[hf + "input_layernorm.weight"] = CheckpointTensor((*t, "attn_norm"), (e,))
        out[hf + "post_attention_layernorm.weight"] = CheckpointTensor((*t, "mlp_norm"), (e,))
        out[hf + "self_attn.q_proj.weight"] = CheckpointTensor((*t, "wq"), (h * d, e), heads_in(h))
        out[hf + "self_attn.k_proj.weight"] = CheckpointTensor(
            (*t, "wk"), (hkv * d, e), heads_in(hkv)
        )
        out[hf + "self_attn.v_proj.weight"] = CheckpointTensor(
            (*t, "wv"), (hkv * d, e), heads_in(hkv)
        )
        out[hf + "self_attn.o_proj.weight"] = CheckpointTensor(
            (*t, "wo"), (e, h * d), lambda w: w.T.reshape(h, d, e)
        )
        if c.qkv_bias:
            for name, n in (("q", h), ("k", hkv), ("v", hkv)):
                out[hf + f"self_attn.{name}_proj.bias"] = CheckpointTensor(
                    (*t, "b" + name), (n * d,), lambda b, n=n: b.reshape(n, d)
                )
        if c.o_bias:
            out[hf + "self_attn.o_proj.bias"] = CheckpointTensor((*t, "bo"), (e,))
        if c.qk_norm:
            out[hf + "self_attn.q_norm.weight"] = CheckpointTensor((*t, "q_norm"), (d,))
            out[hf + "self_attn.k_norm.weight"] = CheckpointTensor((*t, "k_norm"), (d,))
        out[hf + "mlp.gate_proj.weight"] = CheckpointTensor((*t, "w_gate"), (f, e), transpose)
        out[hf + "mlp.up_proj.weight"] = CheckpointTensor((*t, "w_up"), (f, e), transpose)
        out[hf + "mlp.down_proj.weight"] = CheckpointTensor((*t, "w_down"), (e, f), transpose)
        if c.mlp_bias:
            out[hf + "mlp.gate_proj.bias"] = CheckpointTensor((*t, "b_gate"), (f,))
            out[hf + "mlp.up_proj.bias"] = CheckpointTensor((*t, "b_up"), (f,))
            out[hf + "mlp.down_proj.bias"] = CheckpointTensor((*t, "b_down"), (e,))
    return out


def is_ignored_tensor(name: str, config: LlamaConfig) -> bool:
    """Tensors some checkpoints carry that the model recomputes or shares."""
    if name.endswith("rotary_emb.inv_freq"):  # a RoPE buffer older checkpoints saved
        return True
    # A tied checkpoint may still store the head; the model uses the embedding instead.
    return config.tie_word_embeddings and name == "lm_head.weight"
