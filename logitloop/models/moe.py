"""Mixtures of experts in Flax NNX: Mixtral and Qwen3-MoE on the Llama decoder.

Attention is the Llama block's (Mistral's for Mixtral, Qwen3's with QK-norm for
Qwen3-MoE); the MLP of each sparse layer becomes `num_experts` gated MLPs and a router:

    probs   = softmax(h @ router)                  float32, [N, X]
    w, idx  = top_k(probs, k)                      ties go to the lower expert id
    w       = w / sum(w)                           when `norm_topk_prob` (always in Mixtral)
    out     = sum_j w_j * expert_{idx_j}(h)

The experts' weights are stacked, `w_gate: [X, E, F]`, with the logical axis "experts"
first, which `partitioning` lays over the mesh's model axis (expert parallelism) when the
axis size divides the number of experts, else the "mlp" axis as in a dense MLP.

Two exact ways to compute the sum, chosen by shape under `jit`: a single-column call
(decode) whose rows route fewer tokens than there are experts gathers the k chosen
experts' weights per token; anything else (prefill, large batches) runs every expert on
every token and weights the outputs by a dense `[N, X]` matrix that is zero off the
chosen experts. Both give the routed sum up to float32 summation order.

Under a fixed-order policy (`deterministic=True`, `fixed_order`) every call takes the dense
path over the pass's row tiles: the same order for a token in a prompt pass, a decode step
of any batch and a scoring pass, at the dense path's cost (every expert on every token).

Routing replay (RL, docs/rl.md): `mlp(h, numerics, routing=ids)` sends each token to the
given `[B, T, k]` experts instead of its top k (a token whose first id is -1 keeps its
own), weighted by the router's probabilities of those experts (renormalized as above), so
the gradient reaches the router; it returns the experts used too, which is how
`generate(..., return_routing=True)` records them (all -1 in). With the ids the router
itself chose, the output is the same bit for bit.

Routing ties: `jax.lax.top_k` keeps the lower expert id; torch's CPU `topk` breaks exact
ties in an order of its own (not always the lower id), so two experts with bit-identical
router scores may be chosen differently. With real router weights exact ties do not occur.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from logitloop.models import fixed_order, layers, llama, quantization
from logitloop.models.config import MoeConfig, mixtral_config_from_hf, qwen3_moe_config_from_hf
from logitloop.models.fixed_order import PLAIN, Numerics
from logitloop.models.layers import CheckpointTensor


class MoeBlock(llama.LlamaBlock):
    """A Llama block whose MLP is a routed mixture on the config's sparse layers."""

    def __init__(self, config: MoeConfig, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.sparse = config.sparse_layers[layer]
        super().__init__(config, layer, dtype=dtype, rngs=rngs)

    def init_mlp(self, c: MoeConfig, p) -> None:
        if not self.sparse:
            return super().init_mlp(c, p)
        e, x, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
        self.router = p((e, x), ("embed", None))
        self.w_gate = p((x, e, f), ("experts", "embed", "mlp"))
        self.w_up = p((x, e, f), ("experts", "embed", "mlp"))
        self.w_down = p((x, f, e), ("experts", "mlp", "embed"))

    def mlp(self, h: jax.Array, numerics: Numerics = PLAIN, kv=None, *, routing=None):
        """`[B, T, E] -> [B, T, E]`; with `routing` (`[B, T, k]` i32, expert ids to replay,
        -1: the router's own choice) also the `[B, T, k]` experts each token went to
        (routing replay, module docstring). `kv`: the pass's (a dense layer's row
        adapters; the experts take none)."""
        if not self.sparse:
            return super().mlp(h, numerics, kv)
        c = self.config
        b, t, e = h.shape
        k = c.num_experts_per_tok
        flat = h.reshape(b * t, e)  # [N, E]
        given = None if routing is None else routing.reshape(b * t, k).astype(jnp.int32)
        if numerics.fixed:
            # A fixed order: the router and the dense mixture over row tiles of the pass's
            # one shape (`fixed_order.rowwise`), never the gathered path, whose sum runs in
            # another order (a bfloat16 Mixtral's decode step and its scoring pass differed
            # by 0.0017 nats), so a token's experts and sum do not depend on the batch.
            def tile(rows, given_rows=None):
                weights, experts = self._route(rows, given_rows)
                return self._dense(rows, weights, experts), experts

            out, experts = fixed_order.rowwise(tile, flat, numerics=numerics, aux=given)
        else:
            weights, experts = self._route(flat, given)
            if t == 1 and b * k < c.num_experts:
                out = self._routed(flat, weights, experts)
            else:
                out = self._dense(flat, weights, experts)
        out = out.astype(h.dtype).reshape(b, t, e)
        return out if routing is None else (out, experts.reshape(b, t, k))

    def _route(self, flat: jax.Array, given: jax.Array | None = None):
        """`[N, E]` -> each token's k expert weights `[N, k]` f32 and expert ids `[N, k]`:
        the router's top k, or the `given` ids `[N, k]` (a token whose first id is -1
        takes its own), weighted by the router's probabilities for them, so a replayed
        token's mixture is differentiable in the router as the sampled one was."""
        c = self.config
        logits = flat @ self.router[...]  # [N, X]
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, c.num_experts_per_tok)  # [N, k]
        if given is not None:
            replay = given[:, :1] >= 0  # [N, 1]
            experts = jnp.where(replay, given, experts)
            chosen = jnp.take_along_axis(probs, jnp.clip(experts, 0, c.num_experts - 1), axis=1)
            weights = jnp.where(replay, chosen, weights)
        if c.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts

    def _expert_mlp(self, x, w_gate, w_up, w_down, spec):
        # quantization.einsum: jnp.einsum, or Qwix's for quantized experts (one path)
        einsum = quantization.einsum
        act = layers.activation(self.config.hidden_act, einsum(spec[0], x, w_gate))
        return einsum(spec[1], act * einsum(spec[0], x, w_up), w_down)

    def _routed(self, flat, weights, experts):
        """Each token through its k experts only (gathers k experts' weights per token)."""
        w_gate, w_up, w_down = (w[...][experts] for w in (self.w_gate, self.w_up, self.w_down))
        out = self._expert_mlp(flat, w_gate, w_up, w_down, ("ne,nkef->nkf", "nkf,nkfe->nke"))
        return jnp.einsum("nke,nk->ne", out, weights.astype(out.dtype))

    def _dense(self, flat, weights, experts):
        """Every token through every expert, weighted by zeros off its chosen ones."""
        n, x = flat.shape[0], self.config.num_experts
        dense = jnp.zeros((n, x), weights.dtype).at[jnp.arange(n)[:, None], experts].set(weights)
        w = (self.w_gate[...], self.w_up[...], self.w_down[...])
        out = self._expert_mlp(flat, *w, ("ne,xef->nxf", "nxf,xfe->nxe"))
        return jnp.einsum("nxe,nx->ne", out, dense.astype(out.dtype))


