"""Batch jobs on Ray Data: many independent prompts over the actors of a Ray cluster.

- `Generator`: a callable class for `ray.data.Dataset.map_batches`. Each actor loads the
  model once (`__init__`) and runs each batch through `ll.generate_many` (continuous
  batching and the prefix cache inside the actor). A batch's rows are prompts: the columns
  `id` and one of `prompt`, `prompt_token_ids`, `messages`, plus sampling settings under
  `SamplingParams.create`'s names (a null cell sets nothing), read and checked by the CLI's
  own code (`logitloop.cli.jobs.object_item`). It returns one column, `record`: each row's
  output line, exactly the CLI's JSONL record (`logitloop.cli.jobs.record`) as JSON text.
  (A record's fields change type from row to row, `stop_reason` an int, a string, a list or
  null, which one Arrow column cannot hold.)
- `generate_jsonl(inputs, output, ...)`: the whole job from input files to one resumable
  JSONL output, as `logitloop generate --input ... --output ... --ray` runs it.

Each row's output depends only on the row (its prompt, settings and seed), not on the
actor or the batch that ran it: with `deterministic=True` (the default here, as with the
CLI's `--output`) bit for bit (docs/deterministic.md). Ray retries a batch whose actor died;
the driver writes the records of finished batches only, so every row appears once.

Ray is an optional extra (`pip install 'logitloop[ray]'`), imported when used.
"""

from __future__ import annotations

import glob
import inspect
import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from logitloop.cli.common import CLIError

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
        out.append((obj, where))
    return out


