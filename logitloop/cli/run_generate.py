"""`logitloop generate`: settle the job (prompts, settings, output), load the model, then
generate with continuous batching (`ll.iter_generate_many`) or stream the prompts
(`ll.stream`, `run_stream.py`), writing each result as soon as every one before it is
written. Without `--seed`, each run draws its seed and writes it into every record."""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from logitloop.cli.common import (
    PROG,
    CLIError,
    adapter_specs,
    checkpoint_defaults,
    resolve_models,
)
from logitloop.cli.parser import base_knobs
from logitloop.cli.run_stream import stream_items
from logitloop.jobs import load_adapters, load_model
from logitloop.jobs.items import (
    ADAPTER_KEY,
    Item,
    adapter_rows,
    check_adapters,
    check_vocab,
    job_bounds,
    param_defaults,
    prepare_tokens,
    prompt_items,
    read_inputs,
    read_items,
    record,
    render_conversations,
    request_error,
    row_params,
    span,
    validate_params,
)
from logitloop.jobs.request_keys import (
    GUIDANCE_KEYS,
    check_requests,
    may_guide,
    refuse_requests,
    request_kwargs,
)
from logitloop.jobs.sinks import JsonlOutput, TextOutput, check_not_input, id_key, output_file


def run(args: argparse.Namespace) -> int:
    """The `generate` subcommand; returns the exit status."""
    started = time.perf_counter()

    def note(message: str) -> None:
        if not args.quiet:
            print(f"{PROG}: {message}", file=sys.stderr, flush=True)

    def warn(message: str) -> None:
        print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)

    if args.input is not None and args.prompts:
        raise CLIError("give prompts as arguments or with --input FILE, not both")
    if args.input is None and not args.prompts:
        raise CLIError("no prompts: give PROMPT arguments or --input FILE")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size = {args.batch_size} is outside the allowed range [1, inf)")
    if args.n < 1:
        raise CLIError(f"-n = {args.n} is outside the allowed range [1, inf)")
    if args.stream and (args.input is not None or args.output):
        raise CLIError(
            "--stream prints PROMPT arguments as they are generated: no --input/--output"
        )
    if args.overwrite and not args.output:
        raise CLIError("--overwrite needs --output FILE")
    if args.speculative and args.speculative[0] == "draft" and not args.draft_model:
        raise CLIError("--speculative draft:K needs --draft-model NAME")
    if args.speculative and args.speculative[0] == "ngram" and args.draft_model:
        raise CLIError("--speculative ngram:N:K and --draft-model exclude each other")
    if args.deterministic is None:
        # A job written to --output can be resumed, in other batches: only the deterministic
        # mode makes each prompt's output independent of its batch (docs/cli.md).
        args.deterministic = bool(args.output)
    if args.num_beams is not None:
        _check_beam_flags(args)
    resolve_models(args)
    args.adapters = adapters = adapter_specs(args)  # {name: path}

    defaults = param_defaults()
    # generation_config.json's settings are sampling settings, which beam search has none of.
    recommended = {} if args.num_beams else checkpoint_defaults(args, show=not args.quiet)
    base = {**recommended, **base_knobs(args)}
    if args.use_adapter is not None:  # a line's "adapter" replaces it
        base[ADAPTER_KEY] = args.use_adapter
    drawn = "seed" not in base
    if drawn:  # a fresh draw each run, written into every record
        base["seed"] = secrets.randbelow(2**31)
    base_params = row_params(base)
    if args.ray:
        _check_ray_flags(args)
        args.output = output_file(args.output)
        items = read_inputs(args.input, base, defaults)
    elif args.input is not None:
        items = read_items(args.input, base, defaults)
    else:
        items = prompt_items(args.prompts, base)

    sink = None
    skipped = 0
    todo = items
    if args.output:
        check_not_input(args.output, args.input)
        sink = JsonlOutput.open(args.output, args.overwrite, warn)
        if sink.done:
            stray = len(sink.done - {id_key(it.id) for it in items})
            if stray:
                warn(f"{sink.name} holds {stray} ids that are not in the input")
            todo = [it for it in items if id_key(it.id) not in sink.done]
            skipped = len(items) - len(todo)
    try:
        check_adapters(items, list(adapters))
        if args.num_beams is not None:
            refuse_requests(todo, "--num-beams")
        if args.speculative or args.draft_model:
            refuse_requests(todo, "--speculative", GUIDANCE_KEYS)
        validate_params(todo, base, base_params)
        if not todo:
            note(f"nothing to do: all {len(items)} prompts are already in {sink.name}")
            return 0
        seed = base["seed"] if drawn else None
        if args.ray:
            return _run_ray(args, items, todo, skipped, base, sink, note, started, seed)
        return _run_job(
            args, items, todo, skipped, base_params, defaults, sink, note, started, seed
        )  # fmt: skip
    finally:
        if sink is not None:
            sink.close()


