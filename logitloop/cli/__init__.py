"""The `logitloop` command line.

    logitloop generate "Once upon a time" --temperature 0 --max-tokens 64
    logitloop generate --input prompts.jsonl --output out.jsonl --batch-size 32 --top-p 0.9
    python -m logitloop generate --stream "Hello"
    logitloop explain "Once upon a time" --temperature 0.8 --top-p 0.9 --plot knobs.png
    logitloop chat --system "Answer briefly." --temperature 0.7
    logitloop score --input pairs.jsonl --output scores.jsonl   (`run_score.py`)
    logitloop generate "Translate:" --num-beams 4 --max-tokens 32   (`ll.beam_search`)
    logitloop eval --model logitloop --model_args pretrained=PATH --tasks T  (`run_eval.py`)

`generate` takes prompts as arguments or from `--input FILE`:

- plain text: one prompt per line; blank lines are skipped; a prompt's id is its 0-based
  line number.
- JSONL (the file name ends in `.jsonl`, or its first non-blank character is `{`): one
  object per line with `"prompt"` (a string), `"prompt_token_ids"` (a list of ids) or
  `"messages"` (a conversation, rendered with the model's chat template and stopped at the
  end of the turn, as `ll.chat` does; its output line holds `"messages"`, not `"prompt"`), an
  optional `"id"` (a string or an integer; default: the 0-based line number) and optional
  per-line sampling settings under `SamplingParams.create`'s argument names (`temperature`,
  `top_p`, `max_tokens` (or its alias `max_new_tokens`), `seed`, `stop`, `logit_bias`, ...).
  A line's setting replaces the command-line value for that line. Unknown keys are an error.

Prompts run with continuous batching (`logitloop.decoding.engine.batching`): `--batch-size` rows
decode together, and between chunks of decode steps each row that finished takes the next
waiting prompt. The shapes are fixed for the whole job (from its longest prompt and largest
max_tokens), so it compiles once, plus once more when a line first asks for logprobs or stop
strings.

Without `--output` the completions are printed to stdout (one block per completion, headed
`==> ID <==` when there is more than one). With `--output FILE` every prompt gets one JSON
line, in input order:

    {"id", "prompt", "seed", "text", "token_ids", "num_tokens", "finish_reason", "stop_reason"}

plus `"logprobs"` (per token, under the final sampling distribution), `"raw_logprobs"`
(per token, log-softmax of the model's logits) and `"top_logprobs"` (per token, the top-n
raw alternatives as `[token_id, logprob, token_text]`) for prompts whose `logprobs` is
above 0. `"seed"` is the seed the line was drawn with: `--seed S` (or the line's own
`seed`), else one drawn afresh for the run (named on stderr), so that every line can be
reproduced; `"stop_reason"` is an int (stop token id), a string (stop string), a list of
ids (stop sequence) or null (`ll.GenerationResult`).
With `-n N` > 1 each completion field holds a list of N values, one per sample. A line is
written (and fsync'ed) as soon as it and every line before it are done.

Resuming: when the output file exists, the ids already in it are skipped and the rest are
appended (a partial last line, left by a killed run, is cut off first), so re-running a
killed job with the same arguments neither duplicates nor loses a line. `--overwrite`
starts the file afresh instead: the new file replaces the old one with its first result, so
a job that fails before that (a bad line, a broken model) leaves the old results as they
were. A run holds a lock on its output: a second run on the same file fails, naming the
first one's process id. `--output -` writes the JSONL lines to stdout, as does a path that is
not a regular file (`/dev/stdout`); an output that is the input file is refused. See
`logitloop.jobs.sinks`.

Sampling settings that neither a flag nor a line sets come from the checkpoint's
`generation_config.json` (`SamplingParams.from_model`, as vLLM does), named in one line on
stderr when it sets any; `--generation-config none` ignores the file.

`chat` runs `logitloop.conversation.repl` on the terminal (`run_chat.py`): replies streamed,
the conversation kept, `/reset`, `/exit`, with `ll.chat`'s defaults (the checkpoint's
`generation_config.json`, else 256 tokens); Ctrl-C ends a reply (the part shown is kept), and
at the prompt, like Ctrl-D, leaves.

`explain` prints, for the token after one PROMPT, the top candidates with their probability
after each step of the sampler and the step that cut each one (computed by
`logitloop.decoding.engine.explain`, shown by `logitloop.cli.explain_view`); `--plot FILE.png`
also draws a temperature sweep, raw vs final probabilities and `--draws` tokens from
`ll.sample` against the final distribution. It takes the same sampling flags as `generate`
(those that act on the next token) and validates them with the same messages, and runs the
prompt under `--use-adapter`'s LoRA adapter of its `--adapter NAME=PATH`s, as `chat` does.

Bad input (an invalid setting, an unreadable or malformed input file, a missing model, a
prompt too long for the model's context) prints one line, `logitloop: error: ...`, to
stderr and exits with status 2.

Where things live: `parser.py` (argparse: the flags and the settings they give),
`run_generate.py`, `run_score.py`, `run_explain.py` and `run_chat.py` (the subcommands),
`explain_view.py` (explain's table and figure), `cache.py` (the persistent compilation
cache, `logitloop.compile_cache`), `common.py` (the error type, the checkpoint's sampling
defaults). The job logic lives below the command line, in `logitloop.jobs`, shared with the
Ray integration (`logitloop.integrations.ray`, which `--ray` calls and which imports
nothing from here): `jobs/items.py` (prompts from arguments or input files, each with its
SamplingParams, checked against the model; conversations rendered; result records),
`jobs/sinks.py` (stdout text or the JSONL `--output`: resume, lock, fresh file put in
place). Only what a subcommand needs is imported, when it runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from logitloop.cli.cache import COMPILE_CACHE_ENV, compile_cache_dir, use_compile_cache
from logitloop.cli.common import EXIT_BAD_INPUT, PROG, CLIError
from logitloop.cli.parser import build_parser
from logitloop.jobs.sinks import OutputError, discard_stdout

__all__ = [
    "COMPILE_CACHE_ENV",
    "EXIT_BAD_INPUT",
    "PROG",
    "CLIError",
    "OutputError",
    "build_parser",
    "compile_cache_dir",
    "main",
    "use_compile_cache",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, 2 for bad input, 130 interrupted).

    Without `argv` (the `logitloop` script, `python -m logitloop`) it is the process's own
    command line, and the process ends with it (see `_end_process`)."""
    status = _run(list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        _end_process(status)
    return status


def _end_process(status: int) -> None:
    """Exit now, without the interpreter's teardown: freeing JAX's compiled programs and
    every module's objects takes about half a second, longer than the rest of a second
    run's exit, and the system reclaims it all anyway. Everything the run wrote is closed
    by then (the output file, a --plot figure), and JAX writes a compiled program to the
    persistent cache when it compiles it. Only stdout and stderr may hold buffered text;
    when they cannot be flushed, the ordinary exit reports it as it always did."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(status)


def _run(argv: list[str]) -> int:
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")
            except (ValueError, OSError):  # pragma: no cover - a detached or odd stream
                pass
    if argv[:1] == ["eval"]:
        # lm-eval parses its own arguments (`run_eval`); ours never see them.
        from logitloop.cli import run_eval

        try:
            return run_eval.run(argv[1:])
        except CLIError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version
            return int(e.code or 0)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_BAD_INPUT
        use_compile_cache(args.compile_cache, args.command)
        if args.command == "explain":
            from logitloop.cli import run_explain as command
        elif args.command == "chat":
            from logitloop.cli import run_chat as command
        elif args.command == "score":
            from logitloop.cli import run_score as command
        else:
            from logitloop.cli import run_generate as command
        return command.run(args)
    except (CLIError, OutputError) as e:
        message = " ".join(str(e).splitlines())
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        # Output piped into a reader that went away (`... | head`): stop quietly.
        discard_stdout()
        return 1
