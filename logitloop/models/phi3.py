"""Phi-3 (`phi3`): the Llama decoder, read from Phi-3's fused checkpoint tensors.

Phi-3 computes exactly what a Llama block does; its checkpoint differs. `qkv_proj` holds
the query, key and value projections stacked along the output axis (`[(H + 2 Hkv) D, E]`)
and `gate_up_proj` the MLP's gate and up projections (`[2 F, E]`, gate first). The loader
splits each into the separate head-split parameters of `LlamaBlock`, so the heads and MLP
axes shard over the mesh like any Llama's. What Phi-3 adds lives in RoPE (`layers`):
"longrope" scaling (short and long per-frequency factors, an attention factor on cos and
sin) and partial rotary embeddings (`partial_rotary_factor`, Phi-4-mini). A
`sliding_window`, when the config sets one, applies to every layer, as in Mistral.
"""

from __future__ import annotations

import dataclasses

from logitloop.models import llama
from logitloop.models.config import (
    HFConfig,
    LlamaConfig,
    llama_config_from_hf,
    mistral_sliding_windows,
)
from logitloop.models.layers import CheckpointTensor


def phi3_config_from_hf(hf: HFConfig) -> LlamaConfig:
    """A `LlamaConfig` from a phi3 `config.json` (rotary fraction from `rope_parameters` or
    the top level)."""
    config = llama_config_from_hf(hf, sliding_windows=mistral_sliding_windows)
    params = hf.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary = int(config.head_dim * partial)
    if not 0 < partial <= 1 or rotary % 2:
        raise ValueError(
            f"{hf.source}: partial_rotary_factor = {partial} must be in (0, 1] and rotate an "
            f"even number of the {config.head_dim} channels per head"
        )
    rope = dataclasses.replace(config.rope, partial_rotary_factor=partial)
    for name in ("short_factor", "long_factor"):
        if rope.rope_type == "longrope" and len(getattr(rope, name)) != rotary // 2:
            raise ValueError(
                f"{hf.source}: RoPE {name} has {len(getattr(rope, name))} entries; the "
                f"{rotary} rotated channels per head need {rotary // 2}"
            )
    return dataclasses.replace(config, rope=rope)


def checkpoint_tensors(config: LlamaConfig) -> dict[str, CheckpointTensor]:
    """Llama's tensors with q/k/v and gate/up each fused into one."""
    c = config
    e, h, hkv, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    out = llama.checkpoint_tensors(config)

    def split_qkv(w):  # [(H + 2 Hkv) D, E] -> [E, H, D], [E, Hkv, D], [E, Hkv, D]
        w = w.T.reshape(e, h + 2 * hkv, d)
        return w[:, :h], w[:, h : h + hkv], w[:, h + hkv :]

    def split_gate_up(w):  # [2 F, E] -> [E, F], [E, F]
        return w[:f].T, w[f:].T

    for i in range(c.num_layers):
        hf, t = f"model.layers.{i}.", ("layers", i)
        for name in ("q", "k", "v"):
            del out[hf + f"self_attn.{name}_proj.weight"]
        del out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"]
        out[hf + "self_attn.qkv_proj.weight"] = CheckpointTensor(
            (*t, "wq"), ((h + 2 * hkv) * d, e), split_qkv, more_targets=((*t, "wk"), (*t, "wv"))
        )
        out[hf + "mlp.gate_up_proj.weight"] = CheckpointTensor(
            (*t, "w_gate"), (2 * f, e), split_gate_up, more_targets=((*t, "w_up"),)
        )
    return out


llama.register_family("phi3", phi3_config_from_hf, checkpoint_tensors=checkpoint_tensors)
