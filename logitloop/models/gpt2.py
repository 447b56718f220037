"""GPT-2 in Flax NNX.

Learned absolute positions, pre-LayerNorm blocks, a fused q/k/v projection, a GELU MLP
and an LM head tied to the token embedding. Hugging Face stores GPT-2's projections as
`Conv1D` weights, `[in, out]`, which is already the `x @ w` layout used here; loading only
reshapes the q/k/v and output projections into their head-split forms.

Logical axis names on the parameters:
  "vocab", "embed", "mlp", "heads", "head_dim" (and None for the q/k/v index and the
  position axis, which are not sharded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from logitloop.models import kv as kv_contract
from logitloop.models import layers, quantization, registry
from logitloop.models.config import GPT2Config, gpt2_config_from_hf
from logitloop.models.decoder import DecoderModel
from logitloop.models.fixed_order import PLAIN, Numerics
from logitloop.models.kv import KV
from logitloop.models.layers import CheckpointTensor


class GPT2Block(nnx.Module):
    """One block: LayerNorm, causal self-attention, LayerNorm, GELU MLP; both residual."""

    def __init__(self, config: GPT2Config, layer_index: int, *, dtype, rngs: nnx.Rngs):
        c = config
        e, h, d, f = c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size

        def p(shape, names, init="normal"):
            return layers.param(rngs, shape, dtype, names, init=init)

        self.ln_1_scale = p((e,), ("embed",), "ones")
        self.ln_1_bias = p((e,), ("embed",), "zeros")
        self.w_qkv = p((e, 3, h, d), ("embed", None, "heads", "head_dim"))
        self.b_qkv = p((3, h, d), (None, "heads", "head_dim"), "zeros")
        self.wo = p((h, d, e), ("heads", "head_dim", "embed"))
        self.bo = p((e,), ("embed",), "zeros")
        self.ln_2_scale = p((e,), ("embed",), "ones")
        self.ln_2_bias = p((e,), ("embed",), "zeros")
        self.w_fc = p((e, f), ("embed", "mlp"))
        self.b_fc = p((f,), ("mlp",), "zeros")
        self.w_proj = p((f, e), ("mlp", "embed"))
        self.b_proj = p((e,), ("embed",), "zeros")
        self.config = config
        scale = c.head_dim**-0.5 if c.scale_attn_weights else 1.0
        if c.scale_attn_by_inverse_layer_idx:
            scale /= layer_index + 1
        self.scale = scale
        self.layer = layer_index  # its index in the KVSpec (`ll.attention(..., layer=)`)

    def __call__(
        self,
        x: jax.Array,  # [B, T, E]
        positions: jax.Array,  # [B, T] int, -1 for padding
        kv: KV | None,  # the pass's cache (`ll.attention`)
        *,
        numerics: Numerics = PLAIN,  # the pass's (`fixed_order.Numerics`)
    ) -> tuple[jax.Array, KV | None]:
        c = self.config
        num = dict(numerics=numerics)
        h = layers.layer_norm(x, self.ln_1_scale[...], self.ln_1_bias[...], c.layer_norm_eps, **num)
        qkv = layers.split_heads(h, self.w_qkv[...], **num) + self.b_qkv[...]  # [B, T, 3, H, D]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attn, kv = kv_contract.attention(q, k, v, kv, layer=self.layer, scale=self.scale)
        x = x + layers.merge_heads(attn, self.wo[...], **num) + self.bo[...]

        h = layers.layer_norm(x, self.ln_2_scale[...], self.ln_2_bias[...], c.layer_norm_eps, **num)
        h = layers.activation(c.hidden_act, layers.dense(h, self.w_fc[...], **num) + self.b_fc[...])
        out = layers.dense(h, self.w_proj[...], groups=c.intermediate_size, **num)
        return x + out + self.b_proj[...], kv  # [B, T, E]


class GPT2Model(DecoderModel):
    """GPT-2 causal LM: learned positions, LayerNorm, an LM head tied to the embedding.

    Attributes:
      config: the `GPT2Config`.
      tokenizer: a `logitloop.models.Tokenizer`, or None.
      dtype: the parameter dtype; activations are computed in it, logits come back float32.
    """

    def __init__(self, config: GPT2Config, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        super().__init__(config, dtype=dtype)
        c = config
        self.wte = layers.param(rngs, (c.vocab_size, c.hidden_size), dtype, ("vocab", "embed"))
        self.wpe = layers.param(
            rngs, (c.max_position_embeddings, c.hidden_size), dtype, (None, "embed"), stddev=0.01
        )
        self.layers = nnx.List(
            [GPT2Block(c, i, dtype=dtype, rngs=rngs) for i in range(c.num_layers)]
        )
        self.ln_f_scale = layers.param(rngs, (c.hidden_size,), dtype, ("embed",), init="ones")
        self.ln_f_bias = layers.param(rngs, (c.hidden_size,), dtype, ("embed",), init="zeros")

    def embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        x = quantization.lookup(self.wte[...], tokens, self.dtype)  # [B, T, E]
        return x + jnp.take(self.wpe[...], jnp.maximum(positions, 0), axis=0, mode="clip")

    def output_norm(self, x: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        c = self.config
        return layers.layer_norm(
            x, self.ln_f_scale[...], self.ln_f_bias[...], c.layer_norm_eps, numerics=numerics
        )

    def head_weight(self) -> jax.Array:
        return self.wte[...]


def checkpoint_tensors(config: GPT2Config) -> dict[str, CheckpointTensor]:
    """Every tensor a Hugging Face GPT-2 checkpoint must hold, by name.

    Names are given without the `transformer.` prefix that `GPT2LMHeadModel` adds; the
    loader strips it (the original OpenAI-converted checkpoints have no prefix).
    """
    c = config
    e, h, d, f = c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size
    out = {
        "wte.weight": CheckpointTensor(("wte",), (c.vocab_size, e)),
        "wpe.weight": CheckpointTensor(("wpe",), (c.max_position_embeddings, e)),
        "ln_f.weight": CheckpointTensor(("ln_f_scale",), (e,)),
        "ln_f.bias": CheckpointTensor(("ln_f_bias",), (e,)),
    }
    for i in range(c.num_layers):
        hf = f"h.{i}."
        t = ("layers", i)
        out.update(
            {
                hf + "ln_1.weight": CheckpointTensor((*t, "ln_1_scale"), (e,)),
                hf + "ln_1.bias": CheckpointTensor((*t, "ln_1_bias"), (e,)),
                # Conv1D [E, 3E]: output index = which * E + head * D + dim.
                hf + "attn.c_attn.weight": CheckpointTensor(
                    (*t, "w_qkv"), (e, 3 * e), lambda w: w.reshape(e, 3, h, d)
                ),
                hf + "attn.c_attn.bias": CheckpointTensor(
                    (*t, "b_qkv"), (3 * e,), lambda b: b.reshape(3, h, d)
                ),
                hf + "attn.c_proj.weight": CheckpointTensor(
                    (*t, "wo"), (e, e), lambda w: w.reshape(h, d, e)
                ),
                hf + "attn.c_proj.bias": CheckpointTensor((*t, "bo"), (e,)),
                hf + "ln_2.weight": CheckpointTensor((*t, "ln_2_scale"), (e,)),
                hf + "ln_2.bias": CheckpointTensor((*t, "ln_2_bias"), (e,)),
                hf + "mlp.c_fc.weight": CheckpointTensor((*t, "w_fc"), (e, f)),
                hf + "mlp.c_fc.bias": CheckpointTensor((*t, "b_fc"), (f,)),
                hf + "mlp.c_proj.weight": CheckpointTensor((*t, "w_proj"), (f, e)),
                hf + "mlp.c_proj.bias": CheckpointTensor((*t, "b_proj"), (e,)),
            }
        )
    return out


def checkpoint_name(name: str) -> str:
    """The checkpoint name as `checkpoint_tensors` spells it (no `transformer.` prefix)."""
    return name.removeprefix("transformer.")


def is_ignored_tensor(name: str, config: GPT2Config) -> bool:
    """Tensors some GPT-2 checkpoints carry that the model does not use."""
    # Older checkpoints saved the causal-mask buffers; the head is always tied.
    return name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight"


registry.register(
    registry.ModelFamily(
        model_type="gpt2",
        config_class=GPT2Config,
        parse_config=gpt2_config_from_hf,
        model_class=GPT2Model,
        checkpoint_tensors=checkpoint_tensors,
        checkpoint_name=checkpoint_name,
        is_ignored_tensor=is_ignored_tensor,
    )
)
