"""The Llama family in Flax NNX: Llama 2/3, Mistral, Qwen2 and Qwen3.

One decoder covers all four; `LlamaConfig` switches on what differs (q/k/v biases for
Qwen2, per-head q/k RMSNorm for Qwen3, sliding windows for Mistral, RoPE scaling for
Llama 3.1). Weights are stored head-split (`wq: [E, H, D]`, `wo: [H, D, E]`) so that the
"heads" axis can be laid over a model-parallel mesh axis.

Logical axis names on the parameters:
  "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from logitloop.models import kv as kv_contract
from logitloop.models import layers, quantization, registry
from logitloop.models.config import (
    LlamaConfig,
    llama_config_from_hf,
    mistral_sliding_windows,
    qwen_sliding_windows,
)
from logitloop.models.decoder import DecoderModel
from logitloop.models.fixed_order import PLAIN, Numerics
from logitloop.models.kv import KV
from logitloop.models.layers import CheckpointTensor


class LlamaBlock(nnx.Module):
    """One pre-norm decoder block: attention with RoPE and GQA, then a gated MLP.

    Subclasses (Gemma, the mixtures of experts) override `norm`, `mlp`, `after_attention`
    or `after_mlp`;
    `attention` reads `self.rope`, `self.scale` and `self.softcap`, set here per layer.
    Every method takes the pass's `numerics` (`fixed_order.Numerics`) for the layer
    functions it calls.
    """

    norm_init = "ones"  # the RMSNorm weights' value before a checkpoint fills them

    def __init__(self, config: LlamaConfig, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        c = config
        e, h, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

        def p(shape, names, init="normal"):
            return layers.param(rngs, shape, dtype, names, init=init)

        self.attn_norm = p((e,), ("embed",), self.norm_init)
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
            self.q_norm = p((d,), ("head_dim",), self.norm_init)
            self.k_norm = p((d,), ("head_dim",), self.norm_init)
        self.mlp_norm = p((e,), ("embed",), self.norm_init)
        self.init_mlp(c, p)
        self.config = config
        self.layer = layer  # its index in the KVSpec (`ll.attention(..., layer=)`)
        self.rope = c.rope
        self.scale = c.head_dim**-0.5
        self.softcap = None

    def init_mlp(self, c: LlamaConfig, p) -> None:
        """The gated MLP's parameters (`p(shape, names, init)` makes one)."""
        e, f = c.hidden_size, c.intermediate_size
        self.w_gate = p((e, f), ("embed", "mlp"))
        self.w_up = p((e, f), ("embed", "mlp"))
        self.w_down = p((f, e), ("mlp", "embed"))
        if c.mlp_bias:
            self.b_gate = p((f,), ("mlp",), "zeros")
            self.b_up = p((f,), ("mlp",), "zeros")
            self.b_down = p((e,), ("embed",), "zeros")

    def norm(self, x: jax.Array, weight: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        return layers.rms_norm(x, weight, self.config.rms_norm_eps, numerics=numerics)

    def attention(
        self,
        h: jax.Array,  # [B, T, E], normalised
        positions: jax.Array,  # [B, T] int, -1 for padding
        kv: KV | None,  # the pass's cache (`ll.attention`)
        numerics: Numerics = PLAIN,
    ) -> tuple[jax.Array, KV | None]:
        c = self.config
        # Each projection adds the pass's row adapters (`kv.rows`, `ll.dense(..., lora=)`).
        q = layers.split_heads(h, self.wq[...], numerics=numerics, lora=self.site(kv, "q_proj"))
        k = layers.split_heads(h, self.wk[...], numerics=numerics, lora=self.site(kv, "k_proj"))
        v = layers.split_heads(h, self.wv[...], numerics=numerics, lora=self.site(kv, "v_proj"))
        if c.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if c.qk_norm:
            q = self.norm(q, self.q_norm[...], numerics)
            k = self.norm(k, self.k_norm[...], numerics)
        q, k = layers.rope_qk(q, k, positions, self.rope, c.head_dim)
        window = c.sliding_windows[self.layer]
        attn, kv = kv_contract.attention(
            q, k, v, kv, layer=self.layer, scale=self.scale, softcap=self.softcap, window=window
        )
        attn = layers.merge_heads(
            attn, self.wo[...], numerics=numerics, lora=self.site(kv, "o_proj")
        )  # [B, T, E]
        if c.o_bias:
            attn = attn + self.bo[...]
        return attn, kv

    def site(self, kv: KV | None, target: str):
        """The pass's adapters of this layer's projection `target` (PEFT's name for it:
        "q_proj", ..., "down_proj"), or None (`kv_contract.adapter_site`)."""
        return kv_contract.adapter_site(kv, self.layer, target)

    def mlp(self, h: jax.Array, numerics: Numerics = PLAIN, kv: KV | None = None) -> jax.Array:
        """`[B, T, E] -> [B, T, E]`: down(act(gate(h)) * up(h)); `kv`: the pass's (its
        row adapters, `site`)."""
        c = self.config
        gate = layers.dense(h, self.w_gate[...], numerics=numerics, lora=self.site(kv, "gate_proj"))
        up = layers.dense(h, self.w_up[...], numerics=numerics, lora=self.site(kv, "up_proj"))
        if c.mlp_bias:
            gate, up = gate + self.b_gate[...], up + self.b_up[...]
        act = layers.activation(c.hidden_act, gate) * up
        f = c.intermediate_size
        down = self.site(kv, "down_proj")
        out = layers.dense(act, self.w_down[...], groups=f, numerics=numerics, lora=down)
        if c.mlp_bias:
            out = out + self.b_down[...]
        return out

    def __call__(
        self,
        x: jax.Array,  # [B, T, E]
        positions: jax.Array,  # [B, T] int, -1 for padding
        kv: KV | None,  # the pass's cache (`ll.attention`)
        *,
        numerics: Numerics = PLAIN,
        routing: jax.Array | None = None,
    ) -> tuple[jax.Array, ...]:
        """`(x, kv)`; with `routing` (an MoE layer's `[B, T, k]` experts to replay, -1:
        its own choice) `(x, kv, experts used)` (`moe.MoeBlock.mlp`)."""
        h = self.norm(x, self.attn_norm[...], numerics)
        attn, kv = self.attention(h, positions, kv, numerics)
        x = x + self.after_attention(attn, numerics)
        h = self.norm(x, self.mlp_norm[...], numerics)
        if routing is None:
            return x + self.after_mlp(self.mlp(h, numerics, kv), numerics), kv
        out, used = self.mlp(h, numerics, kv, routing=routing)
        return x + self.after_mlp(out, numerics), kv, used

    def after_attention(self, attn: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        """What the attention output goes through before the residual add (Gemma: a norm)."""
        return attn

    def after_mlp(self, out: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        """What the MLP output goes through before the residual add (Gemma: a norm)."""
        return out


class LlamaModel(DecoderModel):
    """A Llama-family causal LM: RoPE inside the blocks, RMSNorm, a tied or separate head.

    Attributes:
      config: the `LlamaConfig`.
      tokenizer: a `logitloop.models.Tokenizer`, or None.
      dtype: the parameter dtype; activations are computed in it, logits come back float32.
    """

    block_class = LlamaBlock

    def __init__(self, config: LlamaConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype)
        c = config
        self.embedding = layers.param(
            rngs, (c.vocab_size, c.hidden_size), dtype, ("vocab", "embed")
        )
        self.layers = nnx.List(
            [self.block_class(c, i, dtype=dtype, rngs=rngs) for i in range(c.num_layers)]
        )
        self.final_norm = layers.param(
            rngs, (c.hidden_size,), dtype, ("embed",), init=self.block_class.norm_init
        )
        if not c.tie_word_embeddings:
            self.lm_head = layers.param(
                rngs, (c.vocab_size, c.hidden_size), dtype, ("vocab", "embed")
            )

    def embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        # Float or quantized (`quantize_embedding=True`) table; clipped ids (no NaN).
        return quantization.lookup(self.embedding[...], tokens, self.dtype)  # [B, T, E]

    def output_norm(self, x: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        eps = self.config.rms_norm_eps
        return layers.rms_norm(x, self.final_norm[...], eps, numerics=numerics)

    def head_weight(self) -> jax.Array:
        return self.embedding[...] if self.config.tie_word_embeddings else self.lm_head[...]

    def lora_sites(self) -> dict[tuple[int, str], tuple[int, int]]:
        """The projections a LoRA adapter may target, `(layer, PEFT's name) -> (K, N)` of
        the product `[..., K] x [K, N]` (`ll.load_adapter`): every layer's attention
        projections, and the MLP's where it is dense (not a mixture of experts' experts)."""
        c = self.config
        e, h, hkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        out = {}
        for i, block in enumerate(self.layers):
            out |= {(i, "q_proj"): (e, h * d), (i, "k_proj"): (e, hkv * d)}
            out |= {(i, "v_proj"): (e, hkv * d), (i, "o_proj"): (h * d, e)}
            if not getattr(block, "sparse", False):
                f = c.intermediate_size
                out |= {(i, "gate_proj"): (e, f), (i, "up_proj"): (e, f), (i, "down_proj"): (f, e)}
        return out


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


def register_family(model_type: str, parse_config, **fields) -> None:
    """Register a Llama-derived `model_type`: `fields` override the Llama family's
    (`config_class`, `model_class`, `checkpoint_tensors`, `is_ignored_tensor`, ...)."""
    defaults = dict(
        config_class=LlamaConfig,
        model_class=LlamaModel,
        checkpoint_tensors=checkpoint_tensors,
        is_ignored_tensor=is_ignored_tensor,
    )
    registry.register(
        registry.ModelFamily(
            model_type=model_type, parse_config=parse_config, **{**defaults, **fields}
        )
    )


register_family("llama", llama_config_from_hf)
register_family(
    "mistral", functools.partial(llama_config_from_hf, sliding_windows=mistral_sliding_windows)
)
register_family(
    "qwen2",
    functools.partial(
        llama_config_from_hf, sliding_windows=qwen_sliding_windows, qkv_bias_only=True
    ),
)
register_family(
    "qwen3",
    functools.partial(llama_config_from_hf, sliding_windows=qwen_sliding_windows, qk_norm=True),
)
