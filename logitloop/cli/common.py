"""What every part of the command line shares: its name, the bad-input error, the model's
folder (a folder or a Hub name; loading it: `logitloop.jobs.load_model`), the checkpoint's
sampling defaults, the LoRA adapters' flags."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from logitloop.jobs import JobError

PROG = "logitloop"
EXIT_BAD_INPUT = 2


# Bad input: reported as one `logitloop: error: ...` line, exit status 2. It is the jobs'
# error (`logitloop.jobs`, below the CLI and shared with the Ray integration), so that a bad
# line of an input file and a bad flag end the same way.
CLIError = JobError


def resolve_models(args) -> None:
    """`--model` (at `--revision`) and `--draft-model` as local folders, before anything
    reads them: a Hugging Face Hub repo id is found in the Hugging Face cache or downloaded
    into it (`logitloop.models.hub`), once. A Hub model is also kept as `args.hub_model`,
    (repo id, commit), for the Ray actors, which find it in their own caches."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    quiet = getattr(args, "quiet", False) and not are_progress_bars_disabled()
    if quiet:  # the hub's download bars, as quiet as the CLI's own
        disable_progress_bars()
    try:
        _resolve_models(args)
    finally:
        if quiet:
            enable_progress_bars()


def _resolve_models(args) -> None:
    from logitloop.models.hub import model_folder

    args.hub_model = None
    named = {"--model": args.model, "--draft-model": getattr(args, "draft_model", None)}
    for flag, name in named.items():
        revision = args.revision if flag == "--model" else None
        if name is None:
            if revision is not None:
                raise CLIError("--revision needs --model naming a Hugging Face Hub repo")
            continue
        try:
            folder = model_folder(name, revision=revision)
        except (OSError, ValueError) as e:
            raise CLIError(f"{flag} {name}: {e}") from None
        if flag == "--model":
            args.model = str(folder)
            if not Path(name).expanduser().is_dir():
                args.hub_model = (name, folder.name)
        else:
            args.draft_model = str(folder)


def adapter_specs(args) -> dict[str, str]:
    """`--adapter NAME=PATH` (repeatable) as {name: path}, and `--use-adapter` one of them."""
    specs: dict[str, str] = {}
    for name, path in args.adapter:
        if name in specs:
            raise CLIError(f"--adapter {name}=...: the name {name!r} is given twice")
        specs[name] = path
    if args.use_adapter is not None and args.use_adapter not in specs:
        raise CLIError(
            f"--use-adapter {args.use_adapter}: no --adapter {args.use_adapter}=PATH loads it"
        )
    return specs


def checkpoint_defaults(args, *, show: bool = True) -> dict[str, Any]:
    """The sampling settings the --model folder's generation_config.json recommends
    (`logitloop.decoding.sampling.params.generation_defaults`), unless `--generation-config none`.
    When it sets any and `show`, one line on stderr names them and the file, as vLLM does at
    start: a flag (or a JSONL key) replaces a default of the same name."""
    if args.generation_config == "none":
        return {}
    from logitloop.decoding.sampling.params import generation_defaults
    from logitloop.models.loading import SHIPPED_MODEL_DIR

    folder = SHIPPED_MODEL_DIR if args.model is None else Path(args.model).expanduser()
    try:
        defaults = generation_defaults(folder)
    except ValueError as e:
        raise CLIError(f"{e} (--generation-config none ignores the file)") from None
    if defaults and show:
        settings = ", ".join(f"{name}={value}" for name, value in defaults.items())
        print(
            f"{PROG}: sampling defaults from {folder / 'generation_config.json'}: {settings} "
            "(flags override them; --generation-config none ignores them)",
            file=sys.stderr,
            flush=True,
        )
    return defaults
