"""logitloop as tunix's rollout engine, with the trainer's log-probs the rollout's, bit for bit.

tunix (`google-tunix`, tested with 0.1.7) trains with GRPO/PPO on an `RLCluster` whose
rollout engine is pluggable: `ClusterConfig(rollout_engine=...)` takes, besides its
built-in names, a subclass of `tunix.rl.rollout.base_rollout.BaseRollout` (or a
`functools.partial` of one), which the cluster constructs with `rollout_actor=`,
`tokenizer=`, `mesh=` and `rollout_config=` (rl/rl_cluster.py, `_init_cluster`). This
module gives it:

- `LogitloopRollout`: the engine. `generate` runs `ll.generate` (`deterministic=True` by
  default), `get_per_token_logps` (the old policy when `num_iterations > 1`) runs
  `ll.token_logprobs`, `update_params` writes the trainer's weights with `nnx.update`
  (which compiles nothing). Each row gets its own seed.
- `POLICY_LOSS` (`"logitloop_grpo"`, registered with tunix's documented
  `function_registry.register_policy_loss_fn`): GRPO's clipped loss whose new-policy
  log-probs come from `ll.token_logprobs` instead of tunix's `compute_per_token_logps`
  (one forward over the whole row, `logsumexp`: not the rollout's numerics). Select it
  with `GRPOConfig(policy_loss_fn="logitloop_grpo")`.
- `TunixTokenizer`: the model's tokenizer with the methods tunix's `TokenizerAdapter`
  asks for (`bos_id`, `eos_id`, `pad_id`).

A LoRA policy (tunix's own model under qwix's `LoraProvider`, the base frozen): the engine
decodes a logitloop `model=` of the same base checkpoint with the policy's LoRA state in
an adapter table (`ll.load_adapter(..., alpha=)`), loaded again at every weight sync
(tunix sends `nnx.state(policy, nnx.LoRAParam)`), which compiles nothing.

The log-probs are the sampling distribution's as tunix's trainer defines it,
`log_softmax(logits / temperature)` (raw `log_softmax(logits)` for temperature 0, greedy),
everywhere: in `RolloutOutput.logprobs`, `get_per_token_logps` and the loss. One function,
`completion_logprobs`, computes them from tunix's layout (left-padded prompts, right-padded
completions). Settings the trainer cannot score (top-k, top-p) are refused. docs/rl.md,
"tunix", has the usage and what is not supported.

tunix is an optional extra (`pip install 'logitloop[rl]'`), imported here only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import logitloop as ll
from logitloop.models.qwix_lora import is_state as is_lora_state
from logitloop.models.qwix_lora import largest_rank

MISSING_TUNIX = (
    "logitloop's tunix adapter needs google-tunix, an optional extra: "
    "pip install 'logitloop[rl]' (tested with google-tunix 0.1.7)"
)
try:
    from tunix.rl import algo_core, common, function_registry
    from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - exercised only without tunix
    raise ImportError(MISSING_TUNIX) from e

__all__ = [
    "LORA_POLICY",
    "MISSING_TUNIX",
    "POLICY_LOSS",
    "LogitloopRollout",
    "TunixTokenizer",
    "completion_logprobs",
    "place_on_mesh",
    "sampling_params",
]

POLICY_LOSS = "logitloop_grpo"
LORA_POLICY = "policy"  # the adapter table's name of a LoRA policy's weights


class TunixTokenizer:
    """A logitloop `Tokenizer` with the methods tunix's `TokenizerAdapter` needs. The
    pad id is `pad_id` (default: the first EOS id, as tunix's adapter does for Hugging
    Face tokenizers without a pad token): tunix left-pads prompts and right-pads
    completions with it and masks every position holding it."""

    def __init__(self, tokenizer: Any, pad_id: int | None = None):
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        if pad_id is None and eos is None:
            raise ValueError("pad_id: the tokenizer has no EOS id to pad with; pass pad_id")
        self._pad = int(eos if pad_id is None else pad_id)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(text, **kwargs)

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids], **kwargs)

    def bos_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def pad_id(self) -> int:
        return self._pad


def place_on_mesh(model: Any, mesh: Any = None) -> Any:
    """Lay the model's weights over `mesh` (default: every device on one axis, named
    ("fsdp", "model"), the model axis of size 1) by logitloop's partition rules
    (`logitloop.models.partitioning`) and return the mesh to give tunix as every role's
    `ClusterConfig.role_to_mesh`: the weights' own. `RLCluster` reshards a model whose
    mesh differs by its logical axis names ("vocab", "embed", ...), which are no mesh
    axes (`ValueError: Resource axis: vocab of P('vocab', 'embed') is not found in
    mesh`)."""
    from logitloop.models.partitioning import shard_model  # noqa: PLC0415

    if mesh is None:
        mesh = jax.make_mesh((len(jax.devices()), 1), ("fsdp", "model"))
    shard_model(model, mesh)
    return jax.tree.leaves(nnx.state(model, nnx.Param))[0].sharding.mesh


def sampling_params(config: Any, seeds: Any) -> ll.SamplingParams:
    """A tunix `RolloutConfig` as logitloop `SamplingParams`, one row per seed; raises
    ValueError naming a field logitloop's rollout or tunix's trainer cannot honour."""
    if config.top_k not in (None, 0, -1):
        raise ValueError(
            f"rollout_config.top_k = {config.top_k}: tunix's trainer scores "
            "log_softmax(logits / temperature), not the top-k distribution the tokens "
            "would come from; allowed: None, 0 or -1 (all tokens)"
        )
    if config.top_p not in (None, 1.0):
        raise ValueError(
            f"rollout_config.top_p = {config.top_p}: tunix's trainer scores "
            "log_softmax(logits / temperature), not the top-p distribution the tokens "
            "would come from; allowed: None or 1.0"
        )
    if config.temperature < 0:
        raise ValueError(f"rollout_config.temperature = {config.temperature}: must be >= 0")
    if config.max_tokens_to_generate < 1:
        raise ValueError(
            f"rollout_config.max_tokens_to_generate = {config.max_tokens_to_generate}: must be >= 1"
        )
    for name in ("tensor_parallel_size", "data_parallel_size", "expert_parallel_size"):
        if getattr(config, name) > 1:
            raise ValueError(
                f"rollout_config.{name} = {getattr(config, name)}: the logitloop rollout "
                "engine runs on one device (leave it at -1 or 1)"
            )
    stop = {}
    if config.eos_tokens is not None:  # these stop a row instead of the model's EOS ids
        stop = dict(stop_token_ids=[list(map(int, config.eos_tokens))] * len(seeds))
    return ll.SamplingParams.create(
        len(seeds),
        temperature=float(config.temperature),
        max_tokens=int(config.max_tokens_to_generate),
        seed=[int(s) for s in seeds],
        **stop,
    )


def completion_logprobs(
    model: Any,
    prompt_tokens: Any,  # [B, P] int, left-padded with pad_id
    completion_tokens: Any,  # [B, C] int, right-padded with pad_id
    pad_id: int,
    temperature: float,
    deterministic: bool | str = True,
    adapters: Any = None,
    adapter: Any = None,
) -> jax.Array:
    """`[B, C]` log-probs of tunix's completion tokens, the trainer's definition
    (`log_softmax(logits / temperature)`, raw for temperature 0), 0.0 at padding: tunix's
    layout laid out as `ll.token_logprobs` takes it and its values read back. Pure and
    differentiable in the model's weights; usable under `jax.jit` (only shapes are checked
    there). A prompt row's leading `pad_id`s are its padding, a completion row ends at its
    first `pad_id` (tunix's masks). `adapters`, `adapter`: each row under its LoRA
    adapter (`ll.token_logprobs`)."""
    prompt = jnp.asarray(prompt_tokens, jnp.int32)
    completion = jnp.asarray(completion_tokens, jnp.int32)
    p_width, c_width = prompt.shape[1], completion.shape[1]
    lead = jnp.argmin(prompt == pad_id, axis=1).astype(jnp.int32)  # first prompt token
    prompt_len = p_width - lead
    completion_len = jnp.cumprod(completion != pad_id, axis=1).sum(1).astype(jnp.int32)
    rows = jnp.concatenate([prompt, completion], axis=1)  # [B, P + C]
    src = jnp.arange(p_width + c_width)[None, :] + lead[:, None]  # the padding shifted out
    ids = jnp.where(src < p_width + c_width, jnp.take_along_axis(rows, jnp.minimum(
        src, p_width + c_width - 1), axis=1), 0)  # fmt: skip
    lengths = prompt_len + completion_len
    # Temperature 0 (greedy) and 1 are the raw log-softmax: the sampler's own raw values,
    # whatever the row's seed. Other temperatures run the sampler's processed pipeline, whose
    # value for a token depends on the seed in the last bits (the token its own draw picks
    # takes the draw's path); tunix does not hand the trainer the seeds, so these rows use
    # seed 0 everywhere, and the rollout reports these values too (`LogitloopRollout`).
    raw = float(temperature) in (0.0, 1.0)
    params = None if raw else _temperature_rows(prompt.shape[0], float(temperature))
    out = ll.token_logprobs(
        model, ids, prompt_len, params, lengths=lengths, deterministic=deterministic,
        adapters=adapters, adapter=adapter,
    )  # fmt: skip
    lp = out.raw_logprobs if raw else out.logprobs
    j = jnp.arange(c_width)[None, :]
    at = jnp.take_along_axis(lp, jnp.minimum(prompt_len[:, None] + j, lp.shape[1] - 1), axis=1)
    return jnp.where(j < completion_len[:, None], at, 0.0)


def _temperature_rows(batch: int, temperature: float) -> ll.SamplingParams:
    """Rows with only a temperature: the processed log-probs are log_softmax(logits / T),
    whatever the seed (no filter draws). Made on the host even inside a trace (tunix's
    jitted train step): `token_logprobs` checks their token ids there."""
    with jax.ensure_compile_time_eval():
        return ll.SamplingParams.create(batch, temperature=temperature, seed=0)


class LogitloopRollout(base_rollout.BaseRollout):
    """tunix's rollout engine running `ll.generate` (module docstring). tunix constructs
    it from `ClusterConfig.rollout_engine`; `functools.partial(LogitloopRollout,
    deterministic=False)` changes the numerics mode (then the log-probs of the rollout
    and of the trainer are no longer bit for bit equal).

    A LoRA policy (`rollout_actor` holds `nnx.LoRAParam`s: tunix's Llama 3 / Qwen2 /
    Qwen3 / Gemma 2 / Gemma 3 under qwix's `LoraProvider`):
    `functools.partial(LogitloopRollout, model=..., lora_alpha=...)`, `model` the
    logitloop model of the policy's base checkpoint and `lora_alpha` the provider's. The
    policy's LoRA state is loaded into an adapter table (one slot, of the state's largest
    rank) now and at every `update_params` tunix makes with it; rows decode and are
    scored under it; `model()` is the logitloop model (so tunix, seeing other weights than
    its trainer's, syncs them)."""

    def __init__(
        self,
        rollout_actor: Any,
        tokenizer: Any = None,
        mesh: Any = None,
        rollout_config: Any = None,
        *,
        deterministic: bool | str = True,
        seed: int = 0,
        model: Any = None,
        lora_alpha: float | None = None,
    ):
        if mesh is not None and getattr(mesh, "size", 1) > 1:
            raise ValueError(
                f"mesh: the logitloop rollout engine runs on one device, got a mesh of "
                f"{mesh.size} devices"
            )
        lora = nnx.state(rollout_actor, nnx.LoRAParam)
        self._adapters = self._alpha = None
        if jax.tree.leaves(lora):
            if model is None or lora_alpha is None:
                raise ValueError(
                    "rollout_actor is a LoRA policy (it holds nnx.LoRAParam): pass model= "
                    "(the logitloop model of its base checkpoint) and lora_alpha= (the qwix "
                    "LoraProvider's alpha), e.g. functools.partial(LogitloopRollout, "
                    "model=..., lora_alpha=...)"
                )
            rank = largest_rank(lora)
            self._alpha = lora_alpha
            self._adapters = ll.load_adapter(
                model, lora, name=LORA_POLICY, alpha=lora_alpha, max_adapters=1, max_rank=rank
            )
        elif model is not None or lora_alpha is not None:
            raise ValueError(
                "model= and lora_alpha= go with a LoRA policy; rollout_actor holds no "
                "nnx.LoRAParam (it is the model the engine decodes)"
            )
        self._model = rollout_actor if model is None else model
        # tunix hands its TokenizerAdapter (over a `TunixTokenizer`): its pad id is the
        # one the learner pads and masks with.
        tokenizer = tokenizer or TunixTokenizer(self._model.tokenizer)
        self._pad = int(tokenizer.pad_id())
        self._config = rollout_config
        self.deterministic = deterministic
        self._seed = int(seed)
        self._calls = 0  # each generate call draws new seeds, reproducibly

    # ------------------------------------------------------------------ tunix's interface

    def generate(self, prompts: list[str], rollout_config: Any, **kwargs: Any) -> Any:
        """`ll.generate` over `prompts` (tunix repeats each prompt `num_generations` times;
        each row gets its own seed, from `rollout_config.seed` (or the engine's `seed`)
        and the call's index)."""
        if kwargs:
            raise TypeError(f"LogitloopRollout.generate: unsupported arguments {sorted(kwargs)}")
        if rollout_config.data_type is not None and (
            jnp.dtype(rollout_config.data_type) != jnp.dtype(self._model.dtype)
        ):
            raise ValueError(
                f"rollout_config.data_type = {rollout_config.data_type}: the rollout runs "
                f"the trainer's model, whose dtype is {self._model.dtype}"
            )
        tokenizer = self._model.tokenizer
        ids = [tokenizer.encode(_text(p)) for p in prompts]
        width = int(rollout_config.max_prompt_length)
        for r, row in enumerate(ids):
            if not 1 <= len(row) <= width:
                raise ValueError(
                    f"prompts[{r}] has {len(row)} tokens, outside the allowed range [1, "
                    f"{width}] (rollout_config.max_prompt_length)"
                )
        seeds = self._row_seeds(rollout_config.seed, len(ids))
        params = sampling_params(rollout_config, seeds)
        self._config = rollout_config
        ignore_eos = rollout_config.eos_tokens is not None
        gen = ll.generate(
            self._model, ids, params, deterministic=self.deterministic, ignore_eos=ignore_eos,
            **self._adapter_rows(),
        )  # fmt: skip
        padded = np.full((len(ids), width), self._pad, np.int32)
        for r, row in enumerate(ids):
            padded[r, width - len(row) :] = row
        tokens = [np.asarray(t, np.int32) for t in gen.token_ids]
        steps = int(rollout_config.max_tokens_to_generate)
        completions = np.full((len(ids), steps), self._pad, np.int32)
        for r, row in enumerate(tokens):
            completions[r, : len(row)] = row
        # The trainer function's values of these tokens, laid out as tunix lays them out
        # for `get_per_token_logps` and the loss (`completion_logprobs` says why).
        scored = np.asarray(self.get_per_token_logps(padded, completions))
        return base_rollout.RolloutOutput(
            text=list(gen.text),
            logits=None,  # [T, V] per row: not kept (tunix's GRPO does not read them)
            tokens=tokens,
            left_padded_prompt_tokens=padded,
            logprobs=[scored[r, : len(t)] for r, t in enumerate(tokens)],
        )

    def get_per_token_logps(self, prompt_tokens: Any, completion_tokens: Any) -> jax.Array:
        """The rollout policy's log-probs of the completions (`completion_logprobs` at the
        last rollout's temperature): bit for bit `generate`'s, deterministic mode."""
        temperature = 1.0 if self._config is None else float(self._config.temperature)
        lp = completion_logprobs(
            self._model, prompt_tokens, completion_tokens, self._pad, temperature,
            self.deterministic, **self._adapter_rows(),
        )  # fmt: skip
        return jax.lax.stop_gradient(lp)

    def update_params(self, params: Any, filter_types: Any = None) -> None:
        """The trainer's weights into the rollout model with `nnx.update`: same tree, each
        leaf cast to the rollout weight's dtype (logitloop refuses another float dtype),
        so nothing compiles again. A LoRA policy's LoRA state goes into the adapter table
        instead (its values only: nothing compiles either)."""
        if self._adapters is not None and jax.tree.leaves(params) and is_lora_state(params):
            self._adapters = self._adapters.load(params, name=LORA_POLICY, alpha=self._alpha)
            return
        current = nnx.state(self._model, *(filter_types or (nnx.Param,)))
        cast = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), params, current)
        nnx.update(self._model, cast)

    def pad_id(self) -> int:
        return self._pad

    def eos_id(self) -> int:
        return int(self._model.tokenizer.eos_token_id)

    def model(self) -> Any:
        return self._model

    # ------------------------------------------------------------------ helpers

    def _adapter_rows(self) -> dict[str, Any]:
        """The LoRA policy's table and adapter for every row (none without one)."""
        if self._adapters is None:
            return {}
        return dict(adapters=self._adapters, adapter=LORA_POLICY)

    def _row_seeds(self, seed: Any, rows: int) -> np.ndarray:
        base = self._seed if seed is None else int(np.asarray(seed).reshape(-1)[0])
        self._calls += 1
        entropy = [base & 0xFFFFFFFF, self._calls]
        return np.random.SeedSequence(entropy).generate_state(rows) & 0x7FFFFFFF


