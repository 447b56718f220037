"""Your own model on logitloop's fast path: a small Llama-style decoder written here, in
Flax NNX, with none of logitloop's model code (docs/own_model.md).

    python examples/own_model.py
    python examples/own_model.py --temperature 0 --max-tokens 8

Everything but attention is the model's own: the embedding, RMSNorm (as Hugging Face
computes it), RoPE at each token's `positions`, the SwiGLU MLP, the final norm and the LM
head. Its attention is one call, `ll.attention(q, k, v, kv, layer=i)`: the library writes
the keys and values into its cache (contiguous rows, or a paged pool whose pages rows
share) and attends over them. Its products go through `ll.dense(x, w, kv)`, its LM head
through `ll.lm_head(x, table, kv)` and its norms' means through `ll.mean(x, kv)`, so that
`deterministic=True` keeps a row's bits whatever its batch. Its projections name
themselves (`ll.dense(..., lora=(layer, "q_proj"))`), so rows can run LoRA adapters
(`ll.load_adapter(module, ...)`, docs/lora.md); it marks its residual stream after each
block with `ll.residual(x, kv, layer=i)`, so rows can be steered and their states
captured (docs/inside.md). With `kv=None` the same module is a plain
causal forward, for training.

The script builds the model with random weights, wraps it with `ll.from_nnx`, samples
`n = 4` completions of one prompt (prefilled once; the four rows share its pages), and
runs a few requests of different lengths through `ll.generate_many` with continuous
batching on a paged pool. `from_llama` loads the weights of a logitloop `LlamaModel` into
this module (the test and `scripts/bench_own_model.py` compare the two).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import logitloop as ll


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 128
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention: 2 query heads per key/value head
    head_dim: int = 8
    ffn: int = 64
    rope_theta: float = 10000.0
    eps: float = 1e-5
    tied: bool = False  # True: the LM head is the embedding


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate `x [B, T, heads, D]` by each token's position (HF's rotate-half layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    rotated = jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


def param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float | None = None) -> nnx.Param:
    """Random normal weights of standard deviation `scale` (default 1 / sqrt(fan-in))."""
    scale = shape[0] ** -0.5 if scale is None else scale
    return nnx.Param((scale * jax.random.normal(rngs.params(), shape)).astype(dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, kv: ll.KV | None) -> jax.Array:
        # As transformers: float32 statistics, cast back to x's dtype before the scale.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(ll.mean(x32 * x32, kv) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


# PEFT's names of a Llama block's projections -> this module's weights.
PROJECTIONS = dict(
    q_proj="wq", k_proj="wk", v_proj="wv", o_proj="wo",
    gate_proj="w_gate", up_proj="w_up", down_proj="w_down",
)  # fmt: skip


class Block(nnx.Module):
    def __init__(self, c: Config, layer: int, dtype, rngs: nnx.Rngs):
        e, q, kv = c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim
        self.attn_norm, self.mlp_norm = RMSNorm(e, c.eps, dtype), RMSNorm(e, c.eps, dtype)
        self.wq, self.wo = param(rngs, (e, q), dtype), param(rngs, (q, e), dtype)
        self.wk, self.wv = param(rngs, (e, kv), dtype), param(rngs, (e, kv), dtype)
        self.w_gate, self.w_up = param(rngs, (e, c.ffn), dtype), param(rngs, (e, c.ffn), dtype)
        self.w_down = param(rngs, (c.ffn, e), dtype)
        self.config, self.layer = c, layer

    def dense(self, x, name, kv):
        """`x @ w` of projection `name` (PEFT's), plus each row's LoRA adapter where the
        pass carries one (`ll.dense(..., lora=)`, docs/lora.md)."""
        w = getattr(self, PROJECTIONS[name])[...]
        return ll.dense(x, w, kv, lora=(self.layer, name))

    def __call__(self, x, positions, kv):
        c, (b, t, _) = self.config, x.shape
        h = self.attn_norm(x, kv)
        q = self.dense(h, "q_proj", kv).reshape(b, t, c.heads, c.head_dim)
        k = self.dense(h, "k_proj", kv).reshape(b, t, c.kv_heads, c.head_dim)
        v = self.dense(h, "v_proj", kv).reshape(b, t, c.kv_heads, c.head_dim)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        out, kv = ll.attention(q, k, v, kv, layer=self.layer)  # the library's cache
        x = x + self.dense(out.reshape(b, t, -1), "o_proj", kv)
        h = self.mlp_norm(x, kv)
        gate, up = self.dense(h, "gate_proj", kv), self.dense(h, "up_proj", kv)
        return x + self.dense(jax.nn.silu(gate) * up, "down_proj", kv), kv


class TinyDecoder(nnx.Module):
    """`model(tokens [B, T], positions [B, T], kv) -> (logits [B, T, V] float32, kv)`
    (`[B, V]`, the last column's, when the pass reads no other: `kv.all_columns`)."""

    def __init__(self, config: Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.embedding = param(rngs, (c.vocab_size, c.hidden), dtype, scale=1.0)
        self.blocks = nnx.List([Block(c, i, dtype, rngs) for i in range(c.layers)])
        self.norm = RMSNorm(c.hidden, c.eps, dtype)
        if not c.tied:
            self.lm_head = param(rngs, (c.vocab_size, c.hidden), dtype, scale=c.hidden**-0.5)
        self.config, self.dtype = c, jnp.dtype(dtype)

    @property
    def kv_spec(self) -> ll.KVSpec:
        """What the library keeps per token and layer: the keys and values of every block."""
        c = self.config
        return ll.KVSpec(c.layers, c.kv_heads, c.head_dim, self.dtype)

    def lora_sites(self) -> dict[tuple[int, str], tuple[int, int]]:
        """The projections a LoRA adapter may target, `(layer, name) -> (K, N)` of each
        `ll.dense(..., lora=(layer, name))` (`ll.load_adapter(module, ...)` reads it)."""
        return {
            (b.layer, name): tuple(getattr(b, w).shape)
            for b in self.blocks
            for name, w in PROJECTIONS.items()
        }

    def __call__(self, tokens, positions, kv):
        x = self.embedding[...][tokens]  # padding columns (positions -1) are never read
        for block in self.blocks:
            x, kv = block(x, positions, kv)
            x, kv = ll.residual(x, kv, layer=block.layer)  # steering and capture (contract 2)
        if kv is not None and not kv.all_columns:  # a prompt pass or a decode step:
            x = x[:, -1]  # only the last column's logits are read, [B, V]
        table = self.embedding[...] if self.config.tied else self.lm_head[...]
        return ll.lm_head(self.norm(x, kv), table, kv), kv  # float32 logits


def from_llama(llama) -> TinyDecoder:
    """This module with the weights of a logitloop `LlamaModel` (plain Llama: no biases,
    q/k norms, sliding windows or RoPE scaling), which keeps its heads split."""
    c = llama.config
    extras = (c.qkv_bias, c.o_bias, c.mlp_bias, c.qk_norm, any(c.sliding_windows))
    if any(extras) or c.rope.rope_type != "default" or c.hidden_act != "silu":
        raise ValueError("from_llama takes a plain Llama config (see its docstring)")
    config = Config(
        c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
        c.intermediate_size, c.rope.theta, c.rms_norm_eps, c.tie_word_embeddings,
    )  # fmt: skip
    model = nnx.eval_shape(lambda: TinyDecoder(config, dtype=llama.dtype, rngs=nnx.Rngs(0)))
    model.embedding.set_value(llama.embedding[...])
    model.norm.weight.set_value(llama.final_norm[...])
    if not c.tie_word_embeddings:
        model.lm_head.set_value(llama.lm_head[...])
    for mine, theirs in zip(model.blocks, llama.layers, strict=True):
        mine.attn_norm.weight.set_value(theirs.attn_norm[...])
        mine.mlp_norm.weight.set_value(theirs.mlp_norm[...])
        for name in ("wq", "wk", "wv"):  # [E, heads, D] -> [E, heads * D]
            getattr(mine, name).set_value(getattr(theirs, name)[...].reshape(c.hidden_size, -1))
        mine.wo.set_value(theirs.wo[...].reshape(-1, c.hidden_size))  # [H, D, E] -> [H * D, E]
        for name in ("w_gate", "w_up", "w_down"):
            getattr(mine, name).set_value(getattr(theirs, name)[...])
    return model


def main(argv=None) -> dict:
    """Build, wrap, generate; returns the `model` (`ll.from_nnx`'s), the token ids of
    `samples` (the `n = 4` rows) and `batch` (one list per `generate_many` request), with
    the `prompt` and the `requests`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=2, help="of the random weights")
    args = parser.parse_args(argv)

    module = TinyDecoder(Config(), rngs=nnx.Rngs(args.seed))
    model = ll.from_nnx(module, vocab_size=Config.vocab_size, max_length=64)  # its kv_spec

    rng = np.random.default_rng(0)
    prompt = rng.integers(1, Config.vocab_size, 9).tolist()
    knobs = dict(temperature=args.temperature, max_tokens=args.max_tokens, seed=1)
    samples = ll.generate(model, [prompt], n=4, ignore_eos=True, **knobs)  # shared pages
    print(f"n = 4 samples of one {len(prompt)}-token prompt:")
    for row in samples.token_ids:
        print("  ", row)

    # Continuous batching: 5 requests of different lengths through 2 slots, on a paged
    # pool of 64 tokens in pages of 8 (rows admitted as pages free up).
    requests = [(rng.integers(1, Config.vocab_size, n).tolist(), {"max_tokens": m})
                for n, m in ((3, 4), (11, args.max_tokens), (6, 2), (14, 6), (5, 3))]  # fmt: skip
    results = ll.generate_many(
        model, requests, slots=2, chunk_steps=4, kv_cache_tokens=64, page_size=8,
        max_prompt_len=16, max_tokens_bound=max(args.max_tokens, 6), temperature=args.temperature,
        seed=1, ignore_eos=True,
    )  # fmt: skip
    print(f"generate_many: {len(requests)} requests through 2 slots:")
    for (p, _), r in zip(requests, results, strict=True):
        print(f"   prompt of {len(p):2d} -> {r.num_tokens[0]:2d} tokens ({r.finish_reason[0]})")
    batch = [r.token_ids[0] for r in results]
    return dict(model=model, prompt=prompt, samples=samples.token_ids, requests=requests,
                batch=batch)  # fmt: skip


if __name__ == "__main__":
    main()
