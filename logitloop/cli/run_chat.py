"""`logitloop chat`: settle the sampling settings (the checkpoint's generation_config.json
defaults under the flags), load the model, its chat template and the `--adapter`s (the
conversation runs under `--use-adapter`'s, default the base model), then run the
interactive loop of `logitloop.conversation.repl` on the terminal."""

from __future__ import annotations

import argparse
import sys

from logitloop.cli.common import CLIError, adapter_specs, checkpoint_defaults, resolve_models
from logitloop.cli.parser import base_knobs
from logitloop.jobs import load_adapters, load_model
from logitloop.jobs.items import row_params


class TerminalInput:
    """`readline()` through `input()`, so that a terminal gets line editing and history
    (the `readline` module, where Python has it); '' at end of input, as a file gives."""

    def __init__(self):
        try:
            import readline  # noqa: F401 -- importing it gives input() line editing
        except ImportError:  # pragma: no cover - Python without GNU readline/libedit
            pass

    def readline(self) -> str:
        try:
            return input() + "\n"
        except EOFError:
            return ""


def run(args: argparse.Namespace) -> int:
    """The `chat` subcommand; returns the exit status."""
    from logitloop.conversation import CHAT_MAX_TOKENS, model_template, repl

    resolve_models(args)
    if args.system is not None and not args.system.strip():
        raise CLIError("--system is empty")
    knobs = {"max_tokens": CHAT_MAX_TOKENS, **checkpoint_defaults(args), **base_knobs(args)}
    row_params(knobs)  # every flag checked before the model loads
    specs = adapter_specs(args)  # {name: path}, --use-adapter one of them
    model = load_model(
        args.model, args.dtype, args.quantize, args.group_size, args.quantize_embedding
    )
    adapters = load_adapters(model, specs)  # None without --adapter
    try:
        template = model_template(model)
    except ValueError as e:
        raise CLIError(str(e)) from None
    stdin = TerminalInput() if sys.stdin.isatty() else sys.stdin
    repl(
        model,
        knobs,
        input=stdin,
        output=sys.stdout,
        system=args.system,
        chat_template=template,
        checkpoint_defaults=False,  # already under the flags (or --generation-config none)
        ignore_eos=args.ignore_eos,
        adapters=adapters,
        adapter=args.use_adapter,
    )
    return 0