class MoeModel(llama.LlamaModel):
    """A Mixtral / Qwen3-MoE causal LM (see the module docstring)."""

    block_class = MoeBlock


def _checkpoint_tensors(config: MoeConfig, moe: str, gate: str, names) -> dict:
    """Llama's tensors with each sparse layer's MLP replaced by a router (`moe + gate`)
    and one (gate, up, down) triple per expert, stacked into the block's parameters."""
    c = config
    e, f = c.hidden_size, c.moe_intermediate_size
    out = llama.checkpoint_tensors(config)
    for i, sparse in enumerate(c.sparse_layers):
        if not sparse:
            continue
        hf, t = f"model.layers.{i}.", ("layers", i)
        for name in ("gate_proj", "up_proj", "down_proj"):
            del out[hf + f"mlp.{name}.weight"]
        out[hf + moe + gate] = CheckpointTensor((*t, "router"), (c.num_experts, e), jnp.transpose)
        for j in range(c.num_experts):
            expert = f"{hf}{moe}experts.{j}."
            for hf_name, target, shape in zip(
                names, ("w_gate", "w_up", "w_down"), ((f, e), (f, e), (e, f)), strict=True
            ):
                out[expert + hf_name] = CheckpointTensor(
                    (*t, target), shape, jnp.transpose, stack_index=j
                )
    return out


def mixtral_checkpoint_tensors(config: MoeConfig) -> dict[str, CheckpointTensor]:
    return _checkpoint_tensors(
        config, "block_sparse_moe.", "gate.weight", ("w1.weight", "w3.weight", "w2.weight")
    )


def qwen3_moe_checkpoint_tensors(config: MoeConfig) -> dict[str, CheckpointTensor]:
    return _checkpoint_tensors(
        config,
        "mlp.",
        "gate.weight",
        ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    )


llama.register_family(
    "mixtral",
    mixtral_config_from_hf,
    config_class=MoeConfig,
    model_class=MoeModel,
    checkpoint_tensors=mixtral_checkpoint_tensors,
)
llama.register_family(
    "qwen3_moe",
    qwen3_moe_config_from_hf,
    config_class=MoeConfig,
    model_class=MoeModel,
    checkpoint_tensors=qwen3_moe_checkpoint_tensors,
)