class Generator:
    """A callable class for `Dataset.map_batches(Generator, fn_constructor_kwargs=...)`.

    Args:
      model: a checkpoint folder (None: the shipped model), loaded once per actor.
      dtype: parameter dtype (`load_pretrained`'s).
      mesh_shape: a mesh of this actor's devices, `{"data": D, "model": M}` (D * M of
        `jax.devices()`), for a model too big for one device or data parallelism inside the
        actor; None: one device.
      quantize, group_size, quantize_embedding: passed to `load_pretrained` where it takes
        them (an error otherwise).
      params: the job's sampling settings (`SamplingParams.create` arguments) that a row
        replaces key by key; a row without a `seed` uses the job's (default 0).
      n, ignore_eos, deterministic, slots, speculative ...: as in `ll.generate_many`.
      compile_cache: keep compiled programs in the persistent cache
        (`ll.enable_compile_cache`), so actors after the first one start warm.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
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
        compile_cache: bool = False,
        **options: Any,
    ):
        from logitloop.cli.common import load_model
        from logitloop.cli.jobs import param_defaults, row_params
        from logitloop.decoding.loop.runner import model_info

        if compile_cache:
            from logitloop.compile_cache import enable_compile_cache

            enable_compile_cache()
        self.model = _load(
            model,
            dtype,
            quantize,
            load_model,
            group_size=group_size,
            quantize_embedding=quantize_embedding,
        )
        self.info = model_info(self.model)
        self.mesh = None if mesh_shape is None else _actor_mesh(mesh_shape)
        self.base = dict(params or {})
        self.defaults = param_defaults()
        self.base_params = _checked(lambda: row_params(self.base))
        self.n, self.ignore_eos, self.deterministic = n, ignore_eos, deterministic
        self.slots, self.options = slots, options
        # Bounds grow with the batches an actor sees (never shrink), so that it compiles a
        # few times at most; deterministic mode makes a row's bits independent of them.
        self.bounds = {"max_prompt_len": 1, "max_tokens_bound": 1}

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        import numpy as np

        records = [json.dumps(r, ensure_ascii=False) for r in self.records(batch)]
        return {"record": np.array(records, dtype=object)}

    def records(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The CLI's record of every row of `batch`, in the batch's order."""
        return _checked(lambda: self._records(batch))

    def _records(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        import logitloop as ll
        from logitloop.cli.jobs import (
            check_vocab,
            job_bounds,
            object_item,
            prepare_tokens,
            record,
            render_conversations,
            span,
            validate_params,
        )

        items = []
        for position, (obj, where) in enumerate(batch_objects(batch)):
            item_id = obj.get("id", position)
            items.append(object_item(obj, item_id, where, self.base, self.defaults, position))
        if not items:
            return []
        validate_params(items, self.base, self.base_params)
        render_conversations(items, self.model, self.ignore_eos)
        prepare_tokens(items, self.info)
        for item in items:
            check_vocab(item.params, self.info.vocab_size, item.where)
        bounds = job_bounds(items, self.info, self.defaults)
        self.bounds = {k: max(v, bounds[k]) for k, v in self.bounds.items()}
        requests = [ll.Request(item.token_ids, item.params) for item in items]
        try:
            results = ll.generate_many(
                self.model, requests, n=self.n, ignore_eos=self.ignore_eos,
                deterministic=self.deterministic, slots=self.slots, mesh=self.mesh,
                **self.bounds, **self.options,
            )  # fmt: skip
        except ValueError as e:
            raise CLIError(f"{span(items)}: {e}") from None
        tokenizer = self.info.tokenizer
        return [record(it, r, self.n, tokenizer) for it, r in zip(items, results, strict=True)]


def _checked(fn: Callable[[], Any]) -> Any:
    """The CLI's bad-input error as the library's ValueError (same message)."""
    try:
        return fn()
    except CLIError as e:
        raise ValueError(str(e)) from None


def _load(path, dtype, quantize, load_model, **quantized):
    if quantize is None:
        return _checked(lambda: load_model(path, dtype))
    from logitloop.models.loading import load_pretrained

    if "quantize" not in inspect.signature(load_pretrained).parameters:
        raise ValueError(
            f"quantize = {quantize!r}: this logitloop's load_pretrained takes no quantize="
        )
    return load_pretrained(path, dtype=dtype, quantize=quantize, **quantized)


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


def input_paths(pattern: str | Sequence[str]) -> list[str]:
    """The input files: a path, a glob ('data/*.jsonl'), or a list of them, sorted."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    paths: list[str] = []
    for p in patterns:
        found = sorted(glob.glob(os.path.expanduser(p))) if glob.has_magic(p) else [p]
        if not found:
            raise CLIError(f"--input {p}: no file matches")
        paths.extend(found)
    return paths


def read_inputs(pattern, base: dict[str, Any], defaults) -> list:
    """Every input file's prompts (`jobs.read_items`), as one job: a line without an id has
    its 0-based line number in the files concatenated in sorted order; ids are unique over
    all files."""
    from logitloop.cli.jobs import read_items
    from logitloop.cli.sinks import describe_id, id_key

    items, seen, first = [], {}, 0
    for path in input_paths(pattern):
        part = read_items(path, base, defaults, first_id=first)
        text = Path(path).read_text(encoding="utf-8")
        first += text.count("\n") + (0 if text.endswith("\n") else 1)
        for item in part:
            key = id_key(item.id)
            if key in seen:
                raise CLIError(
                    f"duplicate id {describe_id(item.id)}: {seen[key].where} and {item.where}"
                )
            seen[key] = item
            item.position = len(items)
            items.append(item)
    return items


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
        raise CLIError(f"--workers = {workers} is outside the allowed range [1, inf)")
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
            raise CLIError(str(cause)) from None
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
    from logitloop.cli.jobs import param_defaults, row_params, validate_params
    from logitloop.cli.sinks import JsonlOutput, id_key

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


def output_file(output: str) -> str:
    """`--output` of a Ray job: a file, or a folder (one that exists, or a path ending in
    '/') whose results go to `results.jsonl` in it."""
    path = Path(output).expanduser()
    if output.endswith(("/", os.sep)) or path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        return str(path / "results.jsonl")
    return output
