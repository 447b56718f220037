"""Tiny random `transformers` models and helpers shared by the model tests.

Every model here is built from a config (nothing is downloaded) with weights far larger
than HF's default init (`initializer_range=0.3`, not 0.02): with small weights the logits
are almost flat, and tied-embedding models just repeat their input token, so greedy
decoding would test little.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Each case: (transformers config class, causal-LM class, config kwargs). Across the cases
# tie_word_embeddings is both true and false, GQA and MHA both appear, and every RoPE
# variant, sliding-window layout and bias switch the implementation has is exercised.
_LLAMA_SIZES = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
)

_GEMMA_SIZES = dict(
    _LLAMA_SIZES,
    num_hidden_layers=4,
    head_dim=16,
    sliding_window=5,
    query_pre_attn_scalar=24,  # not head_dim
    pad_token_id=0,
)

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA_SIZES, tie_word_embeddings=False)),
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            _LLAMA_SIZES,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            # head_dim 16: wavelengths 6.3 .. 5e3; with these factors the shortest is in
            # the interpolated band, one is kept and the rest are slowed by `factor`.
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(_LLAMA_SIZES, tie_word_embeddings=False, sliding_window=6, head_dim=16),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            _LLAMA_SIZES,
            tie_word_embeddings=True,
            num_key_value_heads=4,
            rope_parameters=dict(rope_type="linear", rope_theta=1000.0, factor=2.0),
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            _LLAMA_SIZES,
            tie_word_embeddings=False,
            head_dim=32,  # not hidden_size // num_heads
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,  # layer 0 full attention, layer 1 sliding
        ),
    ),
    # Gemma: window 5 < the prompts (5, 13, 9); sliding and global layers alternate.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            _GEMMA_SIZES,
            tie_word_embeddings=False,
            attn_logit_softcapping=3.0,  # small caps, so that both bite
            final_logit_softcapping=5.0,
            rope_parameters=dict(rope_type="default", rope_theta=500.0),
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _GEMMA_SIZES,
            tie_word_embeddings=True,
            sliding_window_pattern=2,  # layers 0, 2 local; 1, 3 global
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", rope_theta=5000.0, factor=2.0),
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
            ),
        ),
    ),
    # Phi-3: fused qkv / gate_up; longrope with an original context (4) shorter than every
    # prompt, so that all rows use the long factors and the attention factor (sqrt(3));
    # half of each head rotated; a window. test_phi3.py covers the short factors.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            _LLAMA_SIZES,
            tie_word_embeddings=False,
            head_dim=16,
            sliding_window=7,
            pad_token_id=0,
            max_position_embeddings=64,
            original_max_position_embeddings=4,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=1000.0,
                partial_rotary_factor=0.5,
                short_factor=[1.0, 1.5, 2.0, 2.5],
                long_factor=[2.0, 3.0, 5.0, 9.0],
            ),
        ),
    ),
    # Mixtures: 8 experts. Mixtral routes 3 rows x top-2 = 6 < 8 tokens per decode step, so
    # decoding takes the gathered-experts path; Qwen3-MoE's 3 x 3 = 9 takes the dense one.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            _LLAMA_SIZES,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=6,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _LLAMA_SIZES,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],  # layers 0 and 2 sparse, layer 1 a dense MLP of width 96
            tie_word_embeddings=False,
        ),
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=150,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=96,
            initializer_range=0.3,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
}


def build_hf_model(case: str, seed: int = 0, **overrides):
    """A randomly initialised, eval-mode float32 `transformers` model for `case` (its
    config kwargs with `overrides`)."""
    import torch
    import transformers

    config_cls, model_cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**(kwargs | overrides))
    model = getattr(transformers, model_cls)(config)
    if config_cls.startswith("Gemma"):
        # HF starts Gemma's (1 + weight) norms at weight 0; make them random so a norm
        # that forgot the 1, or the weight, shows. Larger post-norms keep the blocks from
        # being drowned by the sqrt(hidden)-scaled embedding (greedy would only repeat).
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3).add_(3.0 if ".post_" in name else 0.0)
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        # Gemma 2 caps its attention logits (gemma_pytorch: scores = cap * tanh(scores / cap)
        # before the mask and softmax), which only HF's eager attention applies. transformers
        # 5.12.1 (tunix's pin) defaults Gemma 2 to sdpa, which drops the cap without a word;
        # 5.25 defaults to eager and makes sdpa refuse a softcap. Eager on every version.
        model.set_attn_implementation("eager")
    return model.eval()


def save_hf_model(model, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def left_pad(prompts: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts to `length`: tokens `[B, T]` (pad 0) and positions (pad -1)."""
    tokens = np.zeros((len(prompts), length), np.int32)
    positions = np.full((len(prompts), length), -1, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, length - len(prompt) :] = prompt
        positions[row, length - len(prompt) :] = np.arange(len(prompt))
    return tokens, positions


def jitted_forward(model):
    """`forward(tokens, positions, cache)` compiled once per shape, as the decode loop uses it."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache)

    return lambda tokens, positions, cache: forward(state, tokens, positions, cache)


def greedy_generate(
    model, prompts: list[list[int]], num_tokens: int, bucket: int, forward=None
) -> np.ndarray:
    """Greedy tokens `[B, num_tokens]` through the model protocol: one left-padded prefill,
    then one column per step at each row's own next position.

    `forward` is `jitted_forward(model)`, passed in to reuse its compilations."""
    forward = jitted_forward(model) if forward is None else forward
    tokens, positions = left_pad(prompts, bucket)
    cache = model.init_cache(len(prompts), bucket + num_tokens)
    logits, cache = forward(jnp.asarray(tokens), jnp.asarray(positions), cache)
    next_position = jnp.asarray([len(p) for p in prompts], jnp.int32)  # [B]
    out = []
    for _ in range(num_tokens):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, V] -> [B]
        out.append(token)
        logits, cache = forward(token[:, None], next_position[:, None], cache)
        next_position = next_position + 1
    return np.stack([np.asarray(t) for t in out], axis=1)


def random_prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in lengths]


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "naïve café résumé — déjà vu, über straße",
    "日本語のテキストと 🙂 emoji, and ASCII again.",
    "def main():\n    return 42\n",
]


def byte_level_bpe(vocab_size: int = 320):
    """A small GPT-2-style byte-level BPE `tokenizers.Tokenizer`, trained on `CORPUS`.

    Ids 0 and 1 are the special tokens <|endoftext|> and <|pad|>; the 256 byte symbols
    follow, then the merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok
