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
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from logitloop.decoding.runtime import compiles
from logitloop.models import fixed_order, layers, quantization
from logitloop.models.fixed_order import MODEL_PARALLEL, PLAIN, Numerics
from logitloop.ops.attention import describe as describe_attention

__all__ = ["MODEL_PARALLEL", "FunctionModel", "ModelInfo", "ModelRunner", "model_info"]


def is_model_parallel(deterministic: Any) -> bool:
    """Whether a `deterministic=` value (True, False, MODEL_PARALLEL or a `Numerics`
    policy) is the model-parallel mode."""
    if isinstance(deterministic, Numerics):
        return deterministic.splits
    return isinstance(deterministic, str) and deterministic == MODEL_PARALLEL


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
    # How the layers reduce (`fixed_order.Numerics`, from `fixed_order.calibrate`): plain
    # XLA ops, or a fixed order (`deterministic=True` or "model-parallel"), with the tile
    # kernel choice and this backend's probe results. Static, so part of the jit key.
    numerics: Numerics = PLAIN

    @property
    def deterministic(self) -> bool | str:
        """The `deterministic=` mode: False, True or "model-parallel"."""
        return self.numerics.deterministic

    def forward(
        self, weights, tokens, positions, cache, *, prompt: bool = False, mesh=None,
        routing=None,
    ) -> tuple[jax.Array, ...]:  # fmt: skip
        """Last-column logits `[B, V]` and the cache. `prompt`: the call is (part of) a
        prompt pass, not a decode step: a deterministic runner's products then run over
        prompt-sized row tiles (`fixed_order.PROMPT_TILE`). `mesh`: the rows lie over its
        "data" axis (a deterministic runner tiles each device's rows by themselves).
        `routing` (a mixture of experts: `[B, T, L, k]` experts to replay, -1 for the
        router's own): the routing used comes back third (`DecoderModel.__call__`)."""
        if self.graphdef is not None:
            numerics = self.numerics.for_pass(prompt=prompt, mesh=mesh)
            model = nnx.merge(self.graphdef, weights)
            routed = {} if routing is None else {"routing": routing}
            logits, cache, *used = model(tokens, positions, cache, numerics=numerics, **routed)
        else:
            logits, cache = self.apply_fn(weights, tokens, positions, cache)
            used = []
        if logits.ndim == 3:
            logits = logits[:, -1]
        return (logits, cache, *used)

    def forward_columns(
        self, weights, tokens, positions, cache, *, routing=None
    ) -> tuple[jax.Array, ...]:
        """Like `forward`, but the logits of every column, `[B, T, V]` (verifying drafts:
        generated tokens, so a deterministic runner treats the call as a decode step)."""
        if self.graphdef is not None:
            model = nnx.merge(self.graphdef, weights)
            numerics = self.numerics.for_pass()
            routed = {} if routing is None else {"routing": routing}
            return model(tokens, positions, cache, all_columns=True, numerics=numerics, **routed)
        logits, cache = self.apply_fn(weights, tokens, positions, cache)
        if logits.ndim != 3:
            raise ValueError(
                "speculative decoding needs a model whose apply_fn returns the logits of "
                f"every column, [B, T, V]; this one returned shape {tuple(logits.shape)}"
            )
        return logits, cache

    def routing_shape(self, weights) -> tuple[int, int] | None:
        """(L, k) of a routing record `[B, T, L, k]`: the model's routed layers and experts
        per token; None where nothing routes (a dense model, a FunctionModel)."""
        if self.graphdef is None:
            return None
        model = nnx.merge(self.graphdef, weights)
        routed = model.routed_layers() if hasattr(model, "routed_layers") else ()
        return (len(routed), model.config.num_experts_per_tok) if routed else None

    def no_routing(self, weights, batch: int, width: int) -> jax.Array:
        """`[B, T, L, k]` of -1: every token routed by the router itself, recorded."""
        layers_, k = self.routing_shape(weights)
        return jnp.full((batch, width, layers_, k), -1, jnp.int32)

    def init_cache(self, weights, batch_size: int, max_length: int) -> Any:
        if self.graphdef is not None:
            return nnx.merge(self.graphdef, weights).init_cache(batch_size, max_length)
        return self.init_cache_fn(batch_size, max_length)

    def sliding_windows(self, weights) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens (None: global); a FunctionModel's
        are unknown: ()."""
        if self.graphdef is None:
            return ()
        return tuple(nnx.merge(self.graphdef, weights).config.sliding_windows)

    def kv_bytes_per_token(self, weights) -> int | None:
        """Bytes of keys and values one token holds in a paged pool, every layer together
        (None for a FunctionModel)."""
        if self.graphdef is None:
            return None
        shapes = jax.eval_shape(lambda: self.init_pool(weights, 1, 1))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    def init_pool(self, weights, num_pages: int | tuple[int, ...], page_size: int) -> Any:
        """A paged pool of zeros: per layer `dict(k_pages, v_pages)`, each `[Hkv, num_pages,
        page_size, D]` (`layers.init_paged_caches`, without tables: the loop keeps those in
        `pool.Pool`); `num_pages` one count for every layer or one per layer (a pool with
        layer groups, `pool.PoolShape.layer_pages`)."""
        if self.graphdef is None:
            raise ValueError(
                "kv_cache_tokens needs a logitloop model: a FunctionModel's cache is its own"
            )
        model = nnx.merge(self.graphdef, weights)
        c = model.config
        no_tables = jnp.zeros((0, 0), jnp.int32)
        caches = layers.init_paged_caches(
            c.num_layers, num_pages, page_size, no_tables, c.num_kv_heads, c.head_dim, model.dtype
        )
        return [{"k_pages": x["k_pages"], "v_pages": x["v_pages"]} for x in caches]


class runner_jit:  # noqa: N801 - used like `jax.jit`, as a decorator
    """`jax.jit(fn, **jit_kwargs)` for a function whose first argument is a `ModelRunner`
    (or holds one as `.runner`, as the loop's `Program` does): a deterministic runner's
    programs are compiled with `Numerics.compiler_options()` (XLA:CPU's size-dependent
    library fusions off), every other runner's as usual."""

    def __init__(self, fn: Callable, **jit_kwargs):
        self._plain = jax.jit(fn, **jit_kwargs)
        self._fixed = {}  # backend options -> jitted fn
        self._fn, self._kwargs = fn, jit_kwargs
        functools.update_wrapper(self, fn)

    def _pick(self, runner: Any, args):
        runner = getattr(runner, "runner", runner)
        # Inside another program (`generate_many`'s admission) the outer one's options rule.
        nested = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
        if not runner.numerics.fixed or nested:
            return self._plain
        options = runner.numerics.compiler_options()
        key = tuple(sorted(options.items()))
        if key not in self._fixed:
            self._fixed[key] = jax.jit(self._fn, compiler_options=options, **self._kwargs)
        return self._fixed[key]

    def __call__(self, runner: Any, *args, **kwargs):
        fn = self._pick(runner, (args, kwargs))
        with compiles.CompileWatch() as watch:
            out = fn(runner, *args, **kwargs)
        if watch.count:  # a new program: counted, with what was new (`ll.compile_stats`)
            self._record(watch.seconds, runner, args, kwargs)
        return out

    def trace(self, runner: Any, *args, **kwargs):
        return self._pick(runner, (args, kwargs)).trace(runner, *args, **kwargs)

    def precompile(self, runner: Any, *args, **kwargs) -> tuple[Any, bool]:
        """Compile the program a call with these arguments (arrays or
        `jax.ShapeDtypeStruct`s) runs, without running it (`jit(...).trace(...).lower()
        .compile()`; a later call with arguments of the same shapes compiles nothing).
        Returns the call's output shapes (`jax.ShapeDtypeStruct`s) and whether a program was
        compiled (False: this process had it already)."""
        fn = self._pick(runner, (args, kwargs))
        with compiles.CompileWatch() as watch:
            traced = fn.trace(runner, *args, **kwargs)
            traced.lower().compile()
        if watch.count:
            self._record(watch.seconds, runner, args, kwargs)
        return traced.out_info, bool(watch.count)

    def _record(self, seconds: float, runner: Any, args: tuple, kwargs: dict) -> None:
        bound = inspect.signature(self._fn).bind(runner, *args, **kwargs).arguments
        model = getattr(runner, "runner", runner)  # a Program holds its model's runner
        compiles.record(self._fn.__name__, seconds, compiles.signature(bound), model)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What `generate` needs to know about a model besides its forward pass."""

    runner: ModelRunner
    weights: Any
    vocab_size: int
    max_length: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Any
    # The attention implementation of prompt passes and decode steps
    # (`logitloop.ops.attention.describe`); a FunctionModel's is its own.
    attention: str = "the model's own"
    # Which weights are quantized (`logitloop.models.quantization.Quantization.describe`).
    weights_format: str = "float"


def _eos_tuple(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def check_weight_dtypes(weights: Any, dtype: Any) -> None:
    """Refuse floating weights whose dtype is not the model's `dtype`, naming the weight:
    `nnx.update` with float32 arrays into a bfloat16 model would compile a float32 program
    (other bits than the rollout's, and a recompile) while the model still says bfloat16.
    A quantized weight (`QArray`) is its own format and not looked into. One pass over
    the leaves' dtypes, no array read (tens of microseconds for the shipped model)."""
    dtype = jnp.dtype(dtype)
    leaves = jax.tree.leaves(weights, is_leaf=quantization.is_quantized)

    def wrong(x) -> bool:
        x_dtype = getattr(x, "dtype", None)
        if x_dtype is None or quantization.is_quantized(x):
            return False
        return x_dtype != dtype and jnp.issubdtype(x_dtype, jnp.floating)

    if not any(map(wrong, leaves)):
        return
    for path, x in jax.tree_util.tree_leaves_with_path(weights, is_leaf=quantization.is_quantized):
        if wrong(x):
            raise ValueError(
                f"model weight {jax.tree_util.keystr(path)} has dtype {x.dtype} but the model "
                f"is {dtype}: cast new weights to {dtype} before nnx.update "
                f"(jax.tree.map(lambda x: x.astype(model.dtype), state))"
            )


def _product_shapes(model: Any, deterministic: bool | str) -> tuple:
    """The decode products `calibrate` measures ahead of the trace under
    `deterministic=True` (`fixed_order.product_shapes`; none for a quantized model, whose
    tables are not products of their own shape, nor for the other settings)."""
    if deterministic is not True or getattr(model, "quantization", None) is not None:
        return ()
    head = model.head_weight() if hasattr(model, "head_weight") else None
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    head_dim = getattr(getattr(model, "config", None), "head_dim", None)
    return fixed_order.product_shapes(params, getattr(head, "shape", None), head_dim)


def model_info(model: Any, *, deterministic: bool | str | Numerics = False) -> ModelInfo:
    """Resolve a FunctionModel or an NNX module into what the decode loop needs.

    `deterministic=True` (logitloop's models only) runs the model with its reductions in
    a fixed order, so a row's logits do not depend on the rest of the batch nor on a data
    axis; `deterministic="model-parallel"` also fixes the splits of a model axis, so they
    do not depend on its size either (`logitloop.models.fixed_order`). The runner carries
    the policy `fixed_order.calibrate` builds for the setting and the model's dtype; a
    `Numerics` given instead (e.g. `calibrate(True, tile_kernel="interpret")`) is taken as
    it is.
    """
    if not isinstance(deterministic, (bool, Numerics)) and not is_model_parallel(deterministic):
        raise ValueError(
            f"deterministic must be True, False, {MODEL_PARALLEL!r} or a "
            f"fixed_order.Numerics, got {deterministic!r}"
        )
    fixed = deterministic.fixed if isinstance(deterministic, Numerics) else bool(deterministic)
    if isinstance(model, FunctionModel):
        if fixed:
            raise ValueError(
                "deterministic=True needs a logitloop model: a FunctionModel's forward pass "
                "is its own code, whose reduction order logitloop cannot fix"
            )
        return ModelInfo(
            runner=ModelRunner(apply_fn=model.apply_fn, init_cache_fn=model.init_cache),
            weights=model.params,
            vocab_size=int(model.vocab_size),
            max_length=int(model.max_length),
            eos_token_ids=_eos_tuple(model.eos_token_ids),
            tokenizer=model.tokenizer,
        )
    if isinstance(model, nnx.Module):
        numerics = deterministic
        if not isinstance(numerics, Numerics):
            dtype = getattr(model, "dtype", jnp.float32)
            numerics = fixed_order.calibrate(
                deterministic, dtype=dtype, shapes=_product_shapes(model, deterministic)
            )
        if not numerics.split_rows_keep_bits:
            warnings.warn(
                f"deterministic={MODEL_PARALLEL!r}: this CPU's XLA product rounds a row by "
                "its place in a row tile (rows 6-7 of 8 otherwise than 0-5, as on an AMD "
                "EPYC), so a row's bits may depend on its batch and the mesh here; "
                "deterministic=True is unaffected",
                stacklevel=3,
            )
        config = model.config
        graphdef, weights = nnx.split(model)
        check_weight_dtypes(weights, model.dtype)
        attention = describe_attention(
            head_dim=config.head_dim,
            dtype=model.dtype,
            softcap=getattr(config, "attn_logit_softcapping", None),
            windows=config.sliding_windows,
            deterministic=numerics.fixed,
        )
        return ModelInfo(
            runner=ModelRunner(graphdef=graphdef, numerics=numerics),
            weights=weights,
            vocab_size=int(config.vocab_size),
            max_length=int(config.max_position_embeddings),
            eos_token_ids=_eos_tuple(getattr(config, "eos_token_id", None)),
            tokenizer=getattr(model, "tokenizer", None),
            attention=attention,
            weights_format=(
                model.quantization.describe()
                if getattr(model, "quantization", None) is not None
                else "float"
            ),
        )
    raise ValueError(
        f"model must be a logitloop NNX model or a logitloop.FunctionModel, got {type(model)!r}"
    )
