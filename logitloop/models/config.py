"""Model configurations built from a Hugging Face `config.json`.

Each architecture has one frozen, keyword-only dataclass and a parser from `config.json`
(`*_config_from_hf`); `logitloop.models.registry` says which parser reads which
`model_type`. Instances are hashable (every field is a scalar, a tuple or another frozen
dataclass) because the config lives on the model as a static attribute, and so inside the
`GraphDef` that `nnx.split` hands to `jax.jit`.

`config_from_hf` reads both the current `transformers` layout (`rope_parameters`) and the
older one (`rope_theta` + `rope_scaling`), so checkpoints written by either load.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from logitloop.models import registry
from logitloop.models.checkpoint import (  # noqa: F401 - re-exported: config's names
    SUPPORTED_ACTIVATIONS,
    HFConfig,
    _check_activation,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding parameters.

    `rope_type` is "default" (plain RoPE), "linear" (positions divided by `factor`),
    "llama3" (Llama 3.1 frequency-dependent scaling, which also uses `low_freq_factor`,
    `high_freq_factor` and `original_max_position_embeddings`) or "longrope" (Phi-3's,
    once called "su": each frequency divided by its `short_factor`, or by its
    `long_factor` for a row whose call reaches past `original_max_position_embeddings`;
    cos and sin multiplied by `attention_factor`).
    `partial_rotary_factor` < 1 rotates only that leading fraction of each head (Phi-3).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Llama 2/3, Mistral, Qwen2 and Qwen3: one decoder with a few switches.

    Attributes:
      model_type: the Hugging Face `model_type` the config came from.
      vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
      num_heads, num_kv_heads, head_dim: query heads, key/value heads (grouped-query
        attention when fewer than `num_heads`), and the per-head width.
      sliding_windows: one entry per layer, the attention window in tokens, or None for
        full causal attention.
      qkv_bias / o_bias / mlp_bias: biases on the q/k/v, output and MLP projections.
      qk_norm: Qwen3's per-head RMSNorm on queries and keys before RoPE.
      eos_token_id: every end-of-sequence id (from `generation_config.json` when present);
        possibly empty.
    """

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    sliding_windows: tuple[int | None, ...] = ()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig(LlamaConfig):
    """Gemma 2 and Gemma 3 (text): the Llama fields plus what Gemma changes.

    Attributes:
      local_rope: the RoPE of the sliding-window layers (Gemma 3's `rope_local_base_freq`);
        `rope` serves the global ones.
      query_pre_attn_scalar: queries are scaled by `query_pre_attn_scalar ** -0.5`.
      attn_logit_softcapping / final_logit_softcapping: `cap * tanh(x / cap)` on the
        attention scores / the output logits (Gemma 2), or None.
    """

    model_type: str = "gemma2"
    local_rope: RopeConfig = RopeConfig()
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig(LlamaConfig):
    """Mixtral and Qwen3-MoE: the Llama fields plus top-k routed experts.

    Attributes:
      num_experts, num_experts_per_tok: experts per sparse layer, and how many each token
        is routed to.
      moe_intermediate_size: each expert's MLP width (`intermediate_size` is the width of
        the dense MLP of the layers that have one).
      norm_topk_prob: renormalise the chosen experts' softmax weights to sum to 1
        (always in Mixtral; as configured in Qwen3-MoE).
      sparse_layers: one entry per layer, True where the MLP is the mixture.
    """

    model_type: str = "mixtral"
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if not self.sparse_layers:
            object.__setattr__(self, "sparse_layers", (True,) * self.num_layers)
        if len(self.sparse_layers) != self.num_layers:
            raise ValueError(
                f"sparse_layers has {len(self.sparse_layers)} entries for {self.num_layers} layers"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts "
                f"({self.num_experts})]"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config:
    """GPT-2: learned positions, pre-LayerNorm blocks, tied LM head."""

    model_type: str = "gpt2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads  # no grouped-query attention

    @property
    def sliding_windows(self) -> tuple[None, ...]:
        return (None,) * self.num_layers  # every layer attends all earlier positions

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"n_embd ({self.hidden_size}) must be a multiple of n_head ({self.num_heads})"
            )


class ModelConfig(Protocol):
    """What the library reads from any family's config (each family adds its own sizes)."""

    model_type: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_id: tuple[int, ...]
    bos_token_id: int | None


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """A JSON-ready dict; `config_from_dict` inverts it."""
    return dataclasses.asdict(config)


def config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    """Rebuild a config written by `config_to_dict` (its family chosen by `model_type`)."""
    # Files written before GPT-2 was supported had only Llama-family configs.
    family = registry.family_for(data.get("model_type", "llama"))
    return _dataclass_from_dict(family.config_class, data)


