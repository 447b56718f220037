"""LoRA adapters on the host: `ll.load_adapter` reads a PEFT adapter into an `Adapters`
table of fixed shape (`logitloop.models.lora`), and the entry points resolve each row's
adapter name to its slot (`Adapters.slots`).

    adapters = ll.load_adapter(model, "path/to/adapter_a", name="a")  # a new table
    adapters = ll.load_adapter(model, "path/to/adapter_b", name="b", adapters=adapters)
    ll.generate(model, prompts, adapters=adapters, adapter=["a", None, "b"])

An `Adapters` is a value: loading, replacing or removing an adapter returns a new one of
the same shapes (`max_adapters` slots of rank up to `max_rank` over the model's target
projections, zero-padded), so nothing compiles again. Files are read as data only
(`adapter_config.json` with `json`, tensors with safetensors): nothing in them runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from logitloop.models import qwix_lora
from logitloop.models.lora import LoraTable, site_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A PEFT tensor name: `...layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight`.
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclasses.dataclass(frozen=True)
class Adapters:
    """A table of LoRA adapters for one model (module docstring): `names[s]` is slot s's
    adapter (None: empty), `table` the device arrays (`lora.LoraTable`), `sites` the
    model's target projections `(layer, target) -> (K, N)`."""

    sites: Mapping[tuple[int, str], tuple[int, int]]
    names: tuple[str | None, ...]
    table: LoraTable

    @classmethod
    def create(
        cls,
        model: Any = None,
        *,
        max_adapters: int = 4,
        max_rank: int = 16,
        sites: Mapping[tuple[int, str], tuple[int, int]] | None = None,
        dtype: Any = None,
    ) -> Adapters:
        """An empty table for `model` (its `lora_sites()`; a model of your own gives
        `sites={(layer, target): (K, N)}` for each `ll.dense(..., lora=(layer, target))`
        it calls) of `max_adapters` slots of rank up to `max_rank`, in the model's dtype."""
        for name, value in (("max_adapters", max_adapters), ("max_rank", max_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if sites is None:
            if not hasattr(model, "lora_sites"):
                raise ValueError(
                    f"{type(model).__name__} does not say which projections LoRA may target "
                    "(no lora_sites()): pass sites={(layer, target): (K, N)} for each "
                    "ll.dense(x, w, kv, lora=(layer, target)) the model calls"
                )
            sites = model.lora_sites()
        dtype = jnp.dtype(dtype or getattr(model, "dtype", jnp.float32))
        width = max_adapters * max_rank
        arrays = {  # placed from the host: nothing compiles
            site_name(*key): (
                jax.device_put(np.zeros((k, width), dtype)),
                jax.device_put(np.zeros((width, n), dtype)),
            )
            for key, (k, n) in sites.items()
        }
        table = LoraTable(arrays, slots=max_adapters, rank=max_rank)
        return cls(dict(sites), (None,) * max_adapters, table)

    @property
    def max_adapters(self) -> int:
        return self.table.slots

    @property
    def max_rank(self) -> int:
        return self.table.rank

    @property
    def loaded(self) -> tuple[str, ...]:
        """The names of the adapters in the table, by slot."""
        return tuple(n for n in self.names if n is not None)

    def load(
        self,
        source: Any,
        *,
        name: str,
        config: Mapping[str, Any] | None = None,
        revision: str | None = None,
        alpha: float | None = None,
    ):
        """This table with adapter `name` loaded (replacing one of that name): `source` a
        PEFT adapter folder or its Hugging Face Hub repo id ("org/name", at `revision`;
        `logitloop.models.hub.adapter_folder`), its tensors (a mapping of PEFT's names
        to arrays) with `config` (adapter_config.json's fields), or a Qwix / tunix LoRA
        state with the provider's `alpha` (`logitloop.models.qwix_lora`)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        config, tensors, where = _read(source, config, revision, alpha)
        scale = _check_config(config, self.max_rank, where)
        blocks = self._blocks(tensors, where)
        if name in self.names:
            slot = self.names.index(name)
        elif None in self.names:
            slot = self.names.index(None)
        else:
            raise ValueError(
                f"the adapter table is full: {self.max_adapters} adapters loaded "
                f"({', '.join(self.loaded)}; max_adapters={self.max_adapters}): remove one "
                "(Adapters.remove) or make the table with a larger max_adapters"
            )
        table = self._write(slot, blocks, scale)
        names = self.names[:slot] + (name,) + self.names[slot + 1 :]
        return dataclasses.replace(self, names=names, table=table)

    def remove(self, name: str) -> Adapters:
        """This table without adapter `name` (its slot zeroed and free again)."""
        slot = self.slot(name, "name")
        names = self.names[:slot] + (None,) + self.names[slot + 1 :]
        return dataclasses.replace(self, names=names, table=self._write(slot, {}, 0.0))

    def slot(self, name: str, where: str) -> int:
        """The slot of adapter `name`; `where` names the argument in the error."""
        if not isinstance(name, str) or name not in self.names:
            raise ValueError(
                f"{where}: unknown adapter {name!r}; loaded: {list(self.loaded)} (or None for "
                "the base model)"
            )
        return self.names.index(name)

    def slots(self, adapter: Any, prompts: int, argument: str = "adapter") -> np.ndarray:
        """`[prompts]` int32: each prompt's slot (-1: None, the base model), from one name
        (or None) for every prompt or one per prompt."""
        if adapter is None or isinstance(adapter, str):
            adapter = [adapter] * prompts
        if not isinstance(adapter, Sequence) or len(adapter) != prompts:
            got = len(adapter) if isinstance(adapter, Sequence) else type(adapter).__name__
            raise ValueError(
                f"{argument} must be an adapter name, None, or one of them per prompt "
                f"({prompts}), got {got}"
            )
        return np.asarray(
            [-1 if a is None else self.slot(a, f"{argument}[{i}]") for i, a in enumerate(adapter)],
            np.int32,
        )

    def _blocks(self, tensors: Mapping[str, Any], where: str) -> dict:
        """`(layer, target) -> (A [r, K], B [N, r])` of the adapter, checked against the
        model's sites by name."""
        pairs: dict[tuple[int, str], dict[str, Any]] = {}
        for key, value in tensors.items():
            m = _TENSOR.search(key)
            if m is None:
                raise ValueError(
                    f"{where}: tensor {key!r} is not a LoRA A or B weight of a layer's "
                    "projection (embedding adapters, DoRA magnitudes and bias terms are not "
                    "supported)"
                )
            site = (int(m.group(1)), m.group(2))
            if site not in self.sites:
                known = sorted({t for _, t in self.sites})
                raise ValueError(
                    f"{where}: tensor {key!r} targets module {site[1]!r} of layer {site[0]}, "
                    f"which this model's adapter table does not have (targets {known}, layers "
                    f"0..{max(i for i, _ in self.sites)})"
                )
            pairs.setdefault(site, {})[m.group(3)] = np.asarray(value, np.float32)
        blocks = {}
        for site, pair in pairs.items():
            if set(pair) != {"A", "B"}:
                raise ValueError(f"{where}: layer {site[0]} {site[1]} has lora_A or lora_B only")
            a, b = pair["A"], pair["B"]
            k, n = self.sites[site]
            r = a.shape[0]
            if a.shape != (r, k) or b.shape != (n, r):
                raise ValueError(
                    f"{where}: layer {site[0]} {site[1]}: lora_A {a.shape} and lora_B "
                    f"{b.shape} do not fit this model's projection [{k} -> {n}] (expected "
                    f"lora_A [r, {k}] and lora_B [{n}, r]): an adapter for another model"
                )
            if r > self.max_rank:
                raise ValueError(
                    f"{where}: layer {site[0]} {site[1]} has rank {r}, above the table's "
                    f"max_rank={self.max_rank}: make the table with a larger max_rank"
                )
            blocks[site] = (a, b)
        return blocks

    def _write(self, slot: int, blocks: dict, scale: float) -> LoraTable:
        """The table with slot `slot` holding `blocks` (`scale` folded into B), every
        site's block of that slot the adapter does not target zeroed. Written on the host
        and placed whole (a device update would compile a program per shape), on the mesh
        the table was placed on, if any (a job's table on a mesh stays there)."""
        rank = self.max_rank
        cols = slice(slot * rank, (slot + 1) * rank)
        sites = {}
        for key in self.sites:
            old = self.table.sites[site_name(*key)]
            where = getattr(old[0], "sharding", None)
            where = where if isinstance(where, NamedSharding) else None
            a_all, b_all = (np.array(x) for x in old)
            a_all[:, cols] = 0
            b_all[cols] = 0
            if key in blocks:
                lora_a, lora_b = blocks[key]
                r = lora_a.shape[0]
                a_all[:, slot * rank : slot * rank + r] = lora_a.T
                b_all[slot * rank : slot * rank + r] = scale * lora_b.T
            sites[site_name(*key)] = (jax.device_put(a_all, where), jax.device_put(b_all, where))
        return self.table.replace(sites=sites)


def load_adapter(
    model: Any,
    source: Any,
    *,
    name: str,
    adapters: Adapters | None = None,
    config: Mapping[str, Any] | None = None,
    max_adapters: int = 4,
    max_rank: int = 16,
    revision: str | None = None,
    alpha: float | None = None,
) -> Adapters:
    """`adapters` (default a new table for `model`, `Adapters.create(model, max_adapters=,
    max_rank=)`) with the LoRA adapter `source` loaded as `name`: a PEFT adapter folder
    (`adapter_config.json`, `adapter_model.safetensors`), its Hugging Face Hub repo id
    ("org/name" at `revision`, fetched into the Hugging Face cache as models are), its
    tensors with `config`, or a Qwix / tunix LoRA state (`nnx.state(policy,
    nnx.LoRAParam)` of a tunix Llama 3 / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 under qwix's
    `LoraProvider`: `qwix_lora`) with the provider's `alpha` (scale `alpha / rank`, as
    qwix computes it).
    PEFT's LoRA only (`r`, `lora_alpha`, `use_rslora`, `target_modules`, bias "none");
    DoRA, other PEFT types, bias terms, `rank_pattern` / `alpha_pattern` and
    `modules_to_save` are refused by name. Returns a new `Adapters`; compiles nothing."""
    if adapters is None:
        adapters = Adapters.create(model, max_adapters=max_adapters, max_rank=max_rank)
    elif not isinstance(adapters, Adapters):
        raise ValueError(f"adapters must be an ll.Adapters, got {type(adapters).__name__}")
    return adapters.load(source, name=name, config=config, revision=revision, alpha=alpha)


def adapter_rank(source: Any, config: Mapping[str, Any] | None = None) -> int:
    """The rank `r` of a PEFT adapter (a folder or Hub repo id, or tensors with `config`),
    read from its adapter_config.json without loading its tensors: the `max_rank` a table
    needs."""
    if isinstance(source, (str, os.PathLike)):
        path = os.path.join(_folder(source, None), CONFIG_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"{os.fspath(source)}: no {CONFIG_FILE} (not a PEFT adapter folder)")
        with open(path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from e
    r = config.get("r") if isinstance(config, Mapping) else None
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{source}: r must be a positive int, got {r!r}")
    return r


def _folder(source: str | os.PathLike, revision: str | None) -> str:
    """The local folder of an adapter given as a folder or a Hub repo id."""
    from logitloop.models.hub import adapter_folder

    try:
        return os.fspath(adapter_folder(source, revision=revision))
    except (FileNotFoundError, PermissionError) as e:
        raise ValueError(str(e)) from None


def _read(
    source: Any,
    config: Mapping[str, Any] | None,
    revision: str | None = None,
    alpha: float | None = None,
) -> tuple[dict, Mapping, str]:
    """The adapter's config, tensors and a name for errors."""
    if qwix_lora.is_state(source):
        if config is not None:
            raise ValueError("config= goes with PEFT tensors; a Qwix LoRA state takes alpha=")
        return (*qwix_lora.peft_tensors(source, alpha, "the Qwix LoRA state"), "Qwix LoRA state")
    if alpha is not None:
        raise ValueError(
            "alpha= goes with a Qwix LoRA state; a PEFT adapter has its own lora_alpha "
            "(adapter_config.json, or config=)"
        )
    if isinstance(source, (str, os.PathLike)):
        folder = _folder(source, revision)
        config_path = os.path.join(folder, CONFIG_FILE)
        weights_path = os.path.join(folder, WEIGHTS_FILE)
        for path in (config_path, weights_path):
            if not os.path.isfile(path):
                raise ValueError(
                    f"{folder}: no {os.path.basename(path)} (a PEFT adapter folder holds "
                    f"{CONFIG_FILE} and {WEIGHTS_FILE})"
                )
        if config is not None:
            raise ValueError("config= goes with tensors; a folder has its own adapter_config.json")
        with open(config_path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{config_path}: not valid JSON ({e})") from e
        from safetensors.flax import load_file  # data only: no code runs

        return config, load_file(weights_path), weights_path
    if isinstance(source, Mapping):
        if config is None:
            raise ValueError("an adapter given as tensors needs config= (adapter_config.json)")
        return dict(config), source, "adapter tensors"
    raise ValueError(
        f"an adapter is a PEFT adapter folder, a mapping of its tensors or a Qwix LoRA "
        f"state, got {type(source).__name__}"
    )


def _check_config(config: Mapping[str, Any], max_rank: int, where: str) -> float:
    """The adapter's scale (lora_alpha / r, or / sqrt(r) with use_rslora), after refusing
    what this loader does not support, by name (its targets are its tensors')."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: adapter_config.json must hold an object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{where}: peft_type {kind!r} is not supported (LoRA only: 'LORA')")
    refused = {
        "use_dora": "DoRA (use_dora=true) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "modules_to_save": "modules_to_save (fully trained modules) is not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise ValueError(f"{where}: {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r} is not supported (bias='none' only)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r must be a positive int, got {r!r}")
    if r > max_rank:
        raise ValueError(
            f"{where}: rank r={r} is above the table's max_rank={max_rank}: make the table "
            "with a larger max_rank"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return float(scale)
