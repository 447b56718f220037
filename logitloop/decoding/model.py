"""The model protocol that `generate` drives.

A decodable model computes, for a batch of token columns, the logits of the next token and
writes the keys and values of those tokens into a pre-allocated cache:

    apply(weights, tokens, positions, cache) -> (logits, cache)
      tokens:    [B, T] int32
      positions: [B, T] int32, each token's absolute position in its row; -1 marks padding.
                 Prompts are left-padded, so every row's last column is its last real token.
      cache:     the model's own pytree, allocated by `init_cache(batch_size, max_length)`;
                 a real token's key/value is written at the slot equal to its position, per
                 row, and a query at position q attends to slots <= q.
      logits:    [B, V] for the last column (the LM head runs on one position per row), or
                 [B, T, V], of which the last column is used.

Two kinds of model satisfy it:

- logitloop's Flax NNX modules (`logitloop.models`): `model(tokens, positions, cache)` and
  `model.init_cache(batch_size, max_length)`, with `model.config` and `model.tokenizer`.
- `FunctionModel`, which wraps plain functions from another codebase.

`generate` compiles against a hashable static description of the model (`ModelRunner`) and
passes the weights as an argument, so the weights are never baked into the program and one
compiled program serves every call with the same shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True, eq=False)
class FunctionModel:
    """A model given as plain functions (identity-hashed, so keep one instance around).

    apply_fn: `(params, tokens [B, T], positions [B, T], cache) -> (logits, cache)`, see the
      module docstring; init_cache: `(batch_size, max_length) -> cache`.
    """

    apply_fn: Callable[..., tuple[jax.Array, Any]]
    params: Any
    init_cache: Callable[[int, int], Any]
    vocab_size: int
    max_length: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: Any = None


@dataclasses.dataclass(frozen=True)
class ModelRunner:
    """Static, hashable handle on a model's forward pass and cache allocation."""

    graphdef: Any = None  # nnx.GraphDef for NNX modules
    apply_fn: Callable | None = None  # for FunctionModel
    init_cache_fn: Callable | None = None

    def forward(self, weights, tokens, positions, cache) -> tuple[jax.Array, Any]:
        if self.graphdef is not None:
            logits, cache = nnx.merge(self.graphdef, weights)(tokens, positions, cache)
        else:
            logits, cache = self.apply_fn(weights, tokens, positions, cache)
        if logits.ndim == 3:
            logits = logits[:, -1]
        return logits, cache

    def forward_columns(self, weights, tokens, positions, cache) -> tuple[jax.Array, Any]:
        """Like `forward`, but the logits of every column, `[B, T, V]` (verifying drafts)."""
        if self.graphdef is not None:
            return nnx.merge(self.graphdef, weights)(tokens, positions, cache, all_columns=True)
        logits, cache = self.apply_fn(weights, tokens, positions, cache)
        if logits.ndim != 3:
            raise ValueError(
                "speculative decoding needs a model whose apply_fn returns the logits of "
                f"every column, [B, T, V]; this one returned shape {tuple(logits.shape)}"
            )
        return logits, cache

    def init_cache(self, weights, batch_size: int, max_length: int) -> Any:
        if self.graphdef is not None:
            return nnx.merge(self.graphdef, weights).init_cache(batch_size, max_length)
        return self.init_cache_fn(batch_size, max_length)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What `generate` needs to know about a model besides its forward pass."""

    runner: ModelRunner
    weights: Any
    vocab_size: int
    max_length: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Any


def _eos_tuple(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def model_info(model: Any) -> ModelInfo:
    """Resolve a FunctionModel or an NNX module into what the decode loop needs."""
    if isinstance(model, FunctionModel):
        return ModelInfo(
            runner=ModelRunner(apply_fn=model.apply_fn, init_cache_fn=model.init_cache),
            weights=model.params,
            vocab_size=int(model.vocab_size),
            max_length=int(model.max_length),
            eos_token_ids=_eos_tuple(model.eos_token_ids),
            tokenizer=model.tokenizer,
        )
    if isinstance(model, nnx.Module):
        config = model.config
        graphdef, weights = nnx.split(model)
        return ModelInfo(
            runner=ModelRunner(graphdef=graphdef),
            weights=weights,
            vocab_size=int(config.vocab_size),
            max_length=int(config.max_position_embeddings),
            eos_token_ids=_eos_tuple(getattr(config, "eos_token_id", None)),
            tokenizer=getattr(model, "tokenizer", None),
        )
    raise ValueError(
        f"model must be a logitloop NNX model or a logitloop.FunctionModel, got {type(model)!r}"
    )
