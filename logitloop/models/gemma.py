"""Gemma 2 and Gemma 3 (text) in Flax NNX: the Llama decoder with Gemma's changes.

What differs from `llama.py`, each switched by `GemmaConfig`:
  - the embedding is multiplied by sqrt(hidden_size), rounded to the parameter dtype;
  - RMSNorm scales by `1 + weight`, in float32 (`layers.gemma_rms_norm`);
  - each block normalises attention and MLP outputs too (pre- and post-norms);
  - queries are scaled by `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`;
  - attention scores and output logits may be soft-capped (Gemma 2);
  - sliding-window layers alternate with global ones and, in Gemma 3, have their own
    RoPE base (`local_rope`); Gemma 3 adds per-head RMSNorm on queries and keys.
The MLP is Llama's gated one with GELU (tanh) as the config names it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logitloop.models import layers, llama
from logitloop.models.config import GemmaConfig, gemma3_config_from_hf, gemma_config_from_hf
from logitloop.models.fixed_order import PLAIN, Numerics
from logitloop.models.layers import CheckpointTensor


class GemmaBlock(llama.LlamaBlock):
    """Attention and MLP, each between a pre-norm and a post-norm, then the residual."""

    norm_init = "zeros"  # Gemma norms scale by (1 + weight)

    def __init__(self, config: GemmaConfig, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(config, layer, dtype=dtype, rngs=rngs)
        e = config.hidden_size
        self.post_attn_norm = layers.param(rngs, (e,), dtype, ("embed",), init="zeros")
        self.post_mlp_norm = layers.param(rngs, (e,), dtype, ("embed",), init="zeros")
        if config.sliding_windows[layer] is not None:
            self.rope = config.local_rope
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.softcap = config.attn_logit_softcapping

    def norm(self, x: jax.Array, weight: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        return layers.gemma_rms_norm(x, weight, self.config.rms_norm_eps, numerics=numerics)

    def after_attention(self, attn: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        return self.norm(attn, self.post_attn_norm[...], numerics)

    def after_mlp(self, out: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        return self.norm(out, self.post_mlp_norm[...], numerics)


class GemmaModel(llama.LlamaModel):
    """A Gemma 2 / Gemma 3 text causal LM (see the module docstring)."""

    block_class = GemmaBlock

    def embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        # transformers keeps sqrt(hidden) as a float32 buffer and casts it to the weights'
        # dtype before multiplying; so do we.
        scale = jnp.asarray(np.float32(self.config.hidden_size**0.5), self.dtype)
        return super().embed(tokens, positions) * scale

    def output_norm(self, x: jax.Array, numerics: Numerics = PLAIN) -> jax.Array:
        eps = self.config.rms_norm_eps
        return layers.gemma_rms_norm(x, self.final_norm[...], eps, numerics=numerics)

    def output_logits(self, logits: jax.Array) -> jax.Array:
        return layers.soft_cap(logits, self.config.final_logit_softcapping)


def checkpoint_tensors(config: GemmaConfig) -> dict[str, CheckpointTensor]:
    """Llama's tensors, with Gemma's four norms per block."""
    e = config.hidden_size
    out = llama.checkpoint_tensors(config)
    for i in range(config.num_layers):
        hf, t = f"model.layers.{i}.", ("layers", i)
        for name, target in (
            ("post_attention_layernorm", "post_attn_norm"),
            ("pre_feedforward_layernorm", "mlp_norm"),
            ("post_feedforward_layernorm", "post_mlp_norm"),
        ):
            out[hf + name + ".weight"] = CheckpointTensor((*t, target), (e,))
    return out


# A multimodal gemma3 checkpoint stores its language model under one of these prefixes
# (transformers 4 and 5 write the first, in-memory 5.x modules use the second), beside
# the vision tower and projector, which are not loaded.
_GEMMA3_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_GEMMA3_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def gemma3_checkpoint_name(name: str) -> str:
    """A multimodal gemma3 tensor name -> the gemma3_text name of the same tensor."""
    for prefix, replacement in _GEMMA3_TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    return name


def gemma3_is_ignored_tensor(name: str, config: GemmaConfig) -> bool:
    return name.startswith(_GEMMA3_VISION_PREFIXES) or llama.is_ignored_tensor(name, config)


def _register(model_type: str, parse_config, **fields) -> None:
    llama.register_family(
        model_type,
        parse_config,
        config_class=GemmaConfig,
        model_class=GemmaModel,
        checkpoint_tensors=checkpoint_tensors,
        **fields,
    )


_register("gemma2", gemma_config_from_hf)
_register("gemma3_text", gemma_config_from_hf)
_register(
    "gemma3",
    gemma3_config_from_hf,
    checkpoint_name=gemma3_checkpoint_name,
    is_ignored_tensor=gemma3_is_ignored_tensor,
)
