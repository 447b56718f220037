"""Qwix / tunix LoRA states as adapters: the pytree a tunix LoRA policy trains,
`nnx.state(policy, nnx.LoRAParam)`, read as PEFT's tensors so that one loader
(`adapters.Adapters.load`) checks and writes both.

Qwix's `LoraProvider` gives every weight `w` it targets two parameters beside it in the
same module, `{w}_lora_a` and `{w}_lora_b` (qwix/_src/providers/lora.py): `a` holds the
weight's contracted axes then the rank, `b` the rank then the weight's other axes, in the
weight's own order, and the product adds `(x @ a) @ b * alpha / rank`. In tunix's Llama 3,
Qwen2 and Qwen3 (`tunix.models.*.model`) the modules carry PEFT's names:

    layers/3/attn/q_proj/w_lora_a          [E, r]      w: [E, H, D]
    layers/3/attn/q_proj/w_lora_b          [r, H, D]
    layers/3/attn/o_proj/w_lora_a          [H, D, r]   w: [H, D, E]
    layers/3/mlp/down_proj/kernel_lora_a   [F, r]      (an nnx.Linear's kernel [F, E])

so `a` seen as `[K, r]` is PEFT's `lora_A.T` and `b` seen as `[r, N]` its `lora_B.T`, the
head axes flattened head-major as logitloop's head-split weights are. The state holds no
alpha: it is the provider's, given as `alpha=`; the rank is each site's `a.shape[-1]`, and
`alpha / rank` is folded into that site's B here (qwix allows a rank per rule).

tunix's Gemma 2 and Gemma 3 (`tunix.models.gemma`, `gemma3`) name their attention
einsums, whose weights qwix treats the same way (an einsum's `a` holds the weight's axes
that the input has too, then the rank; `b` the rank then the rest):

    attn/q_einsum/w         [H, E, D]     a [E, r]      b [r, H, D]      -> q_proj
    attn/attn_vec_einsum/w  [H, D, E]     a [H, D, r]   b [r, E]         -> o_proj
    attn/qkv_einsum/w       [3, H, E, D]  a [E, r]      b [r, 3, H, D]   -> q, k, v_proj
    attn/kv_einsum/w        [2, K, E, D]  a [E, r]      b [r, 2, K, D]   -> k, v_proj

A fused einsum's LoRA is one low-rank update of the fused weight: each projection it
feeds (the order tunix unpacks its output in: q, k, v) gets the same A and its own slice
of B along the fused axis. Their MLPs are `nnx.Linear`s named as PEFT's (tunix splits a
checkpoint's `gating_einsum` into `gate_proj` and `up_proj` when it loads one), so no
state of theirs has a `gating_einsum`: that name, Gemma 4's `k_einsum` (keys that are
also the values) and any other module are refused by name, as is a weight whose `a` or
`b` has batch axes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

# The last key of a Qwix LoRA parameter: `{weight}_lora_{a|b}`.
_LEAF = re.compile(r"^\w+_lora_([ab])$")
# tunix's Gemma einsums (module docstring) -> the projections they feed, in the order of
# their `b`'s fused axis (one name: no fused axis).
_EINSUMS = {
    "q_einsum": ("q_proj",),
    "attn_vec_einsum": ("o_proj",),
    "qkv_einsum": ("q_proj", "k_proj", "v_proj"),
    "kv_einsum": ("k_proj", "v_proj"),
}


def is_state(source: Any) -> bool:
    """Whether `source` is a Qwix LoRA state (an `nnx.State` or nested mapping whose
    leaves end in `_lora_a` / `_lora_b`), not PEFT's flat tensor names."""
    if not isinstance(source, Mapping):
        return False
    return any(_LEAF.match(str(path[-1])) for path, _ in _leaves(source))


def largest_rank(state: Any) -> int:
    """The largest rank of Qwix LoRA `state` (its `_lora_a` leaves' last axis): the
    `max_rank` a table for it needs."""
    ranks = [np.shape(v)[-1] for path, v in _leaves(state) if str(path[-1]).endswith("_lora_a")]
    if not ranks:
        raise ValueError("the Qwix LoRA state holds no `{weight}_lora_a` parameter")
    return int(max(ranks))