# The fewest continuous-batching slots a generate job runs (unless --batch-size is lower).
MIN_CLI_SLOTS = 8


def _run_job(
    args, items, todo, skipped, base_params, defaults, sink, note, started, seed=None
) -> int:
    """The job after its inputs, settings and output are settled: load, render the
    conversations, check, generate. `seed`: the seed drawn for this run (None: --seed)."""
    from logitloop.decoding.engine.host import row_bucket
    from logitloop.decoding.loop.runner import model_info
    from logitloop.decoding.runtime.compiles import CompileWatch, compile_stats

    output = None if sink is None else sink.name
    t_load = time.perf_counter()
    model = load_model(
        args.model, args.dtype, args.quantize, args.group_size, args.quantize_embedding
    )
    info = model_info(model)
    adapters = load_adapters(model, args.adapters)  # None without --adapter
    load_s = time.perf_counter() - t_load
    render_conversations(items, model, args.ignore_eos)
    prepare_tokens(todo, info)
    check_requests(todo, info)
    check_vocab(base_params, info.vocab_size)  # token ids given as flags: named as such
    for item in todo:
        if item.params is not base_params:
            check_vocab(item.params, info.vocab_size, item.where)

    speculative = _speculation(args)
    if sink is None:
        sink = TextOutput(headers=len(items) * args.n > 1)
    gen_started = time.perf_counter()
    compile_stats(reset=True)  # the summary names this job's programs
    with CompileWatch() as timer:
        if args.num_beams is not None:
            tokens = _run_beams(args, model, todo, sink.write, adapters)
        elif args.stream:
            tokens = stream_items(
                model, todo, sink, n=args.n, batch_size=args.batch_size,
                ignore_eos=args.ignore_eos, deterministic=args.deterministic,
                speculative=speculative, adapters=adapters,
            )  # fmt: skip
        else:
            # Slots at the row bucket of the prompts (`row_bucket`), at least
            # `MIN_CLI_SLOTS`: a run of 1 to 8 prompts runs the programs (and disk-cache
            # entries) of any other such run; a decode step of 8 rows costs about one
            # of 1 where the weights' bytes bound it (docs/performance.md).
            slots = min(args.batch_size, row_bucket(max(len(items), MIN_CLI_SLOTS)))
            shapes = dict(job_bounds(items, info, defaults), slots=slots)
            shapes["speculative"] = speculative
            if adapters is not None:
                shapes["adapters"] = adapters
            kv_cache_tokens = _kv_cache_tokens(args, info, shapes)
            if kv_cache_tokens is not None:  # one paged pool (`paged_batching`)
                shapes.update(kv_cache_tokens=kv_cache_tokens, page_size=args.page_size)
            if args.no_prefix_cache:
                shapes["prefix_cache"] = False
            if args.input is not None and not args.quiet:  # a batch job: its programs first
                _precompile_job(args, model, shapes)
            tokens = _run_requests(args, model, todo, shapes, sink.write, info.tokenizer)
    gen_s = time.perf_counter() - gen_started
    why = compile_stats(reset=True)
    compile_s = timer.seconds + why.load_seconds  # getting the programs: made or loaded

    where = f" into {output}" if output is not None else ""
    skip = f" ({skipped} already in {output}, skipped)" if skipped else ""
    note(
        f"{_plural(len(todo), 'prompt')}{skip}, {_plural(tokens, 'token')} generated{where} "
        f"in {gen_s:.1f} s wall "
        f"({_fmt_rate(tokens, gen_s)} tokens/s overall, "
        f"{_fmt_rate(tokens, gen_s - compile_s)} tokens/s excluding compile); "
        f"compile {compile_s:.1f} s (measured: JAX trace + lowering + XLA compile events "
        f"during generation, and programs loaded from disk; {why.summary()}); "
        f"model load {load_s:.1f} s; total "
        f"{time.perf_counter() - started:.1f} s"
        + ("" if seed is None else f"; seed {seed} (drawn for this run; --seed {seed} repeats it)")
    )
    return 0


