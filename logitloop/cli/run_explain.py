"""`logitloop explain`: the next token's table (and `--plot`'s figure) for one PROMPT, its
settings validated exactly as `generate` validates them; the prompt runs under
`--use-adapter`'s LoRA adapter of the `--adapter`s loaded (default: the base model)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from logitloop.cli.common import PROG, CLIError, adapter_specs, resolve_models
from logitloop.cli.parser import base_knobs
from logitloop.jobs import load_adapters, load_model
from logitloop.jobs.items import check_prompt, check_vocab, prompt_ids, row_params

_EXPLAIN_MAX_TOKENS = 2**31 - 1  # explain has no --max-tokens: min_tokens is bounded by itself


def _plot_formats() -> dict[str, str]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CLIError(
            "--plot needs matplotlib, which is not installed (pip install matplotlib)"
        ) from None
    return FigureCanvasAgg(Figure()).get_supported_filetypes()


def run(args: argparse.Namespace) -> int:
    """The `explain` subcommand; returns the exit status."""
    check_prompt("PROMPT", args.prompt)
    if args.top < 1:
        raise CLIError(f"--top = {args.top} is outside the allowed range [1, inf)")
    if args.draws < 1:
        raise CLIError(f"--draws = {args.draws} is outside the allowed range [1, inf)")
    plot = None
    if args.plot is not None:
        plot = Path(args.plot).expanduser()
        formats = _plot_formats()
        suffix = plot.suffix.lower().lstrip(".")
        if suffix not in formats:
            raise CLIError(
                f"--plot {args.plot}: the file name must end in one of "
                f"{', '.join('.' + f for f in sorted(formats))}"
            )
        if not plot.parent.is_dir():
            raise CLIError(f"--plot {args.plot}: folder not found: {plot.parent}")
    resolve_models(args)
    params = row_params(dict(base_knobs(args), max_tokens=_EXPLAIN_MAX_TOKENS))
    specs = adapter_specs(args)  # {name: path}, --use-adapter one of them

    from logitloop.cli.explain_view import explanation_figure, format_table
    from logitloop.decoding.engine.explain import draw_next_tokens, explain_next_token
    from logitloop.decoding.loop.runner import model_info

    model = load_model(
        args.model, args.dtype, args.quantize, args.group_size, args.quantize_embedding
    )
    adapters = load_adapters(model, specs)  # None without --adapter
    info = model_info(model)
    check_vocab(params, info.vocab_size)  # token ids given as flags, against the vocabulary
    ids = prompt_ids("PROMPT", args.prompt, 1, info)  # room for the next token
    try:
        expl = explain_next_token(
            model, ids, params, ignore_eos=args.ignore_eos, adapters=adapters,
            adapter=args.use_adapter,
        )  # fmt: skip
    except ValueError as e:
        raise CLIError(str(e)) from None
    # which weights are quantized (format, group size) and which stay float
    sys.stdout.write(f"weights: {info.weights_format}\n" + format_table(expl, args.top) + "\n")
    sys.stdout.flush()

    if plot is not None:
        draws = draw_next_tokens(expl, args.draws)
        fig = explanation_figure(expl, draws, top=args.top)
        try:
            fig.savefig(plot, dpi=100)
        except OSError as e:
            raise CLIError(f"cannot write {plot}: {e.strerror or e}") from None
        print(
            f"{PROG}: wrote {plot} ({len(fig.axes)} panels; {args.draws} draws from ll.sample)",
            file=sys.stderr,
            flush=True,
        )
    return 0