def peft_tensors(state: Any, alpha: Any, where: str) -> tuple[dict, dict]:
    """`(config, tensors)` in PEFT's form of Qwix LoRA `state` under the provider's
    `alpha`: `layers.{i}.{module}.lora_A.weight [r, K]` and `lora_B.weight [N, r]`, B
    times `alpha / r`, with a config of scale 1 (`lora_alpha = r = the largest rank`)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(
            f"alpha must be a positive number (the Qwix LoraProvider's alpha: a LoRA state "
            f"does not hold it), got {alpha!r}"
        )
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for path, value in _leaves(state):
        keys = [str(k) for k in path]
        m = _LEAF.match(keys[-1])
        if m is None:
            raise ValueError(
                f"{where}: {'/'.join(keys)} is not a Qwix LoRA parameter (`{{weight}}_lora_a` "
                "or `_lora_b`): pass nnx.state(policy, nnx.LoRAParam)"
            )
        layer = _layer(keys)
        if layer is None or len(keys) < 2:
            raise ValueError(
                f"{where}: {'/'.join(keys)} is not under `layers/<index>/`: only a decoder "
                "layer's projections are adapter targets"
            )
        pairs.setdefault((layer, keys[-2]), {})[m.group(1)] = np.asarray(value, np.float32)
    config_rank = 1
    tensors = {}
    for (layer, module), pair in pairs.items():
        path = f"layers/{layer}/.../{module}"
        if set(pair) != {"a", "b"}:
            raise ValueError(f"{where}: {path} has only its lora_{''.join(pair)}")
        a, b = pair["a"], pair["b"]
        rank = a.shape[-1]
        if b.shape[0] != rank:
            raise ValueError(
                f"{where}: {path}: lora_a {a.shape} and lora_b {b.shape} do not share a rank "
                "(a: the weight's contracted axes then the rank; b: the rank then the rest; "
                "weights with batch axes are not supported)"
            )
        for target, part in _targets(module, b, path, where):
            name = f"layers.{layer}.{target}.lora_{{}}.weight"
            if name.format("A") in tensors:
                raise ValueError(f"{where}: layer {layer}'s {target} is targeted twice")
            tensors[name.format("A")] = a.reshape(-1, rank).T  # [r, K]
            tensors[name.format("B")] = (float(alpha) / rank) * part.reshape(rank, -1).T  # [N, r]
        config_rank = max(config_rank, rank)
    return {"r": config_rank, "lora_alpha": config_rank}, tensors


def _targets(module: str, b: np.ndarray, path: str, where: str) -> list[tuple[str, np.ndarray]]:
    """`(projection, its part of b [r, ...])` of one module's LoRA: a PEFT-named module
    its whole `b`, a fused Gemma einsum each projection its slice along the fused axis."""
    targets = _EINSUMS.get(module, (module,))
    if len(targets) == 1:
        return [(targets[0], b)]
    if b.ndim < 3 or b.shape[1] != len(targets):
        raise ValueError(
            f"{where}: {path}: lora_b {b.shape} is not [rank, {len(targets)}, heads, head_dim] "
            f"(tunix's {module}: {', '.join(targets)} fused)"
        )
    return [(target, b[:, i]) for i, target in enumerate(targets)]


def _leaves(tree: Any) -> list[tuple[tuple, Any]]:
    """`(path keys, array)` of every leaf (an `nnx.Variable`'s value read)."""
    from flax import nnx

    flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    out = []
    for path, leaf in flat:
        keys = tuple(_key(k) for k in path)
        keys = keys[:-1] if keys and keys[-1] == "value" else keys  # a State's VariableState
        out.append((keys, leaf[...] if isinstance(leaf, nnx.Variable) else leaf))
    return out


def _key(entry: Any) -> Any:
    for field in ("key", "name", "idx"):
        if hasattr(entry, field):
            return getattr(entry, field)
    return str(entry)


def _layer(keys: list[str]) -> int | None:
    """The index after the path's `layers` key (tunix's `layers[i]`)."""
    for k, nxt in zip(keys, keys[1:], strict=False):
        if k == "layers" and nxt.isdigit():
            return int(nxt)
    return None