def _precompile_job(args, model, shapes: dict[str, Any]) -> None:
    """Compile the job's continuous-batching programs before its first request, with a
    progress line (`ll.precompile(slots=...)`): the job's shapes, its shared options."""
    from logitloop.decoding.engine.precompile import precompile

    job = {k: v for k, v in shapes.items() if k not in ("max_prompt_len", "max_tokens_bound")}
    precompile(
        model, prompt_len=shapes["max_prompt_len"], max_tokens=shapes["max_tokens_bound"],
        progress=True, n=args.n, ignore_eos=args.ignore_eos, deterministic=args.deterministic,
        **job,
    )  # fmt: skip


def _check_ray_flags(args) -> None:
    """--ray runs an --input job into an --output, sampling with `generate_many`."""
    from logitloop.integrations.ray import require_ray

    if args.input is None or not args.output:
        raise CLIError("--ray needs --input FILES and --output FILE or FOLDER/")
    if args.stream or args.num_beams is not None or args.draft_model:
        raise CLIError("--ray takes no --stream, --num-beams or --draft-model")
    if args.workers < 1:
        raise CLIError(f"--workers = {args.workers} is outside the allowed range [1, inf)")
    try:
        require_ray()
    except ImportError as e:
        raise CLIError(str(e)) from None


def _run_ray(args, items, todo, skipped, base, sink, note, started, seed) -> int:
    """The job on Ray actors (`logitloop.integrations.ray.run_items`), each loading the
    model; records are written as batches finish (resume matches ids, not order)."""
    from logitloop.integrations.ray import run_items

    # A Hub model by its name and commit: each actor finds it in its own node's cache.
    model, revision = args.hub_model or (args.model, None)
    tokens = run_items(
        todo, base, sink.write, workers=args.workers, batch_size=args.batch_size,
        progress=not args.quiet, model=model, revision=revision, dtype=args.dtype, n=args.n,
        quantize=args.quantize, group_size=args.group_size,
        quantize_embedding=args.quantize_embedding,
        ignore_eos=args.ignore_eos, deterministic=args.deterministic, slots=args.batch_size,
        speculative=_speculation(args), compile_cache=args.compile_cache,
        prefix_cache=False if args.no_prefix_cache else None,
        adapters=args.adapters or None,
    )  # fmt: skip
    skip = f" ({skipped} already in {sink.name}, skipped)" if skipped else ""
    note(
        f"{_plural(len(todo), 'prompt')}{skip}, {_plural(tokens, 'token')} generated into "
        f"{sink.name} on {_plural(args.workers, 'Ray worker')}; total "
        f"{time.perf_counter() - started:.1f} s"
        + ("" if seed is None else f"; seed {seed} (drawn for this run; --seed {seed} repeats it)")
    )
    return 0


def _kv_cache_tokens(args, info, shapes: dict[str, Any]) -> int | None:
    """--kv-cache-tokens, or by default the pool the device's free memory holds when the
    contiguous slots would not fit (`memory_check.default_kv_cache_tokens`)."""
    if args.kv_cache_tokens is not None:
        return args.kv_cache_tokens
    from logitloop.decoding.engine import memory_check
    from logitloop.decoding.engine.host import MIN_BUFFER_BUCKET, MIN_PROMPT_BUCKET, bucket

    memory = memory_check.device_memory()
    if memory is None:  # a CPU: the contiguous slots
        return None
    per_slot = bucket(shapes["max_prompt_len"], MIN_PROMPT_BUCKET) + bucket(
        shapes["max_tokens_bound"], MIN_BUFFER_BUCKET
    )
    return memory_check.default_kv_cache_tokens(
        info.runner.kv_bytes_per_token(info.weights),
        shapes["slots"] * per_slot,
        args.page_size,
        memory,
    )