def _dataclass_from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """`cls(**data)`, with JSON lists turned back into tuples and nested dataclasses rebuilt
    from their dicts (as the field types say)."""
    kwargs = dict(data)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name not in kwargs:
            continue
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            kwargs[field.name] = _dataclass_from_dict(hint, kwargs[field.name])
        elif typing.get_origin(hint) is tuple:
            kwargs[field.name] = tuple(kwargs[field.name])
    return cls(**kwargs)


def config_from_hf(
    hf: Mapping[str, Any],
    *,
    generation_config: Mapping[str, Any] | None = None,
    source: str = "config.json",
    generation_source: str = "generation_config.json",
) -> ModelConfig:
    """Build a config from the parsed `config.json` of a Hugging Face checkpoint.

    The family registered for its `model_type` (`logitloop.models.registry`) parses it.

    Args:
      hf: the parsed `config.json`.
      generation_config: the parsed `generation_config.json`, if any; its
        `eos_token_id` / `bos_token_id` take precedence, as in `transformers.generate`.
      source, generation_source: the file names used in error messages.

    Raises:
      ValueError: naming the file and the field, for an unsupported `model_type`, RoPE
        type or activation, a missing required field, a size that is not a positive
        integer, or an EOS/BOS token id that is not an id inside the vocabulary.
    """
    try:
        family = registry.family_for(hf.get("model_type"))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    _check_hf_fields(hf, generation_config, source, generation_source)

    ids = dict(hf)
    for key in ("eos_token_id", "bos_token_id"):
        if generation_config is not None and generation_config.get(key) is not None:
            ids[key] = generation_config[key]
    eos = ids.get("eos_token_id")
    eos_ids = (
        () if eos is None else tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    )
    bos = ids.get("bos_token_id")
    bos_id = None if bos is None else int(bos)
    return family.parse_config(
        HFConfig(hf, source=source, eos_token_id=eos_ids, bos_token_id=bos_id)
    )


