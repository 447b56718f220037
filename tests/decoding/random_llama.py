"""A small random Llama (grouped-query attention, tied head) for decode-loop tests, and a
Gemma-2-style one (local and global layers, soft-capping)."""

from __future__ import annotations

from typing import Any

from flax import nnx

from logitloop.models import GemmaConfig, GemmaModel, LlamaConfig, LlamaModel


def small_llama(
    vocab_size: int,
    max_length: int,
    seed: int,
    *,
    gemma: bool = False,
    dtype: Any = None,
    **config: Any,
) -> LlamaModel:
    """2 layers, 4 query / 2 kv heads of 8; weights 25x the default init, so that the logits
    are far from ties and greedy tokens are stable. `config`: other `LlamaConfig` fields.
    `gemma`: a `GemmaModel` (`small_gemma`). `dtype`: the parameters' (default float32)."""
    config_class, model_class = (GemmaConfig, GemmaModel) if gemma else (LlamaConfig, LlamaModel)
    config = config_class(
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
    kw = {} if dtype is None else {"dtype": dtype}
    model = model_class(config, rngs=nnx.Rngs(seed), **kw)
    for _, p in nnx.iter_graph(model):
        if isinstance(p, nnx.Param) and p[...].ndim > 1:
            p[...] = p[...] * 25.0
    return model


def small_gemma(vocab_size: int, max_length: int, seed: int, **config: Any) -> GemmaModel:
    """`small_llama` as Gemma 2 builds it (`config`: other `GemmaConfig` fields, e.g.
    `sliding_windows` mixing local and global layers), with attention soft-capping."""
    config = dict(query_pre_attn_scalar=8.0, attn_logit_softcapping=50.0) | config
    return small_llama(vocab_size, max_length, seed, gemma=True, **config)
