"""One plan per call: what every entry point sets up before the device loop runs, once.

`generate`, `stream`, `generate_many`, `explain` and `chat` take the same six options
(`Options`: `n`, `ignore_eos`, `mesh`, `processors`, `deterministic`, `speculative`) as
keywords (the entry points that sample take sampling settings as keywords too:
`SamplingParams.create`'s arguments, `max_new_tokens` among them; `Options.split` tells the
two sets apart and `sampling_params` turns settings into params over the checkpoint's
defaults), and all start with `plan(model, options)`:

- the static part, `Plan.program` (`loop.Program`): the model's runner (with its numerics
  policy, `fixed_order.Numerics`: `deterministic=` fixes the reduction order, and
  `fixed_order.calibrate` runs this backend's probes once), the layout (one device, or a
  mesh) and the resolved speculation strategy; the loop's programs compile against it;
- the device part: the model's weights (and an adapter table) placed by the layout and a
  draft model's weights, then per batch `Plan.rows` (the prompts and params checked
  against the model, `n` samples per prompt, the model's EOS ids among the stop ids, a
  mesh's dummy rows) and `Plan.tables` (`loop.Tables`: the params' device part, the
  stop-string tables and the constraints' automata, the rows' per-row model state placed
  by the layout, with the weights: everything the loop reads and never writes).

So a new entry point (a scorer, a beam search) writes none of this again.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from logitloop.decoding.engine import guidance as guided
from logitloop.decoding.engine import inside, reuse
from logitloop.decoding.engine.host import (
    MIN_PROMPT_BUCKET,
    bucket,
    buffer_for,
    check_count,
    constraint_tables,
    request_rows,
    row_bucket,
    stop_tables,
    tokenize_prompts,
    top_logprobs_bucket,
)
from logitloop.decoding.engine.inside import Capture
from logitloop.decoding.loop import sharding
from logitloop.decoding.loop import speculative as speculation
from logitloop.decoding.loop.decode_loop import Program, Tables
from logitloop.decoding.loop.runner import ModelInfo, model_info
from logitloop.decoding.sampling.constraints import Automata
from logitloop.decoding.sampling.params import (
    SamplingParams,
    canonical_knobs,
    generation_defaults,
)
from logitloop.models.adapters import Adapters
from logitloop.models.fixed_order import Numerics
from logitloop.models.kv import Rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """The options every entry point shares, given to each as keywords.

    n: samples per prompt (rows repeated prompt-major; sample i > 0 gets a seed derived from
      the row's).
    ignore_eos: leave the model's EOS ids out of the rows' stop ids.
    mesh: a `jax.sharding.Mesh` with axes "data" and "model" to run sharded
      (`logitloop.decoding.loop.sharding`).
    processors: user transforms composed into every row's sampling step
      (`logitloop.decoding.sampling.processors`).
    deterministic: True or "model-parallel": a row's results do not depend on the batch
      (`logitloop.models.fixed_order`); or a policy made by `fixed_order.calibrate` (e.g.
      `calibrate(True, tile_kernel="interpret")`, the GPU's tile kernel interpreted).
    speculative: `ll.PromptLookup(...)` or `ll.DraftModel(...)`
      (`logitloop.decoding.loop.speculative`).
    adapters: an `ll.Adapters` table of LoRA adapters (`ll.load_adapter`), and
    adapter: each prompt's adapter by name, one for all or one per prompt (None: the
      base model); `generate`, `stream`, `chat` and `generate_many` (one name for every
      request that names none, `Request.adapter`) so far, speculative decoding included
      (and `score`, `beam_search`, `token_logprobs`, `explain_next_token` (one name),
      which take them as keywords; docs/lora.md).
    guidance_scale: classifier-free guidance, one finite number for every prompt or one
      per prompt (None or 1: unguided), and
    negative_prompt: each guided prompt's negative context, text or token ids, one for
      every prompt or one per prompt (None: the prompt's last token); `generate`,
      `stream` and `generate_many` (one value for every request that gives none,
      `Request.guidance_scale`) so far (`logitloop.decoding.engine.guidance`,
      docs/guidance.md).
    steer: steering vectors added to the residual stream (`ll.Steer`: one for every
      prompt, or a list with one entry per prompt); capture: the residual stream to
      record (`ll.Capture`, `result.captured`, `StreamEvent.captured`); `generate`,
      `stream` and `generate_many` so far (there `steer=` is the setting of every
      request that gives none, `Request.steer`, and `capture=` the job's; docs/inside.md).
    """

    n: int = 1
    ignore_eos: bool = False
    mesh: Any = None
    processors: Sequence[Any] | None = None
    deterministic: bool | str | Numerics = False
    speculative: Any = None
    adapters: Any = None
    adapter: Any = None
    guidance_scale: Any = None
    negative_prompt: Any = None
    steer: Any = None
    capture: Any = None

    def __post_init__(self):
        check_count("n", self.n, 1)
        if self.capture is not None and not isinstance(self.capture, Capture):
            raise ValueError(
                f"capture must be an ll.Capture(layers=...), got {type(self.capture).__name__}"
            )
        if self.adapters is not None and not isinstance(self.adapters, Adapters):
            raise ValueError(
                f"adapters must be an ll.Adapters (ll.load_adapter), got "
                f"{type(self.adapters).__name__}"
            )
        if self.adapter is not None and self.adapters is None:
            raise ValueError(
                "adapter= names adapters of a table: pass adapters=ll.load_adapter(...) too"
            )

    @classmethod
    def of(cls, caller: str, options: Mapping[str, Any]) -> Options:
        """The options from a public function's keywords (`caller` names it in the
        TypeError an unknown keyword raises, as Python's own would)."""
        known = option_names()
        for name in options:
            if name not in known:
                raise TypeError(
                    f"{caller}() got an unexpected keyword argument {name!r} (the shared "
                    f"options are {', '.join(sorted(known))})"
                )
        return cls(**options)

    @classmethod
    def split(cls, caller: str, keywords: Mapping[str, Any]) -> tuple[Options, dict[str, Any]]:
        """A public function's keywords as its options and its sampling settings
        (`SamplingParams.create` arguments, aliases such as `max_new_tokens` included).
        A keyword that is neither raises TypeError naming it and listing both sets."""
        options, settings = {}, {}
        for name, value in keywords.items():
            if name in option_names():
                options[name] = value
            elif name in sampling_names():
                settings[name] = value
            else:
                raise TypeError(
                    f"{caller}() got an unexpected keyword argument {name!r} (the shared "
                    f"options are {', '.join(sorted(option_names()))}; the sampling settings "
                    f"are {', '.join(sorted(sampling_names()))})"
                )
        return cls(**options), settings


@functools.cache
def option_names() -> frozenset[str]:
    """The shared options' keywords (`Options`)."""
    return frozenset(f.name for f in dataclasses.fields(Options))


@functools.cache
def sampling_names() -> frozenset[str]:
    """The sampling settings' keywords: `SamplingParams.create`'s, aliases (`max_new_tokens`)
    included, but `vocab_size`, which the model gives."""
    create = inspect.signature(SamplingParams.create).parameters
    names = {n for n, p in create.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return frozenset(names - {"vocab_size"})


def sampling_params(
    model: Any,
    batch_size: int,
    params: SamplingParams | Mapping[str, Any] | None,
    settings: Mapping[str, Any],
    fallback: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """The params of a batch of `batch_size` prompts from what a user gave: a
    `SamplingParams` as it is or, made without a batch_size, its row repeated (then
    `settings` must be empty), or a dict of `create` arguments and keyword `settings`
    (these win), over the checkpoint's recommended settings (`generation_config.json`,
    as `SamplingParams.from_model` reads them), over `fallback`
    (e.g. chat's 256 tokens). Scalars apply to every prompt."""
    if isinstance(params, SamplingParams):
        if settings:
            raise TypeError(
                f"sampling settings {', '.join(sorted(settings))} given as keywords beside a "
                "SamplingParams: give them in SamplingParams.create, or pass params as a dict"
            )
        return params.broadcast_to(batch_size)
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(
            "params must be a SamplingParams, a dict of SamplingParams.create arguments or "
            f"None, got {type(params).__name__}"
        )
    given = {**canonical_knobs(params or {}, "params: "), **canonical_knobs(settings)}
    knobs = {**(fallback or {}), **generation_defaults(model), **given}
    return SamplingParams.create(batch_size, **knobs)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The buckets a `generate` batch runs at (`Plan.batch`): `rows` prompts (dummy ones
    included; each has `n` rows), `width` prompt columns, `buffer` slots for generated
    tokens and `top` top-logprob alternatives per token."""

    rows: int
    width: int
    buffer: int
    top: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a call starts from: the model resolved once, the static program, the options."""

    options: Options
    info: ModelInfo  # its weights where the layout puts them
    program: Program
    draft_weights: Any = None

    @property
    def layout(self):
        return self.program.layout

    def rows(
        self,
        prompts: Sequence[Any],
        params: SamplingParams,
        *,
        ids: list[list[int]] | None = None,
        names: Sequence[str] | None = None,
    ) -> tuple[list[list[int]], SamplingParams]:
        """A batch's prompts as checked token ids and its params row by row: `n` samples per
        prompt, the model's EOS ids among the stop ids unless `ignore_eos`, `processors`
        in the params, dummy rows up to the row bucket (`row_bucket`, a multiple of a mesh's
        data axis; the ids keep the real rows only) and the top logprobs' bucketed width.
        `ids`: prompts already tokenized (then `prompts` is not read); `names`: the
        prompts' names in error messages (default "prompts[i]")."""
        ids, params, _ = self.batch(prompts, params, ids=ids, names=names, fit=False, record=False)
        return ids, params

    def batch(
        self,
        prompts: Sequence[Any],
        params: SamplingParams,
        *,
        ids: list[list[int]] | None = None,
        names: Sequence[str] | None = None,
        fit: bool = True,
        record: bool = True,
    ) -> tuple[list[list[int]], SamplingParams, BatchShape]:
        """`rows`, and the batch's shape (`BatchShape`: rows, prompt width, buffer, top
        width) chosen once: the buckets the call needs or, with `fit`, the cheapest
        larger ones a program of this plan already ran at (`reuse.fit`; docs/
        performance.md, "Reuse before compiling"). With `record` the shape is recorded
        (`reuse.ran`) for later calls (the call will run it, or `precompile` compiles it)."""
        if ids is None:
            ids = tokenize_prompts(prompts, self.info)
        o = self.options
        ids, params = request_rows(
            self.info, ids, params, n=o.n, ignore_eos=o.ignore_eos, names=names,
            processors=o.processors,
        )  # fmt: skip
        # The batch's shape is a bucket's, not the request's ("What compiles",
        # docs/performance.md): dummy prompts (copies of the first, each generating one
        # token) up to the row bucket, each with its n rows; the top logprobs at one width.
        need = BatchShape(
            rows=row_bucket(len(ids) // o.n, self.layout.row_multiple),
            width=bucket(max(len(p) for p in ids), MIN_PROMPT_BUCKET),
            buffer=buffer_for(params),
            top=top_logprobs_bucket(params),
        )
        key = ("batch", self.program, o.n)
        shape = reuse.fit(key, need) if fit else need
        if record:
            reuse.ran(key, shape)
        params = params.with_dummy_rows(shape.rows * o.n)
        return ids, params.replace(top_logprobs_width=shape.top), shape

    def tables(
        self,
        params: SamplingParams,
        stops: Any = None,
        automata: Automata | None = None,
        rows: Rows | None = None,
        names: Sequence[str | None] | None = None,
    ) -> Tables:
        """What the loop reads for rows `params` (`stops`, `automata`: their device
        tables, `stop_tables` and `constraint_tables`; `rows`: `adapter_rows`; `names`:
        the adapter of each slot of the table `rows.adapter` indexes, default the call's,
        for a draft's own adapters, `draft_inputs`)."""
        draft = draft_inputs(self.draft_weights, self.options, rows, names)
        rows = self.layout.place_rows(rows)
        return Tables(self.info.weights, params.device_only(), stops, automata, draft, rows)

    def own_draft(self, rows: Rows, names: Sequence[str | None] | None) -> Any:
        """`draft_inputs` for `rows` where the draft model has adapters of its own, else
        None (a job's admissions and slots; `names`: the job table's)."""
        if getattr(self.options.speculative, "adapters", None) is None:
            return None
        return draft_inputs(self.draft_weights, self.options, rows, names)

    def adapter_rows(
        self, prompts: int, batch_size: int, ids: list[list[int]] | None = None
    ) -> Rows | None:
        """The rows' per-row model state (`ll.Rows`) under `options.adapter`: each of the
        `prompts` prompts' adapter slot for its `n` rows, -1 (the base) for dummy rows up
        to `batch_size`, with the table; and under `options.steer` and `options.capture`
        (`ids`: the rows' prompts, `n` per prompt) their steering vectors and the layers
        to capture. None without any. An unknown name is refused naming the prompt's
        index (`Adapters.slots`), a bad vector naming its prompt (`inside.steering`)."""
        o = self.options
        rows = Rows()
        if o.adapters is not None:
            slots = np.repeat(o.adapters.slots(o.adapter, prompts), o.n)
            slots = np.concatenate([slots, np.full(batch_size - len(slots), -1, np.int32)])
            rows = Rows(jax.device_put(np.asarray(slots)), o.adapters.table)
        if o.steer is not None and ids is not None:
            steer = inside.steering(
                o.steer, ids[:: o.n], o.n, batch_size, self.num_layers, self.info.residual_width
            )
            rows = rows.replace(steer=steer)
        if o.capture is not None:
            rows = rows.replace(capture=o.capture.model_layers(self.num_layers))
        return None if rows == Rows() else rows

    @property
    def num_layers(self) -> int:
        """The model's decoder layers (its `KVSpec`'s), as `ll.residual` numbers them."""
        return model_layers(self.info)

    def batch_tables(
        self, params: SamplingParams, prompts: int | None = None, ids: list[list[int]] | None = None
    ) -> tuple[Tables, np.ndarray | None]:
        """`tables` for one batch, with its stop-string tables and automata built here
        (and `prompts` prompts' adapters, `adapter_rows`); and the rows' initial
        automaton states (None without constraints)."""
        automata, fsm = constraint_tables(self.info, params)
        # A model with a tokenizer always carries stop-string tables (empty rows match
        # nothing), so a request's first stop string compiles nothing.
        stops = stop_tables(
            self.info, params.stop, always=self.info.tokenizer is not None,
            rows=params.batch_size,
        )  # fmt: skip
        rows = None if prompts is None else self.adapter_rows(prompts, params.batch_size, ids)
        return self.tables(params, stops, automata, rows), fsm


def plan(
    model: Any,
    options: Options | None = None,
    *,
    adapters: bool = False,
    guidance: bool = False,
    inside: bool | tuple[str, ...] = False,
    capture_samples: bool = False,
) -> Plan:
    """Resolve `model` under `options` (default `Options()`): its runner and weights, the
    layout, the speculation strategy and the draft's weights (see the module docstring).
    `adapters`, `guidance`, `inside`: whether the caller runs rows under LoRA adapters,
    under classifier-free guidance, and with steering and capture (`inside`: True for
    both, or the names of those it runs, e.g. `("steer",)`; else
    `options.adapters`, `options.guidance_scale`, `options.steer` and `options.capture`
    are refused; `capture_samples`: whether it captures beside `n > 1`, `generate_many`,
    whose samples are rows of their own)."""
    options = Options() if options is None else options
    check_adapters(model, options, adapters)
    guided.check_supported(options, guidance)
    check_inside(options, inside, capture_samples)
    info = model_info(model, deterministic=options.deterministic)  # numerics: calibrated
    layout = sharding.layout_for(options.mesh, whole_vocab=info.runner.numerics.splits)
    info = layout.place(info)
    if options.adapters is not None:  # the table where the loop reads it, as the weights
        table = layout.place_rows(Rows(lora=options.adapters.table)).lora
        adapters = dataclasses.replace(options.adapters, table=table)
        options = dataclasses.replace(options, adapters=adapters)
    spec, draft_weights = speculation.resolve(options.speculative, info, options.mesh)
    capture = options.capture
    program = Program(
        info.runner, layout, spec, capture=capture is not None,
        capture_prompt=capture is not None and capture.prompt,
    )  # fmt: skip
    return Plan(options, info, program, draft_weights)


def check_inside(
    options: Options, supported: bool | tuple[str, ...], samples: bool = False
) -> None:
    """Refuse steering and capture where they do not run yet, by name (docs/inside.md).
    `supported`: True (both run here), False (neither) or the names of those that run;
    `samples`: capture runs beside `n > 1` here."""
    given = [k for k in ("steer", "capture") if getattr(options, k) is not None]
    if not given:
        return
    refused = [k for k in given if supported is not True and k not in (supported or ())]
    if refused:
        raise NotImplementedError(
            f"{' and '.join(refused)}= not here yet: steer= runs in generate, stream and "
            "generate_many so far, capture= in generate, stream, generate_many and score "
            "(docs/inside.md, 'Not done yet')"
        )
    if options.mesh is not None and options.capture is not None:
        raise NotImplementedError("capture= does not run with mesh= yet (docs/inside.md)")
    if options.capture is not None and options.speculative is not None:
        raise NotImplementedError("capture= does not run with speculative= yet (docs/inside.md)")
    if options.capture is not None and options.n > 1 and not samples:
        raise NotImplementedError(
            "capture= does not run with n > 1 here yet (generate_many runs it; docs/inside.md)"
        )


def draft_inputs(
    draft_weights: Any, options: Options, rows: Any, names: Sequence[str | None] | None = None
) -> Any:
    """A draft model's weights, with its rows' adapters where it has its own
    (`DraftModel.adapters`: each row drafts under the draft's adapter of its own adapter's
    name, else the draft's base): `speculative.DraftInputs`. `rows`: the batch's
    (`adapter_rows`; a job's slots or admitted rows), whose `adapter` indexes a table
    whose slots hold the adapters `names` (default the call's `adapters=`; a job's table,
    which loads adapters as it runs, gives its own)."""
    table = getattr(options.speculative, "adapters", None)
    if table is None:
        return draft_weights
    if options.adapters is None or rows is None or rows.adapter is None:
        raise ValueError(
            "DraftModel.adapters runs with the call's adapters= (each row drafts under the "
            "draft's adapter of its own adapter's name), not without it (docs/lora.md)"
        )
    if names is None:
        names = options.adapters.names  # the call's slot -> the draft's slot of that name
    mapping = [table.names.index(n) if n in table.names else -1 for n in names]
    mapping = np.asarray([*mapping, -1], np.int32)  # slot -1 (the base) reads the last
    slots = mapping[np.asarray(rows.adapter)]  # [B]
    return speculation.DraftInputs(draft_weights, Rows(jax.device_put(slots), table.table))


def check_adapters(model: Any, options: Options, supported: bool) -> None:
    """Refuse adapters where they do not run yet, or made for another model, by name
    (and the draft model's own, `DraftModel.adapters`)."""
    draft_table = getattr(options.speculative, "adapters", None)
    if draft_table is not None:
        _made_for(options.speculative.model, draft_table, "DraftModel.adapters")
    table = options.adapters
    if table is None:
        return
    if not supported:
        raise ValueError(
            "adapters= runs in generate, stream, chat, generate_many, score, beam_search, "
            "token_logprobs, explain_next_token and precompile so far, not here yet "
            "(docs/lora.md, 'Not done yet')"
        )
    _made_for(model, table, "adapters=")


def _made_for(model: Any, table: Any, argument: str) -> None:
    """Refuse `table` (an `ll.Adapters`, given as `argument`) made for another model."""
    if not isinstance(table, Adapters):
        raise ValueError(f"{argument} must be an ll.Adapters, got {type(table).__name__}")
    sites = model.lora_sites() if hasattr(model, "lora_sites") else None
    if sites is not None and dict(sites) != dict(table.sites):
        raise ValueError(
            f"{argument} was made for another model (its target projections or their shapes "
            "differ from this model's): make it with ll.load_adapter(model, ...)"
        )


def model_layers(info: ModelInfo) -> int:
    """The decoder layers of the model `info` describes (its `KVSpec`'s), as `ll.residual`
    numbers them; a ValueError for a model that keeps a cache of its own."""
    spec = info.runner.kv_spec
    if spec is None:
        raise ValueError(
            "steer= and capture= need a model on the library's KV cache (a KVSpec): "
            "this one keeps a cache of its own (contract version 0)"
        )
    return spec.num_layers
