"""Batch jobs on Ray Data: many independent prompts over the actors of a Ray cluster.

- `Generator`: a callable class for `ray.data.Dataset.map_batches`. Each actor loads the
  model once (`__init__`) and runs each batch through `ll.generate_many` (continuous
  batching and the prefix cache inside the actor). A batch's rows are prompts: the columns
  `id` and one of `prompt`, `prompt_token_ids`, `messages`, plus sampling settings under
  `SamplingParams.create`'s names (a null cell sets nothing), and the request's settings
  the CLI's JSONL lines take (`logitloop.jobs.request_keys`: `adapter`, `guidance_scale`,
  `negative_prompt`, `steer`; a `steer` cell is a nested value, or JSON text in a string
  column), read and checked by the job code the CLI runs too
  (`logitloop.jobs.items.object_item`). It returns one column,
  `record`: each row's output line, exactly the CLI's JSONL record
  (`logitloop.jobs.items.record`) as JSON text.
  (A record's fields change type from row to row, `stop_reason` an int, a string, a list or
  null, which one Arrow column cannot hold.)
- `generate_jsonl(inputs, output, ...)`: the whole job from input files to one resumable
  JSONL output, as `logitloop generate --input ... --output ... --ray` runs it.

Each row's output depends only on the row (its prompt, settings and seed), not on the
actor or the batch that ran it: with `deterministic=True` (the default here, as with the
CLI's `--output`) bit for bit (docs/deterministic.md). Ray retries a batch whose actor died;
the driver writes the records of finished batches only, so every row appears once.

Ray is an optional extra (`pip install 'logitloop[ray]'`), imported when used. This module
sits below the command line (`logitloop generate --ray` calls `run_items`) and imports
nothing from it: the job logic both use is `logitloop.jobs`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from logitloop.jobs import JobError
from logitloop.jobs.request_keys import STEER_KEY

__all__ = ["Generator", "generate_jsonl", "require_ray"]

MISSING_RAY = (
    "logitloop's Ray jobs need Ray Data, an optional extra: pip install 'logitloop[ray]' "
    "(or pip install 'ray[data]')"
)
# The columns `generate_jsonl` hands the actors: a line's JSON text and its name in messages.
LINE_COLUMN = "jsonl_line"
WHERE_COLUMN = "where"


def require_ray():
    """`import ray` and `ray.data`, or an ImportError naming the extra."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(MISSING_RAY) from e
    return ray


def _python(value: Any) -> Any:
    """A cell of a numpy batch as plain Python (arrays to lists, numpy scalars to numbers)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_python(v) for v in value]
    if isinstance(value, dict):
        return {k: _python(v) for k, v in value.items()}
    return value


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def batch_objects(batch: Mapping[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """A batch's rows as (object, name): the JSONL text of `LINE_COLUMN` when it has one,
    else the row's columns (null cells left out, so a column some rows lack sets nothing)."""
    columns = list(batch)
    rows = len(batch[columns[0]]) if columns else 0
    out = []
    for i in range(rows):
        if LINE_COLUMN in batch:
            obj = json.loads(batch[LINE_COLUMN][i])
            where = str(batch[WHERE_COLUMN][i]) if WHERE_COLUMN in batch else f"row {i}"
        else:
            obj = {c: _python(batch[c][i]) for c in columns}
            obj = {c: v for c, v in obj.items() if not _unset(v)}
            where = f"row with id {json.dumps(obj.get('id'))}"
            if "id" not in obj:
                raise ValueError(
                    f"a Ray Data row has no 'id' (columns: {', '.join(columns)}); every row "
                    "needs one: its record is matched to it by id"
                )
            if isinstance(obj.get(STEER_KEY), str):  # a JSON-encoded column (module docstring)
                obj[STEER_KEY] = _json_cell(obj[STEER_KEY], f"{where}: {STEER_KEY}")
        out.append((obj, where))
    return out


