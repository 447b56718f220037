"""The model protocol that `generate` drives.

A decodable model computes, for a batch of token columns, the logits of the next token,
and reads and writes its keys and values through the library's attention contract
(`logitloop.models.kv`, docs/own_model.md):

    apply(weights, tokens, positions, kv) -> (logits, kv)
      tokens:    [B, T] int32
      positions: [B, T] int32, each token's absolute position in its row; -1 marks padding.
                 Prompts are left-padded, so every row's last column is its last real token.
      kv:        an `ll.KV`, which the model hands to `ll.attention(q, k, v, kv, layer=i)`
                 once per layer; the cache behind it (contiguous, rings or a paged pool)
                 and its shape (`ll.KVSpec`) are the library's.
      logits:    [B, V] for the last column (the LM head runs on one position per row), or
                 [B, T, V], of which the last column is used.

Three kinds of model satisfy it, all through the same `ll.attention`:

- logitloop's Flax NNX families (`logitloop.models`): `model(tokens, positions, kv)`, with
  `model.kv_spec`, `model.config` and `model.tokenizer`.
- `NNXModel` (`from_nnx`): a user's NNX module whose attention calls `ll.attention`.
- `FunctionModel` with a `kv_spec`: plain functions (a Linen module's `apply`,
  `from_linen`, or any JAX code). A `FunctionModel` with `init_cache` instead keeps a cache
  of its own (contract version 0: contiguous rows only, no pages, no `deterministic=`).

`generate` compiles against a hashable static description of the model (`ModelRunner`) and
passes the weights as an argument, so the weights are never baked into the program and one
compiled program serves every call with the same shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logitloop.decoding.runtime import compiles, executables
from logitloop.models import fixed_order, quantization
from logitloop.models import kv as kv_contract
from logitloop.models.fixed_order import MODEL_PARALLEL, PLAIN, Numerics
from logitloop.models.kv import KV, KVSpec
from logitloop.ops.attention import describe as describe_attention

__all__ = [
    "MODEL_PARALLEL",
    "FunctionModel",
    "ModelInfo",
    "ModelRunner",
    "NNXModel",
    "from_linen",
    "from_nnx",
    "model_info",
]


def is_model_parallel(deterministic: Any) -> bool:
    """Whether a `deterministic=` value (True, False, MODEL_PARALLEL or a `Numerics`
    policy) is the model-parallel mode."""
    if isinstance(deterministic, Numerics):
        return deterministic.splits
    return isinstance(deterministic, str) and deterministic == MODEL_PARALLEL


@dataclasses.dataclass(frozen=True, eq=False)
class FunctionModel:
    """A model given as plain functions (identity-hashed, so keep one instance around).

    apply_fn: `(params, tokens [B, T], positions [B, T], kv) -> (logits, kv)`, see the
      module docstring.
    kv_spec: the model's `ll.KVSpec`: the library owns the cache, and `apply_fn` calls
      `ll.attention` once per layer (every entry point, pages and `deterministic=`).
    init_cache: instead of `kv_spec`, `(batch_size, max_length) -> cache` of the model's
      own, which `apply_fn` gets and returns as its `kv` (contiguous rows only: no paged
      pool, shared prefixes nor `deterministic=`).
    """

    apply_fn: Callable[..., tuple[jax.Array, Any]]
    params: Any
    init_cache: Callable[[int, int], Any] | None = None
    vocab_size: int = 0
    max_length: int = 0
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: Any = None
    kv_spec: KVSpec | None = None

    def __post_init__(self):
        _check_model_fields(self, "FunctionModel")
        if (self.init_cache is None) == (self.kv_spec is None):
            raise ValueError(
                "FunctionModel needs exactly one of kv_spec= (the library's cache, through "
                "ll.attention) and init_cache= (a cache of the model's own)"
            )


@dataclasses.dataclass(frozen=True, eq=False)
class NNXModel:
    """A user's Flax NNX module as a model (`from_nnx`): `call(module, tokens, positions,
    kv) -> (logits, kv)` (default `module(tokens, positions, kv)`), its attention through
    `ll.attention`. The module is read at each call (`nnx.split`): weights changed with
    `nnx.update` are used as they are, and compile nothing."""

    module: nnx.Module
    kv_spec: KVSpec
    vocab_size: int
    max_length: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: Any = None
    call: Callable | None = None

    def __post_init__(self):
        _check_model_fields(self, "from_nnx")
        if not isinstance(self.module, nnx.Module):
            raise TypeError(f"from_nnx takes an nnx.Module, got {type(self.module).__name__}")


def _check_model_fields(model: Any, where: str) -> None:
    for name in ("vocab_size", "max_length"):
        value = getattr(model, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    spec = getattr(model, "kv_spec", None)
    if spec is not None and not isinstance(spec, KVSpec):
        raise TypeError(f"{where}: kv_spec must be an ll.KVSpec, got {type(spec).__name__}")


def _call_module(module, tokens, positions, kv):
    return module(tokens, positions, kv)


def from_nnx(
    module: nnx.Module,
    kv_spec: KVSpec | None = None,
    *,
    vocab_size: int,
    max_length: int,
    eos_token_ids: Any = (),
    tokenizer: Any = None,
    call: Callable | None = None,
) -> NNXModel:
    """The model every entry point takes, from an NNX module whose attention calls
    `ll.attention(q, k, v, kv, layer=i)`: `module(tokens, positions, kv) -> (logits, kv)`,
    or `call(module, tokens, positions, kv)` for another signature (keep one `call`
    function: it is part of the programs' key). `kv_spec`: default the module's own
    `kv_spec` attribute. The weights are the module's state, read at each call;
    `nnx.update(module, new_state)` compiles nothing."""
    if kv_spec is None:
        kv_spec = getattr(module, "kv_spec", None)
        if kv_spec is None:
            raise ValueError("from_nnx needs kv_spec= (the module has no kv_spec attribute)")
    return NNXModel(
        module, kv_spec, vocab_size, max_length, _eos_tuple(eos_token_ids), tokenizer,
        _call_module if call is None else call,
    )  # fmt: skip


def from_linen(
    module: Any,
    variables: Any,
    kv_spec: KVSpec,
    *,
    vocab_size: int,
    max_length: int,
    eos_token_ids: Any = (),
    tokenizer: Any = None,
    method: Any = None,
) -> FunctionModel:
    """The model every entry point takes, from a Linen module and its variables:
    `module.apply(variables, tokens, positions, kv)` (or `method=`), whose attention calls
    `ll.attention`. Keep the returned model: it is the programs' key. Errors name the
    module (and method), not the `FunctionModel` it becomes."""
    from flax import linen

    if not isinstance(module, linen.Module):
        raise TypeError(f"from_linen takes a flax.linen Module, got {type(module).__name__}")
    if not isinstance(kv_spec, KVSpec):
        raise TypeError(f"from_linen: kv_spec must be an ll.KVSpec, got {type(kv_spec).__name__}")
    fields = types.SimpleNamespace(vocab_size=vocab_size, max_length=max_length)
    _check_model_fields(fields, "from_linen")
    return FunctionModel(
        functools.partial(module.apply, method=method), variables, vocab_size=vocab_size,
        max_length=max_length, eos_token_ids=_eos_tuple(eos_token_ids), tokenizer=tokenizer,
        kv_spec=kv_spec,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelRunner:
    """Static, hashable handle on a model's forward pass and cache allocation."""

    graphdef: Any = None  # nnx.GraphDef for NNX modules
    apply_fn: Callable | None = None  # for FunctionModel
    init_cache_fn: Callable | None = None  # a FunctionModel's own cache (no kv_spec)
    # The library's cache (`ll.KVSpec`): every model but a FunctionModel with its own.
    kv_spec: KVSpec | None = None
    # How a user's NNX module is called (`from_nnx`); None: a logitloop family.
    call: Callable | None = None
    # A user's model's vocabulary, to check its logits' shape (None: a family's own).
    vocab_size: int | None = None
    # How the layers reduce (`fixed_order.Numerics`, from `fixed_order.calibrate`): plain
    # XLA ops, or a fixed order (`deterministic=True` or "model-parallel"), with the tile
    # kernel choice and this backend's probe results. Static, so part of the jit key.
    numerics: Numerics = PLAIN

    @property
    def deterministic(self) -> bool | str:
        """The `deterministic=` mode: False, True or "model-parallel"."""
        return self.numerics.deterministic

    @property
    def family(self) -> bool:
        """Whether the model is one of logitloop's families (routing, `all_columns`)."""
        return self.graphdef is not None and self.call is None

    def forward(
        self, weights, tokens, positions, cache, *, prompt: bool = False, mesh=None,
        routing=None, rows=None,
    ) -> tuple[jax.Array, ...]:  # fmt: skip
        """Last-column logits `[B, V]` and the cache. `prompt`: the call is (part of) a
        prompt pass, not a decode step: a deterministic runner's products then run over
        prompt-sized row tiles (`fixed_order.PROMPT_TILE`). `mesh`: the rows lie over its
        "data" axis (a deterministic runner tiles each device's rows by themselves).
        `routing` (a mixture of experts: `[B, T, L, k]` experts to replay, -1 for the
        router's own): the routing used comes back third (`DecoderModel.__call__`).
        `rows`: the pass's per-row state (`ll.Rows`: the rows' adapters, steering), or
        None; where it captures layers (`Rows.capture`) their residual streams come back
        last, `[B, T, C, E]`."""
        numerics = self.numerics.for_pass(prompt=prompt, mesh=mesh)
        logits, cache, *used = self._pass(
            weights, tokens, positions, cache, numerics, routing, rows=rows
        )
        if logits.ndim == 3:
            logits = logits[:, -1]
        return (logits, cache, *used)

    def forward_columns(
        self, weights, tokens, positions, cache, *, routing=None, rows=None
    ) -> tuple[jax.Array, ...]:
        """Like `forward`, but the logits of every column, `[B, T, V]` (verifying drafts:
        generated tokens, so a deterministic runner treats the call as a decode step)."""
        numerics = self.numerics.for_pass()
        out = self._pass(
            weights, tokens, positions, cache, numerics, routing, all_columns=True, rows=rows
        )
        if out[0].ndim != 3:
            raise ValueError(
                "speculative decoding and scoring need a model that returns the logits of "
                f"every column, [B, T, V]; this one returned shape {tuple(out[0].shape)}"
            )
        return out

    def forward_packed(
        self, weights, tokens, positions, packed, read, *, prompt_rows: int, rows=None
    ) -> tuple[jax.Array, ...]:
        """The logits `[1, M, V]` of the columns `read` (`[M]`) of a packed pass: tokens
        and positions `[1, N]` from many rows, which see each other as `packed` says
        (`ll.Packed`), the first `prompt_rows` of them prompt tokens and the rest generated
        ones (a deterministic runner tiles each as its own pass would, `Numerics.
        prompt_rows`). Where `rows` captures layers, their residual streams `[1, N, C, E]`
        come back last."""
        if self.kv_spec is None:
            raise ValueError(OWN_CACHE_REFUSAL.format(what="a packed pass"))
        numerics = self.numerics.for_pass(prompt_rows=prompt_rows)
        caches = [{} for _ in range(self.kv_spec.num_layers)]  # a packed pass keeps none
        logits, _, *captured = self._pass(
            weights, tokens, positions, caches, numerics, None, all_columns=True, rows=rows,
            packed=packed, read=read,
        )  # fmt: skip
        if not self.family:  # a user's model returns every column's
            if logits.ndim != 3:
                raise ValueError(
                    "scoring needs a model that returns the logits of every column, [B, T, V]; "
                    f"this one returned shape {tuple(logits.shape)}"
                )
            logits = logits[:, read]
        return (logits, *captured)

    def _pass(
        self, weights, tokens, positions, cache, numerics, routing, all_columns=False, rows=None,
        packed=None, read=None,
    ):  # fmt: skip
        """One forward pass: `(logits, cache[, routing used])`, the model handed the pass's
        `KV` over `cache` (a layer list, with the pass's per-row state `rows`; `packed`,
        `read`: a packed pass, `KV.packed` and `KV.read`) and the layers read back from
        what it returns."""
        if self.kv_spec is None:  # a FunctionModel with a cache of its own
            if rows is not None:
                raise ValueError(OWN_CACHE_REFUSAL.format(what="adapter=, steer= or capture="))
            return self.apply_fn(weights, tokens, positions, cache)
        kv = KV(
            cache, positions, self.kv_spec, numerics, all_columns, rows=rows, packed=packed,
            read=read,
        )  # fmt: skip
        if self.family:
            routed = {} if routing is None else {"routing": routing}
            model = nnx.merge(self.graphdef, weights)
            logits, kv_out, *used = model(tokens, positions, kv, **routed)
            out = (logits, kv_out.finish("the model"), *used)
            where = "the model"
        else:
            logits, kv_out, where = self._call_user_model(weights, tokens, positions, kv)
            out = (logits, kv_contract.finish(kv_out, kv, where))
        kv_contract.check_marked(kv_out, where)
        if rows is None or not rows.capture:
            return out
        # The recorded residual streams, [B, T, C, E] in `rows.capture`'s order.
        return (*out, jnp.stack([kv_out.captured[i] for i in rows.capture], axis=2))

    def _call_user_model(self, weights, tokens, positions, kv: KV | None) -> tuple:
        """A user's model (`from_nnx`, a `FunctionModel` with a `KVSpec`) called on one
        pass's `kv`: `(logits, kv returned, where)`, its output's form and logits' shape
        checked (`where` names the model in errors)."""
        if self.graphdef is not None:
            where = "the NNX module"
            out = self.call(nnx.merge(self.graphdef, weights), tokens, positions, kv)
        else:
            where = _function_name(self.apply_fn)
            out = self.apply_fn(weights, tokens, positions, kv)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"{where} must return (logits, kv), got {type(out).__name__}")
        _check_logits(out[0], tokens.shape, self.vocab_size, where)
        return (*out, where)

    def full_forward(self, weights, tokens, positions) -> jax.Array:
        """The model's own forward pass with `kv=None`: plain causal attention over the
        call's columns (what it trains with; `ll.check_model` compares the cached passes
        with it). Logits `[B, T, V]` (a family: every column), or `[B, V]` for a user's
        model that returns the last column only."""
        if self.kv_spec is None:
            raise ValueError(OWN_CACHE_REFUSAL.format(what="a forward pass with kv=None"))
        if self.family:
            return nnx.merge(self.graphdef, weights)(tokens, positions, None, all_columns=True)[0]
        logits, kv_out, where = self._call_user_model(weights, tokens, positions, None)
        if kv_out is not None:
            raise TypeError(
                f"{where} returned {type(kv_out).__name__} as its kv when called with kv=None: "
                "return the kv that ll.attention gave back (None for kv=None)"
            )
        return logits

    def routing_shape(self, weights) -> tuple[int, int] | None:
        """(L, k) of a routing record `[B, T, L, k]`: the model's routed layers and experts
        per token; None where nothing routes (a dense model, a user's model)."""
        if not self.family:
            return None
        model = nnx.merge(self.graphdef, weights)
        routed = model.routed_layers() if hasattr(model, "routed_layers") else ()
        return (len(routed), model.config.num_experts_per_tok) if routed else None

    def no_routing(self, weights, batch: int, width: int) -> jax.Array:
        """`[B, T, L, k]` of -1: every token routed by the router itself, recorded."""
        layers_, k = self.routing_shape(weights)
        return jnp.full((batch, width, layers_, k), -1, jnp.int32)

    def init_cache(self, weights, batch_size: int, max_length: int) -> Any:
        if self.kv_spec is not None:
            return self.kv_spec.init_cache(batch_size, max_length)
        return self.init_cache_fn(batch_size, max_length)

    def sliding_windows(self, weights) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens (None: global); a model with a cache of
        its own: ()."""
        return () if self.kv_spec is None else self.kv_spec.windows

    def kv_bytes_per_token(self, weights) -> int | None:
        """Bytes of keys and values one token holds in a paged pool, every layer together
        (None for a model with a cache of its own)."""
        return None if self.kv_spec is None else self.kv_spec.bytes_per_token()

    def init_pool(self, weights, num_pages: int | tuple[int, ...], page_size: int) -> Any:
        """A paged pool of zeros: per layer `dict(k_pages, v_pages)`, each `[Hkv, num_pages,
        page_size, D]` (`KVSpec.init_pool`; without tables: the loop keeps those in
        `pool.Pool`); `num_pages` one count for every layer or one per layer (a pool with
        layer groups, `pool.PoolShape.layer_pages`)."""
        if self.kv_spec is None:
            raise ValueError(OWN_CACHE_REFUSAL.format(what="a paged pool (kv_cache_tokens)"))
        return self.kv_spec.init_pool(num_pages, page_size)


def _function_name(apply_fn: Callable) -> str:
    """How errors name a FunctionModel's forward: "apply_fn", or for `from_linen`'s
    `functools.partial(module.apply, method=...)` the Linen module and method."""
    module = getattr(getattr(apply_fn, "func", None), "__self__", None)
    if not isinstance(apply_fn, functools.partial) or module is None:
        return "apply_fn"
    method = apply_fn.keywords.get("method") or "__call__"
    return f"the Linen module {type(module).__name__}.{getattr(method, '__name__', method)}"


# Why a FunctionModel with a cache of its own cannot have something (`.format(what=...)`).
OWN_CACHE_REFUSAL = (
    "{what} needs a model whose attention goes through ll.attention: this FunctionModel "
    "keeps a cache of its own (init_cache=); give it kv_spec= instead (docs/own_model.md)"
)


def _check_logits(logits: Any, tokens_shape: tuple, vocab_size: int | None, where: str) -> None:
    """Refuse logits that are not `[B, T, V]` or `[B, V]` for this call, by shape."""
    b, t = tokens_shape
    shape = tuple(getattr(logits, "shape", ()))
    if shape not in ((b, t, vocab_size), (b, vocab_size)):
        raise ValueError(
            f"{where} returned logits of shape {shape} for tokens of shape {(b, t)}: "
            f"expected [B, T, V] = {(b, t, vocab_size)} (or [B, V] = {(b, vocab_size)}, the "
            "last column), V the model's vocab_size"
        )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"{where} returned logits of dtype {logits.dtype}, not a float")


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

    def _pick(self, runner: Any, args) -> tuple[Callable, tuple]:
        """The jitted function for the call and its compiler options (key, value pairs)."""
        runner = getattr(runner, "runner", runner)
        # Inside another program (`generate_many`'s admission) the outer one's options rule.
        nested = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
        if not runner.numerics.fixed or nested:
            return self._plain, ()
        options = runner.numerics.compiler_options()
        key = tuple(sorted(options.items()))
        if key not in self._fixed:
            self._fixed[key] = jax.jit(self._fn, compiler_options=options, **self._kwargs)
        return self._fixed[key], key

    def _stored(self, fn: Callable, options: tuple, runner: Any, args, kwargs):
        """The call as the executable store sees it (`executables.prepare`; None: the store
        is off or does not take this call), with its executable when this process has it
        or loads it from disk (None: it must be compiled)."""
        call = executables.prepare(fn, self._fn, self._kwargs, options, (runner, *args), kwargs)
        if call is None:
            return None, None
        compiled = executables.remembered(call)
        if compiled is None:
            compiled, seconds = executables.timed(executables.load, call)
            if compiled is not None:
                self._record(seconds, runner, args, kwargs, loaded=True)
        return call, compiled

    def _compile_stored(self, call, runner: Any, args, kwargs):
        """Trace, lower and compile the call's program and keep it in the store."""
        with compiles.CompileWatch() as watch:
            compiled = call.compile()
        executables.save(call, compiled, fresh=bool(watch.count))
        if watch.count:  # else this process had compiled it before the store was on
            self._record(watch.seconds, runner, args, kwargs)
        return compiled

    def __call__(self, runner: Any, *args, **kwargs):
        fn, options = self._pick(runner, (args, kwargs))
        call, compiled = self._stored(fn, options, runner, args, kwargs)
        if call is not None:  # the executable store's
            if compiled is None:
                compiled = self._compile_stored(call, runner, args, kwargs)
            out = call.run(compiled)
        else:
            with compiles.CompileWatch() as watch:
                out = fn(runner, *args, **kwargs)
            if watch.count:  # a new program: counted, with what was new (`ll.compile_stats`)
                self._record(watch.seconds, runner, args, kwargs)
        if compiles.logging_programs():  # `ll.precompile(slots=...)`: which programs ran
            if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
                compiles.ran(self._fn.__name__, self._signature(runner, args, kwargs))
        return out

    def trace(self, runner: Any, *args, **kwargs):
        return self._pick(runner, (args, kwargs))[0].trace(runner, *args, **kwargs)

    def precompile(self, runner: Any, *args, **kwargs) -> tuple[Any, bool]:
        """Compile the program a call with these arguments (arrays or
        `jax.ShapeDtypeStruct`s) runs, without running it (`jit(...).trace(...).lower()
        .compile()`; a later call with arguments of the same shapes compiles nothing).
        Returns the call's output shapes (`jax.ShapeDtypeStruct`s) and whether a program was
        compiled (False: this process had it already, or loaded it from the executable
        store)."""
        fn, options = self._pick(runner, (args, kwargs))
        call, compiled = self._stored(fn, options, runner, args, kwargs)
        if call is not None:
            if compiled is not None:
                return compiled.out_info, False
            return self._compile_stored(call, runner, args, kwargs).out_info, True
        with compiles.CompileWatch() as watch:
            traced = fn.trace(runner, *args, **kwargs)
            traced.lower().compile()
        if watch.count:
            self._record(watch.seconds, runner, args, kwargs)
        return traced.out_info, bool(watch.count)

    def _signature(self, runner: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        bound = inspect.signature(self._fn).bind(runner, *args, **kwargs).arguments
        return compiles.signature(bound)

    def _record(
        self, seconds: float, runner: Any, args: tuple, kwargs: dict, loaded: bool = False
    ) -> None:
        model = getattr(runner, "runner", runner)  # a Program holds its model's runner
        sig = self._signature(runner, args, kwargs)
        compiles.record(self._fn.__name__, seconds, sig, model, loaded=loaded)


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
    # E, the residual stream's width (a family's hidden size; None for a user's model).
    residual_width: int | None = None


def _eos_tuple(eos: Any) -> tuple[int, ...]:
    """`eos_token_ids` (None, an id or ids; NumPy's too) as a tuple of ints."""
    if eos is None:
        return ()
    ids = (eos,) if isinstance(eos, (int, np.integer)) else eos
    try:
        ids = tuple(ids)
    except TypeError:
        ids = None
    if ids is None or any(isinstance(e, bool) or not isinstance(e, (int, np.integer)) for e in ids):
        raise ValueError(f"eos_token_ids must be a token id or a list of them, got {eos!r}")
    return tuple(int(e) for e in ids)


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
    if isinstance(model, FunctionModel) and model.kv_spec is None:
        if fixed:
            raise ValueError(OWN_CACHE_REFUSAL.format(what="deterministic=True"))
        return ModelInfo(
            runner=ModelRunner(apply_fn=model.apply_fn, init_cache_fn=model.init_cache),
            weights=model.params,
            vocab_size=int(model.vocab_size),
            max_length=int(model.max_length),
            eos_token_ids=_eos_tuple(model.eos_token_ids),
            tokenizer=model.tokenizer,
        )
    if isinstance(model, (FunctionModel, NNXModel)):  # a user's model through ll.attention
        spec = model.kv_spec
        numerics = _numerics(deterministic, spec.dtype, ())
        if isinstance(model, NNXModel):
            graphdef, weights = nnx.split(model.module)
            runner = ModelRunner(graphdef=graphdef, call=model.call, kv_spec=spec)
        else:
            weights = model.params
            runner = ModelRunner(apply_fn=model.apply_fn, kv_spec=spec)
        runner = dataclasses.replace(runner, vocab_size=int(model.vocab_size), numerics=numerics)
        return ModelInfo(
            runner=runner,
            weights=weights,
            vocab_size=int(model.vocab_size),
            max_length=int(model.max_length),
            eos_token_ids=_eos_tuple(model.eos_token_ids),
            tokenizer=model.tokenizer,
            attention=describe_attention(
                head_dim=spec.head_dim,
                dtype=spec.dtype,
                softcap=None,
                windows=spec.windows,
                deterministic=numerics.fixed,
            ),  # fmt: skip
        )
    if isinstance(model, nnx.Module) and hasattr(model, "kv_spec") and hasattr(model, "config"):
        dtype = getattr(model, "dtype", jnp.float32)
        numerics = _numerics(deterministic, dtype, _product_shapes(model, deterministic))
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
            runner=ModelRunner(graphdef=graphdef, kv_spec=model.kv_spec, numerics=numerics),
            weights=weights,
            vocab_size=int(config.vocab_size),
            max_length=int(config.max_position_embeddings),
            eos_token_ids=_eos_tuple(getattr(config, "eos_token_id", None)),
            tokenizer=getattr(model, "tokenizer", None),
            attention=attention,
            residual_width=int(config.hidden_size),
            weights_format=(
                model.quantization.describe()
                if getattr(model, "quantization", None) is not None
                else "float"
            ),
        )
    hint = (
        "; wrap an NNX module of your own with ll.from_nnx(module, kv_spec, ...)"
        if isinstance(model, nnx.Module)
        else ""
    )
    raise ValueError(
        "model must be a logitloop model, an ll.FunctionModel or an ll.from_nnx / "
        f"ll.from_linen model, got {type(model)!r}{hint}"
    )


def _numerics(deterministic: bool | str | Numerics, dtype: Any, shapes: tuple) -> Numerics:
    """The runner's policy for a `deterministic=` setting (`fixed_order.calibrate`), or the
    `Numerics` given; warns where the model-parallel mode cannot keep a row's bits here."""
    numerics = deterministic
    if not isinstance(numerics, Numerics):
        numerics = fixed_order.calibrate(deterministic, dtype=dtype, shapes=shapes)
    if not numerics.split_rows_keep_bits:
        warnings.warn(
            f"deterministic={MODEL_PARALLEL!r}: this CPU's XLA product rounds a row by "
            "its place in a row tile (rows 6-7 of 8 otherwise than 0-5, as on an AMD "
            "EPYC), so a row's bits may depend on its batch and the mesh here; "
            "deterministic=True is unaffected",
            stacklevel=4,
        )
    return numerics