def _text(prompt: Any) -> str:
    """A prompt as tunix hands it (a str, or a numpy string scalar after its batching)."""
    value = prompt.item() if isinstance(prompt, np.ndarray | np.generic) else prompt
    return value.decode() if isinstance(value, bytes) else str(value)


@function_registry.register_policy_loss_fn(POLICY_LOSS)
def grpo_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    """GRPO's clipped policy loss (tunix's `grpo` loss: per-token ratio, `epsilon` /
    `epsilon_high` clipping, `loss_agg_mode` aggregation, `beta` KL to the reference)
    with the new policy's log-probs from `completion_logprobs`, the rollout's numerics
    (deterministic mode). Refuses what it does not implement (`loss_algo="gspo-token"`,
    `epsilon_c`, sampler importance weights, packed sequences)."""
    del eos_id, kwargs
    if algo_config.loss_algo != "grpo":
        raise ValueError(f"algo_config.loss_algo = {algo_config.loss_algo!r}: {POLICY_LOSS} "
                         "implements 'grpo' only")  # fmt: skip
    for name in ("epsilon_c", "sampler_is_weights", "segment_ids"):
        source = train_example if name != "epsilon_c" else algo_config
        if getattr(source, name, None) is not None:
            raise ValueError(f"{name}: not supported by the {POLICY_LOSS} policy loss")
    mask = train_example.completion_mask
    logps = completion_logprobs(
        model, train_example.prompt_ids, train_example.completion_ids, pad_id,
        algo_config.temperature, getattr(algo_config, "deterministic", True),
    )  # fmt: skip
    old = train_example.old_per_token_logps
    old = jax.lax.stop_gradient(logps) if old is None else old.astype(jnp.float32)
    log_ratio = jnp.clip(logps - old, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    adv = train_example.advantages.astype(jnp.float32)
    adv = adv if adv.ndim == 2 else adv[:, None]
    eps_low = algo_config.epsilon
    eps_high = getattr(algo_config, "epsilon_high", None) or eps_low
    unclipped, clipped = -adv * ratio, -adv * jnp.clip(ratio, 1 - eps_low, 1 + eps_high)
    per_token = jnp.maximum(unclipped, clipped)
    aux = {
        "kl": 0.0,
        "pg_clipfrac": algo_core.masked_mean(jnp.greater(clipped, unclipped), mask),
        "ppo_kl": algo_core.masked_mean(-log_ratio, mask),
    }
    loss = common.aggregate_loss(per_token, mask, algo_config.loss_agg_mode)
    if train_example.ref_per_token_logps is not None:  # as tunix's `grpo` loss adds it
        kl = common.compute_kl_divergence(
            logps, train_example.ref_per_token_logps, algo_config.kl_loss_mode,
            clamp_value=getattr(algo_config, "kl_clamp_value", None),
        )  # fmt: skip
        aux["kl"] = algo_core.masked_mean(kl, mask)
        loss = loss + algo_config.beta * common.aggregate_loss(kl, mask, algo_config.loss_agg_mode)
    return loss, aux