def _json_cell(text: str, name: str) -> Any:
    """A JSON-encoded cell (`name` names it): its value, JSON data only."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{name} is not valid JSON text ({e})") from None


class Generator:
    """A callable class for `Dataset.map_batches(Generator, fn_constructor_kwargs=...)`.

    Args:
      model: a Hugging Face Hub repo id (found in the actor's Hugging Face cache, else
        downloaded into it) or a checkpoint folder (None: the shipped model), loaded once
        per actor.
      revision: the repo's branch, tag or commit hash (default: main).
      dtype: parameter dtype (`load_pretrained`'s).
      mesh_shape: a mesh of this actor's devices, `{"data": D, "model": M}` (D * M of
        `jax.devices()`), for a model too big for one device or data parallelism inside the
        actor; None: one device.
      quantize, group_size, quantize_embedding: `load_pretrained`'s.
      params: the job's sampling settings (`SamplingParams.create` arguments) that a row
        replaces key by key; a row without a `seed` uses the job's (default 0).
      n, ignore_eos, deterministic, slots, speculative ...: as in `ll.generate_many`.
      compile_cache: keep compiled programs in JAX's persistent compilation cache, as the
        CLI does (`logitloop.compile_cache.enable_default_compile_cache`: the folder
        `LOGITLOOP_COMPILE_CACHE` names, none when it is "off", a JAX cache configured in
        the actor's environment left as it is), so that an actor started after the first on
        a node, or a restarted one, reads its programs instead of compiling them. False
        leaves the process's JAX settings as they are.
      bounds: the job's longest prompt and largest max_tokens (`{"max_prompt_len": P,
        "max_tokens_bound": M}`, as `job_bounds` gives them): every batch then runs the
        programs of those bounds, compiled when the actor starts (`ll.precompile(slots=...)`)
        and none later; None: bounds grow with the batches the actor sees.
      adapters: LoRA adapters, `{name: PEFT adapter folder}`, loaded once per actor into
        one table (`logitloop.jobs.load_adapters`); a row's `adapter` column names its
        (null or absent: the base model, or the job's `params["adapter"]`). Likewise
        a row's `guidance_scale`, `negative_prompt` and `steer` (docs/ray.md).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        revision: str | None = None,
        dtype: str | None = None,
        mesh_shape: Mapping[str, int] | None = None,
        quantize: Any = None,
        group_size: int | None = None,
        quantize_embedding: bool = False,
        params: Mapping[str, Any] | None = None,
        n: int = 1,
        ignore_eos: bool = False,
        deterministic: bool | str = True,
        slots: int = 32,
        compile_cache: bool = True,
        bounds: Mapping[str, int] | None = None,
        adapters: Mapping[str, str] | None = None,
        **options: Any,
    ):
        from logitloop.decoding.loop.runner import model_info
        from logitloop.jobs import load_adapters, load_model
        from logitloop.jobs.items import param_defaults, row_params

        if compile_cache:  # the actor owns its process: JAX's settings are its to choose
            from logitloop.compile_cache import enable_default_compile_cache

            enable_default_compile_cache()
        self.model = _checked(
            lambda: load_model(model, dtype, quantize, group_size, quantize_embedding, revision)
        )
        self.info = model_info(self.model)
        table = _checked(lambda: load_adapters(self.model, dict(adapters or {})))
        if table is not None:  # generate_many's adapters= (and precompile's)
            options = {**options, "adapters": table}
        self.mesh = None if mesh_shape is None else _actor_mesh(mesh_shape)
        self.base = dict(params or {})
        self.defaults = param_defaults()
        self.base_params = _checked(lambda: row_params(self.base))
        self.n, self.ignore_eos, self.deterministic = n, ignore_eos, deterministic
        self.slots, self.options = slots, options
        # Bounds grow with the batches an actor sees (never shrink), so that it compiles a
        # few times at most; deterministic mode makes a row's bits independent of them.
        self.bounds = {"max_prompt_len": 1, "max_tokens_bound": 1}
        if bounds is not None:  # the job's: its programs compiled before the first batch
            import logitloop as ll

            self.bounds = {k: max(v, int(bounds.get(k, v))) for k, v in self.bounds.items()}
            ll.precompile(
                self.model, slots=slots, prompt_len=self.bounds["max_prompt_len"],
                max_tokens=self.bounds["max_tokens_bound"], n=n, ignore_eos=ignore_eos,
                deterministic=deterministic, mesh=self.mesh, **options,
            )  # fmt: skip

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        import numpy as np

        records = [json.dumps(r, ensure_ascii=False) for r in self.records(batch)]
        return {"record": np.array(records, dtype=object)}

    def records(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The CLI's record of every row of `batch`, in the batch's order."""
        return _checked(lambda: self._records(batch))

    def _records(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        import logitloop as ll
        from logitloop.jobs.items import (
            check_adapters,
            check_vocab,
            job_bounds,
            object_item,
            prepare_tokens,
            record,
            render_conversations,
            request_error,
            validate_params,
        )
        from logitloop.jobs.request_keys import (
            GUIDANCE_KEYS,
            check_requests,
            refuse_requests,
            request_kwargs,
        )

        items = []
        for position, (obj, where) in enumerate(batch_objects(batch)):
            item_id = obj.get("id", position)
            items.append(object_item(obj, item_id, where, self.base, self.defaults, position))
        if not items:
            return []
        table = self.options.get("adapters")
        check_adapters(items, [] if table is None else table.loaded)
        validate_params(items, self.base, self.base_params)
        render_conversations(items, self.model, self.ignore_eos)
        prepare_tokens(items, self.info)
        for item in items:
            check_vocab(item.params, self.info.vocab_size, item.where)
        bounds = job_bounds(items, self.info, self.defaults)
        self.bounds = {k: max(v, bounds[k]) for k, v in self.bounds.items()}
        check_requests(items, self.info)
        if self.options.get("speculative") is not None:
            refuse_requests(items, "speculative=", GUIDANCE_KEYS)
        requests = [ll.Request(it.token_ids, it.params, **request_kwargs(it)) for it in items]
        try:
            results = ll.generate_many(
                self.model, requests, n=self.n, ignore_eos=self.ignore_eos,
                deterministic=self.deterministic, slots=self.slots, mesh=self.mesh,
                **self.bounds, **self.options,
            )  # fmt: skip
        except ValueError as e:
            raise request_error(items, e) from None
        tokenizer = self.info.tokenizer
        return [record(it, r, self.n, tokenizer) for it, r in zip(items, results, strict=True)]


def _checked(fn: Callable[[], Any]) -> Any:
    """A job's bad-input error as the library's ValueError (same message)."""
    try:
        return fn()
    except JobError as e:
        raise ValueError(str(e)) from None


def _actor_mesh(shape: Mapping[str, int]):
    """A ("data", "model") mesh of the actor's own devices."""
    import jax

    data, model = int(shape.get("data", 1)), int(shape.get("model", 1))
    unknown = set(shape) - {"data", "model"}
    devices = jax.devices()
    if unknown or data < 1 or model < 1 or data * model > len(devices):
        raise ValueError(
            f"mesh_shape = {dict(shape)}: axes 'data' and 'model' of sizes >= 1 whose product "
            f"is at most this actor's {len(devices)} devices"
        )
    return jax.make_mesh((data, model), ("data", "model"), devices=devices[: data * model])


# --------------------------------------------------------------------------- the job


def item_rows(items: Iterable, base: dict[str, Any]) -> list[dict[str, str]]:
    """The rows the actors read: each prompt as the JSONL line that gives it (its settings
    that differ from the job's) and its name for messages."""
    rows = []
    for item in items:
        obj: dict[str, Any] = {"id": item.id}
        if item.messages is not None:
            obj["messages"] = item.messages
        elif isinstance(item.prompt, str):
            obj["prompt"] = item.prompt
        else:
            obj["prompt_token_ids"] = item.prompt
        obj.update({k: v for k, v in item.knobs.items() if k not in base or base[k] != v})
        rows.append({LINE_COLUMN: json.dumps(obj, ensure_ascii=False), WHERE_COLUMN: item.where})
    return rows


def run_items(
    todo: Sequence,
    base: dict[str, Any],
    write: Callable[[list[dict[str, Any]], int], None],
    *,
    workers: int = 1,
    batch_size: int = 64,
    num_cpus: float = 1,
    num_gpus: float = 0,
    progress: bool = True,
    **generator: Any,
) -> int:
    """Run `todo` (the CLI's items) on `workers` actors of the Ray cluster the environment
    names (`RAY_ADDRESS`), else a local one; `write` gets each finished batch's records
    (in completion order). Returns the tokens generated."""
    ray = require_ray()
    from tqdm import tqdm

    if workers < 1:
        raise JobError(f"--workers = {workers} is outside the allowed range [1, inf)")
    if not ray.is_initialized():
        with warnings.catch_warnings():  # Ray's processes exec at once: JAX's threads are safe
            warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
            ray.init(logging_level="ERROR", log_to_driver=False)
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # our bar says how it goes
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ours counts rows across the workers
    blocks = max(workers, math.ceil(len(todo) / batch_size))
    dataset = ray.data.from_items(item_rows(todo, base), override_num_blocks=blocks)
    out = dataset.map_batches(
        Generator, fn_constructor_kwargs={"params": base, **generator},
        batch_size=batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=num_cpus, num_gpus=num_gpus,
    )  # fmt: skip
    n = generator.get("n", 1)
    bar = tqdm(total=len(todo), unit="prompt", disable=not progress, dynamic_ncols=True)
    tokens = 0
    try:
        for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
            records = [json.loads(text) for text in batch["record"]]
            write(records, n)
            tokens += sum(sum(r["num_tokens"]) if n > 1 else r["num_tokens"] for r in records)
            bar.update(len(records))
            bar.set_postfix(tokens=tokens, refresh=False)
    except ray.exceptions.RayError as e:  # a bad row the driver could not see: its message
        cause = getattr(e, "cause", None)
        if isinstance(cause, ValueError):
            raise JobError(str(cause)) from None
        raise
    finally:
        bar.close()
    return tokens


def generate_jsonl(
    inputs: str | Sequence[str],
    output: str | os.PathLike,
    *,
    params: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    **options: Any,
) -> int:
    """Generate every prompt of `inputs` (paths or globs of the CLI's input files) on Ray
    into `output` (a JSONL file, or a folder that gets `results.jsonl`), resumed as the
    CLI resumes it (the ids already there are skipped; `overwrite` starts it afresh).
    `options`: `run_items`' and `Generator`'s (model, workers, batch_size, n, ...).
    Returns the number of prompts generated."""
    from logitloop.jobs.items import param_defaults, read_inputs, row_params, validate_params
    from logitloop.jobs.sinks import JsonlOutput, id_key, output_file

    base = dict(params or {})
    items = _checked(lambda: read_inputs(inputs, base, param_defaults()))
    sink = JsonlOutput.open(output_file(str(output)), overwrite, lambda message: None)
    try:
        todo = [it for it in items if id_key(it.id) not in sink.done]
        _checked(lambda: validate_params(todo, base, row_params(base)))
        if todo:
            _checked(lambda: run_items(todo, base, sink.write, progress=False, **options))
        return len(todo)
    finally:
        sink.close()
