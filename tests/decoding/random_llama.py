"""A small random Llama (grouped-query attention, tied head) for decode-loop tests."""

from __future__ import annotations

from typing import Any

from flax import nnx

from logitloop.models import LlamaConfig, LlamaModel


def small_llama(vocab_size: int, max_length: int, seed: int, **config: Any) -> LlamaModel:
    """2 layers, 4 query / 2 kv heads of 8; weights 25x the default init, so that the logits
    are far from ties and greedy tokens are stable. `config`: other `LlamaConfig` fields."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=max_length,
        tie_word_embeddings=True,
        **config,
    )
    model = LlamaModel(config, rngs=nnx.Rngs(seed))
    for _, p in nnx.iter_graph(model):
        if isinstance(p, nnx.Param) and p[...].ndim > 1:
            p[...] = p[...] * 25.0
    return model