def gpt2_config_from_hf(hf: HFConfig) -> GPT2Config:
    """A `GPT2Config` from GPT-2's own field names (`n_embd`, `n_layer`, ...)."""
    hidden = int(hf.need("n_embd"))
    act = hf.activation("activation_function", "gelu_new")
    return GPT2Config(
        vocab_size=int(hf.need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(hf.get("n_inner") or 4 * hidden),
        num_layers=int(hf.need("n_layer")),
        num_heads=int(hf.need("n_head")),
        max_position_embeddings=int(hf.need("n_positions")),
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        hidden_act=act,
        scale_attn_weights=bool(hf.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
        eos_token_id=hf.eos_token_id,
        bos_token_id=hf.bos_token_id,
    )


def no_sliding_windows(hf: HFConfig, num_layers: int) -> tuple[int | None, ...]:
    """Llama: full causal attention on every layer, whatever the file says."""
    return (None,) * num_layers


def mistral_sliding_windows(hf: HFConfig, num_layers: int) -> tuple[int | None, ...]:
    """Mistral applies its window to every layer whenever the config sets one."""
    window = hf.get("sliding_window")
    return (None if window is None else int(window),) * num_layers


def qwen_sliding_windows(hf: HFConfig, num_layers: int) -> tuple[int | None, ...]:
    """Qwen2/3: only with `use_sliding_window`, and only on layers marked as sliding
    (`layer_types`, or for older files every layer from `max_window_layers` on)."""
    window = hf.get("sliding_window")
    if window is None or not hf.get("use_sliding_window", False):
        return (None,) * num_layers
    layer_types = hf.get("layer_types") or [
        "sliding_attention"
        if i >= int(hf.get("max_window_layers", num_layers))
        else "full_attention"
        for i in range(num_layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def llama_config_from_hf(
    hf: HFConfig,
    *,
    sliding_windows: Callable[[HFConfig, int], tuple[int | None, ...]] = no_sliding_windows,
    qkv_bias_only: bool = False,
    qk_norm: bool = False,
) -> LlamaConfig:
    """A `LlamaConfig` from the Llama-style field names that Mistral and Qwen share.

    Args:
      hf: the parsed `config.json`.
      sliding_windows: (hf, num_layers) -> the per-layer windows, as the type reads them.
      qkv_bias_only: Qwen2: biases on q/k/v always, none on the output projection
        (Llama-style configs put `attention_bias` on all four).
      qk_norm: Qwen3's per-head RMSNorm on queries and keys.
    """
    hidden = int(hf.need("hidden_size"))
    num_heads = int(hf.need("num_attention_heads"))
    num_layers = int(hf.need("num_hidden_layers"))
    act = hf.activation("hidden_act", "silu")
    attention_bias = bool(hf.get("attention_bias", False))
    return LlamaConfig(
        model_type=hf.model_type,
        vocab_size=int(hf.need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(hf.need("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        max_position_embeddings=int(hf.need("max_position_embeddings")),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf.fields, hf.source),
        sliding_windows=sliding_windows(hf, num_layers),
        qkv_bias=qkv_bias_only or attention_bias,
        o_bias=not qkv_bias_only and attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=qk_norm,
        hidden_act=act,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_id=hf.eos_token_id,
        bos_token_id=hf.bos_token_id,
    )


def _layer_type_windows(hf: HFConfig, num_layers: int, pattern: int) -> tuple[int | None, ...]:
    """Gemma: the window on "sliding_attention" layers (`layer_types`, or by default every
    layer but each `pattern`-th), None on "full_attention" ones."""
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    if len(layer_types) != num_layers:
        raise ValueError(
            f"{hf.source}: layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    for t in layer_types:
        if t not in ("sliding_attention", "full_attention"):
            raise ValueError(f"{hf.source}: unsupported layer_types entry {t!r}")
    if window is None:
        return (None,) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _optional_cap(hf: HFConfig, key: str) -> float | None:
    """A soft cap (`cap * tanh(x / cap)`): None (no cap) or a positive finite number, else a
    ValueError naming the file and the field (0 divided the scores by zero: NaN)."""
    value = hf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(
            f"{hf.source}: {key} = {value!r} must be null (no cap) or a positive number"
        )
    return float(value)


def gemma_config_from_hf(hf: HFConfig) -> GemmaConfig:
    """A `GemmaConfig` from a gemma2 or gemma3_text `config.json` (or the `text_config` of a
    gemma3 one)."""
    gemma3 = hf.model_type != "gemma2"
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            f"{hf.source}: use_bidirectional_attention = true is not supported (causal "
            "decoding only)"
        )
    num_layers = int(hf.need("num_hidden_layers"))
    if gemma3:
        windows = _layer_type_windows(hf, num_layers, int(hf.get("sliding_window_pattern", 6)))
        global_rope, local_rope = _gemma3_ropes(hf)
    else:
        windows = _layer_type_windows(hf, num_layers, 2)
        global_rope = local_rope = _rope_from_hf(hf.fields, hf.source)
    base = llama_config_from_hf(
        dataclasses.replace(
            hf,
            fields={
                **hf.fields,
                "hidden_act": hf.get("hidden_activation")
                or hf.get("hidden_act")
                or "gelu_pytorch_tanh",
                "rope_parameters": None,
                "rope_scaling": None,
                "tie_word_embeddings": hf.get("tie_word_embeddings", True),
            },
        ),
        qk_norm=gemma3,
    )
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
    return GemmaConfig(
        **{
            **fields,
            "model_type": hf.model_type,
            "rope": global_rope,
            "sliding_windows": windows,
        },
        local_rope=local_rope,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=_optional_cap(hf, "attn_logit_softcapping"),
        final_logit_softcapping=_optional_cap(hf, "final_logit_softcapping"),
    )


def gemma3_config_from_hf(hf: HFConfig) -> GemmaConfig:
    """A `GemmaConfig` for the language model of a multimodal gemma3 checkpoint, from its
    `text_config` (the vision tower is not loaded)."""
    text = hf.need("text_config")
    source = f"{hf.source} (text_config)"
    _check_hf_fields(text, None, source, source)
    eos, bos = hf.eos_token_id, hf.bos_token_id
    if not eos and text.get("eos_token_id") is not None:
        value = text["eos_token_id"]
        eos = tuple(int(i) for i in (value if isinstance(value, list) else [value]))
    if bos is None and text.get("bos_token_id") is not None:
        bos = int(text["bos_token_id"])
    fields = {**text, "model_type": hf.model_type}
    if hf.get("tie_word_embeddings") is not None:
        fields["tie_word_embeddings"] = hf.get("tie_word_embeddings")
    return gemma_config_from_hf(HFConfig(fields, source=source, eos_token_id=eos, bos_token_id=bos))


def _gemma3_ropes(hf: HFConfig) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's (global, local) RoPE: `rope_parameters` keyed by layer type (transformers
    >= 5), or `rope_theta` + `rope_scaling` for the global layers and
    `rope_local_base_freq` for the local ones (older files)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        return (
            _rope_from_hf({"rope_parameters": {"rope_theta": 1e6, **full}}, hf.source),
            _rope_from_hf({"rope_parameters": {"rope_theta": 1e4, **local}}, hf.source),
        )
    full = {"rope_theta": hf.get("rope_theta", 1e6), **(params or hf.get("rope_scaling") or {})}
    local = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
    return (
        _rope_from_hf({"rope_parameters": full}, hf.source),
        _rope_from_hf({"rope_parameters": local}, hf.source),
    )


def mixtral_config_from_hf(hf: HFConfig) -> MoeConfig:
    """Mixtral: Mistral attention; every layer a mixture of `num_local_experts` experts of
    width `intermediate_size`, the top-k weights always renormalised."""
    base = llama_config_from_hf(hf, sliding_windows=mistral_sliding_windows)
    return _moe_config(
        base,
        num_experts=int(hf.need("num_local_experts")),
        num_experts_per_tok=int(hf.need("num_experts_per_tok")),
        moe_intermediate_size=base.intermediate_size,
        norm_topk_prob=True,
    )


def qwen3_moe_config_from_hf(hf: HFConfig) -> MoeConfig:
    """Qwen3-MoE: Qwen3 attention; a mixture on each layer not in `mlp_only_layers` whose
    number + 1 is a multiple of `decoder_sparse_step`, a dense MLP on the others."""
    base = llama_config_from_hf(hf, sliding_windows=qwen_sliding_windows, qk_norm=True)
    # Hub files say num_experts; transformers 5 writes its alias num_local_experts.
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    num_experts = int(hf.need(key))
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(base.num_layers)
    )
    return _moe_config(
        base,
        num_experts=num_experts,
        num_experts_per_tok=int(hf.need("num_experts_per_tok")),
        moe_intermediate_size=int(hf.need("moe_intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def _moe_config(base: LlamaConfig, **moe: Any) -> MoeConfig:
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
    return MoeConfig(**fields, **moe)


# Fields that hold a size, under the names of every registered family's config.json: each
# one present must be a positive integer.
_SIZE_FIELDS = (
    "vocab_size",
    "n_embd",
    "n_inner",
    "n_layer",
    "n_head",
    "n_positions",  # GPT-2's names
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_hf_fields(
    hf: Mapping[str, Any],
    generation_config: Mapping[str, Any] | None,
    source: str,
    generation_source: str,
) -> None:
    """Sizes are positive integers and EOS/BOS ids are token ids inside the vocabulary, each
    error naming the file and the field (before any of them is used)."""
    for key in _SIZE_FIELDS:
        value = hf.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{source}: {key} = {value!r} must be a positive integer")
    vocab = hf.get("vocab_size")
    for key in ("eos_token_id", "bos_token_id"):
        where, value = source, hf.get(key)
        if generation_config is not None and generation_config.get(key) is not None:
            where, value = generation_source, generation_config[key]
        if value is None:
            continue
        ids = value if key == "eos_token_id" and isinstance(value, list) else [value]
        what = "a token id or a list of token ids" if key == "eos_token_id" else "a token id"
        for tok in ids:
            if not _is_int(tok):
                raise ValueError(f"{where}: {key} = {value!r} must be {what} (integers)")
            if tok < 0 or (vocab is not None and tok >= vocab):
                top = "" if vocab is None else f", {vocab - 1}]"
                raise ValueError(
                    f"{where}: {key} = {value!r} holds {tok}, outside the vocabulary range "
                    f"[0{top or ', ...)'}"
                )


def _rope_from_hf(hf: Mapping[str, Any], source: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files write
    # `rope_theta` and an optional `rope_scaling` whose type key was once called "type".
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "su":  # Phi-3's first name for longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: unsupported RoPE type {rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "longrope":
        return _longrope_from_hf(hf, params, theta, source)
    if "factor" not in params:
        raise ValueError(f"{source}: RoPE type {rope_type!r} requires 'factor'")
    if rope_type == "linear":
        return RopeConfig(rope_type="linear", theta=theta, factor=float(params["factor"]))
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(
            f"{source}: RoPE type 'llama3' requires 'original_max_position_embeddings'"
        )
    return RopeConfig(
        rope_type="llama3",
        theta=theta,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def _longrope_from_hf(
    hf: Mapping[str, Any], params: Mapping[str, Any], theta: float, source: str
) -> RopeConfig:
    """Phi-3's "longrope" ("su"), with transformers' defaults for `factor` (the context
    growth `max_position_embeddings / original_max_position_embeddings`) and
    `attention_factor` (`sqrt(1 + log(factor) / log(original))`, 1 when factor <= 1)."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(params.get(key), list):
            raise ValueError(f"{source}: RoPE type 'longrope' requires a list {key!r}")
    original = params.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings"
    )
    if original is None:
        raise ValueError(
            f"{source}: RoPE type 'longrope' requires 'original_max_position_embeddings'"
        )
    factor = params.get("factor")
    if factor is None:
        factor = hf.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeConfig(
        rope_type="longrope",
        theta=theta,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        attention_factor=float(attention_factor),
    )