def _run_requests(
    args,
    model,
    todo: Sequence[Item],
    shapes: dict[str, int],
    write: Callable[[list[dict[str, Any]], int], None],
    tokenizer=None,
) -> int:
    """Generate every prompt with continuous batching; write records in input order.
    Returns the number of tokens generated."""
    from tqdm import tqdm

    from logitloop.decoding.engine.batching import Request, iter_generate_many

    bar = tqdm(
        total=len(todo),
        unit="prompt",
        file=sys.stderr,
        disable=args.quiet or args.input is None,
        dynamic_ncols=True,
    )

    def requests():
        for item in todo:
            yield Request(item.token_ids, item.params, **request_kwargs(item))

    tokens = 0
    finished: dict[int, dict[str, Any]] = {}
    written = 0
    try:
        for index, result in iter_generate_many(
            model, requests(), n=args.n, ignore_eos=args.ignore_eos,
            deterministic=args.deterministic, **shapes, **may_guide(todo),
        ):  # fmt: skip
            finished[index] = record(todo[index], result, args.n, tokenizer)
            tokens += sum(result.num_tokens)
            ready = []
            while written in finished:
                ready.append(finished.pop(written))
                written += 1
            if ready:
                write(ready, args.n)
            bar.update(1)
            bar.set_postfix(tokens=tokens, refresh=False)
    except ValueError as e:
        raise request_error(todo, e) from None
    finally:
        bar.close()
    return tokens


def _check_beam_flags(args) -> None:
    """--num-beams with the flags it takes: no sampling, streaming or speculation."""
    if args.num_beams < 1:
        raise CLIError(f"--num-beams = {args.num_beams} is outside the allowed range [1, inf)")
    if args.n > args.num_beams:
        raise CLIError(f"-n = {args.n} is outside the allowed range [1, {args.num_beams}]")
    if args.stream or args.speculative or args.draft_model:
        raise CLIError("--num-beams takes no --stream, --speculative or --draft-model")
    knobs = base_knobs(args)
    for name in ("temperature", "top_k", "top_p", "min_p", "stop", "stop_sequences", "logprobs",
                 "json_schema", "regex", "choice"):  # fmt: skip
        if name in knobs:
            raise CLIError(
                f"--num-beams is deterministic: --{name.replace('_', '-')} does not apply"
            )


def _run_beams(args, model, todo: Sequence[Item], write, adapters=None) -> int:
    """Beam search, `--batch-size` prompts at a time (consecutive prompts with the same
    max_tokens); records in input order with each beam's "score". Returns the tokens."""
    import numpy as np

    import logitloop as ll
    from logitloop.decoding.engine.host import GenerationResult

    early = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    tokens = 0
    start = 0
    while start < len(todo):
        first = int(np.asarray(todo[start].params.max_tokens)[0])
        end = start + 1
        while (
            end < len(todo)
            and end - start < args.batch_size
            and int(np.asarray(todo[end].params.max_tokens)[0]) == first
        ):
            end += 1
        part = todo[start:end]
        try:
            beams = ll.beam_search(
                model, [it.token_ids for it in part], num_beams=args.num_beams,
                max_tokens=first, length_penalty=args.length_penalty, early_stopping=early,
                num_return_sequences=args.n, ignore_eos=args.ignore_eos,
                params=ll.SamplingParams.concat([it.params for it in part]),
                deterministic=args.deterministic, **adapter_rows(adapters, part),
            )  # fmt: skip
        except ValueError as e:
            raise CLIError(f"{span(part)}: {e}") from None
        records = []
        for item, found in zip(part, beams, strict=True):
            result = GenerationResult(
                token_ids=[b.token_ids for b in found],
                finish_reason=[b.finish_reason for b in found],
                stop_reason=[b.stop_reason for b in found],
                num_tokens=[len(b.token_ids) for b in found],
                prompt_token_ids=[item.token_ids] * len(found),
                text=None if found[0].text is None else [b.text for b in found],
            )
            rec = record(item, result, args.n)
            rec["score"] = found[0].score if args.n == 1 else [b.score for b in found]
            records.append(rec)
            tokens += sum(result.num_tokens)
        write(records, args.n)
        start = end
    return tokens


def _speculation(args):
    """`--speculative`, `--draft-model`, `--acceptance`, `--cycle-cost` as `speculative=`."""
    import logitloop as ll

    kind, n, k = args.speculative or ("draft" if args.draft_model else None, 0, 4)
    common = dict(num_draft=k, acceptance=args.acceptance, cycle_cost=args.cycle_cost)
    if kind == "ngram":
        return ll.PromptLookup(max_ngram=n, **common)
    if kind == "draft":
        return ll.DraftModel(model=load_model(args.draft_model, args.dtype), **common)
    return None


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _fmt_rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f}" if seconds > 0 else "n/a"
