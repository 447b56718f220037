"""A tunix LoRA policy for tests: tunix's own Llama 3 (`tunix.models.llama3`), Gemma 2
or Gemma 3 loaded from a tiny checkpoint, under qwix's `LoraProvider` on
every attention and MLP projection (attention at rank 4, MLP at rank 8: a rank per
rule), with every LoRA parameter random and non-zero (qwix starts B at zero), and its
own forward (`tunix_greedy`), the reference."""

from __future__ import annotations

import numpy as np

ALPHA = 6.0


def lora_policy(folder, hf_config, seed: int):
    """`(policy, lora state)`: tunix's Llama 3 of the checkpoint in `folder` with qwix LoRA
    on every projection, its LoRA parameters drawn from `seed`."""
    import jax.numpy as jnp
    from tunix.models.llama3 import model as tunix_llama
    from tunix.models.llama3 import params as tunix_params

    c = hf_config
    config = tunix_llama.ModelConfig(
        num_layers=c.num_hidden_layers, vocab_size=c.vocab_size, embed_dim=c.hidden_size,
        hidden_dim=c.intermediate_size, num_heads=c.num_attention_heads,
        head_dim=c.hidden_size // c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        rope_theta=int(c.rope_parameters["rope_theta"]), norm_eps=c.rms_norm_eps,
        weight_tying=c.tie_word_embeddings,
    )  # fmt: skip
    base = tunix_params.create_model_from_safe_tensors(str(folder), config, dtype=jnp.float32)
    return _with_lora(base, ".*attn/(q|k|v|o)_proj", seed)


def gemma_lora_policy(folder, hf_config, seed: int):
    """`(policy, lora state)`: tunix's Gemma 2 (`tunix.models.gemma`) or Gemma 3
    (`gemma3`) of the checkpoint in `folder` with qwix LoRA on its attention einsums
    (`qkv_einsum` when it has as many key/value heads as query heads, else `q_einsum` and
    `kv_einsum`; `attn_vec_einsum`) and MLP. tunix's Gemma ties its head, scales queries
    by `head_dim ** -0.5`, and Gemma 2's rotates by theta 10000, Gemma 3's makes every
    sixth layer global: the checkpoint must too."""
    import jax.numpy as jnp

    c = hf_config
    sizes = dict(
        num_layers=c.num_hidden_layers, num_embed=c.vocab_size, embed_dim=c.hidden_size,
        hidden_dim=c.intermediate_size, num_heads=c.num_attention_heads, head_dim=c.head_dim,
        num_kv_heads=c.num_key_value_heads, sliding_window_size=c.sliding_window,
    )  # fmt: skip
    if c.model_type == "gemma2":
        from tunix.models.gemma import model, params_safetensors

        kinds = (model.AttentionType.LOCAL_SLIDING, model.AttentionType.GLOBAL)
        config = model.ModelConfig(
            **sizes, final_logit_softcap=c.final_logit_softcapping,
            use_post_attn_norm=True, use_post_ffw_norm=True,
            attention_types=[kinds[i % 2] for i in range(c.num_hidden_layers)],
            attn_logits_soft_cap=c.attn_logit_softcapping,
        )  # fmt: skip
    else:
        from tunix.models.gemma3 import model, params_safetensors

        local, full = (c.rope_parameters[k] for k in ("sliding_attention", "full_attention"))
        config = model.ModelConfig(
            **sizes, local_base_frequency=local["rope_theta"],
            global_base_frequency=full["rope_theta"],
            global_scale_factor=full.get("factor", 1.0), param_dtype=jnp.float32,
        )  # fmt: skip
    base = params_safetensors.create_model_from_safe_tensors(str(folder), config, dtype=jnp.float32)
    return _with_lora(base, ".*attn/(q|kv|qkv|attn_vec)_einsum", seed)


def _with_lora(base, attention: str, seed: int):
    """`(policy, lora state)`: tunix model `base` under qwix LoRA on the attention modules
    matching `attention` (rank 4) and the MLP's (rank 8), its LoRA drawn from `seed`."""
    import jax.numpy as jnp
    import qwix
    from flax import nnx

    provider = qwix.LoraProvider(
        [
            qwix.LoraRule(module_path=attention, rank=4, alpha=ALPHA),
            qwix.LoraRule(module_path=".*mlp/(gate|up|down)_proj", rank=8, alpha=ALPHA),
        ]
    )
    tokens = jnp.zeros((1, 4), jnp.int32)
    policy = qwix.apply_lora_to_model(
        base, provider, tokens, jnp.arange(4)[None], None, _causal(1, 4), rngs=nnx.Rngs(0)
    )
    return policy, randomize(policy, seed)


def randomize(policy, seed: int):
    """Draw the policy's LoRA parameters afresh from `seed` (as a trainer's update
    would change them); returns the new LoRA state."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rng = np.random.default_rng(seed)
    state = nnx.state(policy, nnx.LoRAParam)
    drawn = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype), state)
    nnx.update(policy, drawn)
    return nnx.state(policy, nnx.LoRAParam)


def _causal(batch: int, length: int):
    import jax.numpy as jnp

    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))


def tunix_greedy(
    policy, prompt: list[int], n: int, rope_theta: float | None = None
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from the tunix model's own forward
    (qwix's LoRA products), one full pass per token, in float64 after the logits.
    tunix's Llama 3 rotates by theta 1e6 whatever its config says (its attention calls
    `apply_rope` without `rope_theta`): a Llama checkpoint's `rope_theta` is given to it
    here (None: a Gemma, run as it is)."""
    import contextlib
    import functools
    from unittest import mock

    import jax.numpy as jnp
    from tunix.models.llama3 import model as tunix_llama

    rope = functools.partial(tunix_llama.apply_rope, rope_theta=rope_theta)
    patch = mock.patch.object(tunix_llama, "apply_rope", rope)
    ids, lps = list(prompt), []
    with patch if rope_theta is not None else contextlib.nullcontext():
        for _ in range(n):
            t = len(ids)
            logits, _ = policy(jnp.asarray([ids]), jnp.arange(t)[None], None, _causal(1, t))
            row = np.asarray(logits[0, -1], np.float64)
            lp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
            tok = int(lp.argmax())
            ids.append(tok)
            lps.append(float(lp[tok]))
    return ids[len(prompt) :], lps
