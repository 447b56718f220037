"""Small random models of the Llama, Gemma and Qwen3-MoE families in a chosen dtype, for
the RL exactness tests (the families `deterministic=True` promises bit-for-bit rollouts
and trainer log-probs for)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import logitloop as ll
from logitloop.models import GemmaConfig, GemmaModel, LlamaConfig, LlamaModel
from logitloop.models.config import MoeConfig
from logitloop.models.moe import MoeModel

VOCAB = 97
MAX_LENGTH = 128
FAMILIES = ("llama", "gemma", "qwen3_moe")


def family_model(family: str, dtype: str = "float32", seed: int = 0):
    """2 layers, 4 query / 2 kv heads of 8, hidden 32; weights 8x the default init (logits
    far from flat, so sampled tokens vary and filters cut); Qwen3-MoE with 8 experts, 3 per
    token and QK-norm, Gemma 2 with soft-capping (global layers: pages shared by n samples need one
    window for every layer)."""
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=MAX_LENGTH,
    )  # fmt: skip
    if family == "llama":
        model = LlamaModel(LlamaConfig(tie_word_embeddings=True, **common),
                           dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))  # fmt: skip
    elif family == "gemma":
        config = GemmaConfig(
            query_pre_attn_scalar=8.0, attn_logit_softcapping=50.0,
            tie_word_embeddings=True, **common,
        )  # fmt: skip
        model = GemmaModel(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
    elif family == "qwen3_moe":
        config = MoeConfig(
            model_type="qwen3_moe", num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=16, norm_topk_prob=True, qk_norm=True, **common,
        )  # fmt: skip
        model = MoeModel(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    for _, p in nnx.iter_graph(model):
        if isinstance(p, nnx.Param) and p[...].ndim > 1:
            p[...] = (p[...].astype(jnp.float32) * 8.0).astype(p[...].dtype)
    return model


def flat_results(results) -> ll.GenerationResult:
    """`generate_many`'s per-request results as one `GenerationResult` of all their rows
    (the fields the exactness checks read), in request order."""
    return ll.GenerationResult(
        token_ids=[t for r in results for t in r.token_ids], finish_reason=[], stop_reason=[],
        num_tokens=[], prompt_token_ids=[p for r in results for p in r.prompt_token_ids],
        logprobs=[x for r in results for x in r.logprobs],
        raw_logprobs=[x for r in results for x in r.raw_logprobs],
    )  # fmt: skip
