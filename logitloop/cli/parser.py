"""The command line's arguments: argparse, the flags of `generate` and `explain`, and the
sampling settings they give (`base_knobs`), in `SamplingParams.create`'s argument names.

A flag's value is read here only as far as argparse must (a number, TOKEN=BIAS, a stop
string's escapes); its range is checked by `SamplingParams.create` (see `jobs.row_params`).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from logitloop.cli.common import PROG, CLIError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr like every other bad input."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        raise CLIError(f"{message} (see '{self.prog} --help')")


def _parse_bias(text: str) -> tuple[int, float]:
    tok, sep, val = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected TOKEN=BIAS, got {text!r}")
    try:
        return int(tok), float(val)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected TOKEN=BIAS with an integer token id and a number, got {text!r}"
        ) from None


_STOP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'"}
_ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.?)", re.DOTALL)


def _read_schema(path: str) -> str:
    """`--json-schema FILE`: the file's text (SamplingParams.create parses and checks it)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read JSON schema file {path!r}: {e}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"JSON schema file {path!r} is not UTF-8 text") from None


def _parse_stop(text: str) -> str:
    """A `--stop` value with the usual escapes read: \\n \\t \\r \\0 \\\\ \\" \\' \\xHH \\uHHHH
    \\UHHHHHHHH (a shell passes `"\\n\\n"` as backslash-n twice). Other escapes are an error."""

    def one(match: re.Match) -> str:
        code = match.group(1)
        if code in _STOP_ESCAPES:
            return _STOP_ESCAPES[code]
        if code[:1] in ("x", "u", "U") and len(code) > 1:
            value = int(code[1:], 16)
            if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
                raise argparse.ArgumentTypeError(f"{text!r}: \\{code} is not a Unicode character")
            return chr(value)
        raise argparse.ArgumentTypeError(
            f'{text!r}: unknown escape \\{code}; the escapes are \\n \\t \\r \\0 \\\\ \\" '
            "\\' \\xHH \\uHHHH \\UHHHHHHHH (write \\\\ for a backslash)"
        )

    return _ESCAPE.sub(one, text)


def _parse_id_sequence(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        ids = []
    if not ids:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 13,198, got {text!r}"
        )
    return ids


def _parse_guard(text: str) -> tuple[int, int]:
    """`--repetition-guard 8,3` -> (8, 3): max period, min repeats."""
    try:
        period, repeats = (int(t) for t in text.replace(" ", "").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected MAX_PERIOD,MIN_REPEATS such as 8,3, got {text!r}"
        ) from None
    return period, repeats


def base_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling settings given as flags (the others keep SamplingParams' defaults).

    A subcommand without some of the flags (`explain` has no stop strings) leaves them out.
    """
    flag = lambda name: getattr(args, name, None)
    knobs: dict[str, Any] = {}
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "repetition_guard",
    ):
        value = flag(name)
        if value is not None:
            knobs[name] = value
    if flag("logit_bias"):
        knobs["logit_bias"] = dict(args.logit_bias)
    if flag("ban"):
        knobs["banned_token_ids"] = list(args.ban)
    if flag("allow"):
        knobs["allowed_token_ids"] = list(args.allow)
    if flag("stop_token_id"):
        knobs["stop_token_ids"] = list(args.stop_token_id)
    if flag("stop_sequence"):
        knobs["stop_sequences"] = [list(s) for s in args.stop_sequence]
    if flag("stop"):
        knobs["stop"] = list(args.stop)
    if flag("include_stop_str_in_output"):
        knobs["include_stop_str_in_output"] = True
    for name in ("json_schema", "regex"):
        if flag(name) is not None:
            knobs[name] = flag(name)
    if flag("choice"):
        knobs["choice"] = list(args.choice)
    return knobs


_EXPLAIN_HELP = """\
Columns: raw = softmax of the model's logits; then the distribution after masks, bias and
penalties, after temperature, after top-k, after top-p, and after min-p (the final one,
which ll.sample draws from), each renormalised over the tokens that step keeps.
Bad input exits with status 2 and one "logitloop: error: ..." line on stderr, with the same
messages as generate.
"""


_JSONL_HELP = """\
JSONL input: one object per line, e.g.
  {"id": "q1", "prompt": "Once upon a time", "temperature": 0.8, "seed": 3, "max_tokens": 64}
  {"prompt_token_ids": [1, 415, 2936], "stop": ["\\n\\n"], "logprobs": 5}
  {"prompt": "Label:", "choice": ["yes", "no"]}   (also "json_schema": {...}, "regex": "...")
Per-line keys are SamplingParams.create's arguments (max_new_tokens = max_tokens) and
replace the flags for that line; "adapter": "NAME" picks a LoRA adapter --adapter loaded;
"guidance_scale": 3.0 and "negative_prompt": "..." guide the line (docs/guidance.md);
"steer": {"layer": 2, "vector": [...], "scale": 4.0, "tokens": "generated"} (or a list)
steers it (docs/inside.md).

Output (--output FILE.jsonl): one line per prompt, in input order:
  {"id", "prompt", "seed", "text", "token_ids", "num_tokens", "finish_reason", "stop_reason"}
  plus "logprobs", "raw_logprobs", "top_logprobs" ([id, logprob, text]) when logprobs > 0.
  "seed": --seed, the line's own, or one drawn afresh for the run (named on stderr).
An existing output file is resumed: ids already in it are skipped.
Bad input exits with status 2 and one "logitloop: error: ..." line on stderr.
Compiled programs are kept between runs in
~/.cache/logitloop/jax (XDG_CACHE_HOME is honoured); LOGITLOOP_COMPILE_CACHE=DIR puts them
elsewhere, LOGITLOOP_COMPILE_CACHE=off or --no-compile-cache compiles afresh every run.
"""


def build_parser() -> argparse.ArgumentParser:
    from logitloop import __version__

    parser = _Parser(
        prog=PROG,
        description="logitloop: per-row sampling and a jit-compiled decode loop for JAX models.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="generate completions for prompts",
        description="Generate completions, printed to stdout or written as JSONL.",
        epilog=_JSONL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (one or more)")

    io = gen.add_argument_group("input and output")
    io.add_argument(
        "-i",
        "--input",
        metavar="FILE",
        help="prompts, one per line, or JSONL (.jsonl or first character '{'); '-' = stdin",
    )
    io.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write JSONL results here (resumes when it exists)",
    )
    io.add_argument(
        "--overwrite", action="store_true", help="start --output afresh instead of resuming"
    )
    io.add_argument(
        "--batch-size",
        type=int,
        default=32,
        metavar="N",
        help="prompts decoded together (continuous batching slots; default: 32)",
    )
    io.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the slots share one paged KV cache of N tokens (default: 80%% of the "
        "device's free memory in tokens of KV where a cache per slot would not fit; a cache "
        "per slot on a CPU)",
    )
    io.add_argument(
        "--page-size",
        type=int,
        default=16,
        metavar="N",
        help="tokens per page of --kv-cache-tokens (a power of two; default: 16)",
    )
    io.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt whole: no KV pages shared by prompts that start alike "
        "(default: a prefix cache on the paged KV cache, docs/prefix_cache.md)",
    )
    io.add_argument(
        "--stream",
        action="store_true",
        help="print the PROMPTs' text as it is generated (-n and --batch-size apply)",
    )
    io.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar and no final summary"
    )
    ray = gen.add_argument_group("Ray Data (pip install 'logitloop[ray]', docs/ray.md)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="run the --input job on the Ray cluster RAY_ADDRESS names (else a local one), one "
        "model per worker; --input may be a glob ('data/*.jsonl'), --output a folder",
    )
    ray.add_argument(
        "--workers", type=int, default=1, metavar="N", help="Ray actors, each with its model (1)"
    )

    _add_model_flags(gen)
    _add_adapter_flags(gen)
    _add_generation_config_flag(gen)
    _add_speculative_flags(gen)

    s = gen.add_argument_group(
        "sampling (defaults: generation_config.json's, then SamplingParams.create's; "
        "JSONL lines override)"
    )
    _add_sampling_flags(s, generation=True)

    beams = gen.add_argument_group("beam search (ll.beam_search, transformers' rule)")
    beams.add_argument(
        "--num-beams",
        type=int,
        metavar="K",
        help="beam search with K beams instead of sampling: each output line holds the best "
        'beam (-n N: the N best) and its "score"; takes --max-tokens, --min-tokens, '
        "--stop-token-id, --ban, --allow, --logit-bias and the penalties",
    )
    beams.add_argument(
        "--length-penalty", type=float, default=1.0, metavar="X",
        help="beam score = sum of logprobs / length ** X (default: 1.0)",
    )  # fmt: skip
    beams.add_argument(
        "--early-stopping", choices=("true", "false", "never"), default="true",
        help="when a prompt's beam search ends, as transformers' early_stopping (default: true)",
    )  # fmt: skip

    _add_explain_parser(sub)
    _add_chat_parser(sub)
    _add_score_parser(sub)
    return parser


def _add_score_parser(sub) -> None:
    sc = sub.add_parser(
        "score",
        help="log-probabilities of given continuations (ll.score)",
        description="Score continuations given prompts: JSONL in, JSONL out (resumed).",
        epilog=(
            'Input lines: {"id", "prompt" or "prompt_token_ids", "continuation" '
            'or "continuation_token_ids", "adapter"}.\nOutput lines: {"id", "token_ids", '
            '"raw_logprobs", "sum", "is_greedy", "is_argmax"} (+ "text", '
            '"top_logprobs").\nAn existing output file is resumed: ids already in it are '
            "skipped."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    io = sc.add_argument_group("input and output")
    io.add_argument("-i", "--input", metavar="FILE", required=True, help="JSONL pairs; '-' = stdin")
    io.add_argument(
        "-o", "--output", metavar="FILE", help="JSONL results (default: stdout); resumed"
    )
    io.add_argument(
        "--overwrite", action="store_true", help="start --output afresh instead of resuming"
    )
    io.add_argument(
        "--batch-size", type=int, default=16, metavar="N", help="pairs per forward pass (16)"
    )
    io.add_argument(
        "--top-logprobs", type=int, default=0, metavar="N", help="top-N raw alternatives (0)"
    )
    io.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    _add_deterministic_flags(
        io, "each pair's score", "differ in the last bits by the batch it runs in"
    )
    _add_model_flags(sc)
    _add_adapter_flags(sc)


def _add_deterministic_flags(group, what: str, otherwise: str) -> None:
    """--deterministic / --no-deterministic; neither: on with --output (a resumable job;
    run_generate.py and run_score.py decide), off otherwise."""
    group.add_argument(
        "--deterministic",
        action="store_const",
        const=True,
        default=None,
        help=f"{what} does not depend on the batch it runs in (slower); the default with "
        "--output, so that a resumed job writes what an uninterrupted one would",
    )
    group.add_argument(
        "--no-deterministic",
        dest="deterministic",
        action="store_const",
        const=False,
        help=f"faster, also with --output; {what} may then {otherwise}, so a job resumed in "
        "other batches can differ",
    )


def _add_generation_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="auto: sampling settings the flags leave unset come from the checkpoint's "
        "generation_config.json, as in vLLM (shown on stderr when it sets any); none: "
        "SamplingParams.create's defaults (default: auto)",
    )


def speculative_spec(text: str) -> tuple[str, int, int]:
    """`--speculative ngram:N:K` -> ("ngram", N, K): prompt lookup with n-grams up to N and
    K drafts; `draft:K` -> ("draft", 0, K), K drafts from `--draft-model`."""
    parts = text.split(":")
    try:
        if parts[0] == "ngram" and len(parts) == 3:
            kind, n, k = "ngram", int(parts[1]), int(parts[2])
        elif parts[0] == "draft" and len(parts) == 2:
            kind, n, k = "draft", 0, int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not ngram:N:K (e.g. ngram:3:4) or draft:K (e.g. draft:4)"
        ) from None
    if kind == "ngram" and not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"{text!r}: N = {n} is outside the allowed range [1, 64]")
    if not 1 <= k <= 8:
        raise argparse.ArgumentTypeError(f"{text!r}: K = {k} is outside the allowed range [1, 8]")
    return kind, n, k


def _add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative",
        type=speculative_spec,
        metavar="SPEC",
        help="ngram:N:K: K drafts copied from the prompt and output after the last N tokens; "
        "draft:K: K drafts from --draft-model",
    )
    spec.add_argument(
        "--draft-model",
        metavar="NAME",
        help="a draft model: Hub repo id or folder (same tokenizer; K = 4)",
    )
    spec.add_argument(
        "--acceptance",
        choices=["strict", "rejection"],
        default="strict",
        help="strict: the same tokens as without speculation; rejection: the same "
        "distribution (default: strict)",
    )
    spec.add_argument(
        "--cycle-cost",
        type=float,
        metavar="C",
        help="what a propose-verify cycle costs in plain steps: a cycle runs only while "
        "every row gains at least C tokens from it (default: measured on CPU, 1 elsewhere)",
    )


def adapter_spec(text: str) -> tuple[str, str]:
    """`--adapter NAME=PATH` as (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=PATH (a name for the adapter, and its PEFT folder or Hub name)"
        )
    return name.strip(), path.strip()


def _add_adapter_flags(parser: argparse.ArgumentParser, *, one: str | None = None) -> None:
    """`--adapter NAME=PATH` (repeatable) and `--use-adapter NAME`: the adapter of a JSONL
    job's lines that name none, or of `one` ("the conversation": chat; "the prompt":
    explain), which runs alone."""
    per_line = one is None
    lora = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    lines = '; a JSONL line\'s "adapter": "NAME" runs its prompt under it, null under the base'
    lora.add_argument(
        "--adapter",
        type=adapter_spec,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load the PEFT LoRA adapter PATH (a folder or a Hub repo id) as NAME "
        "(repeatable)" + (lines + " model" if per_line else ""),
    )
    runs = "the prompts that name none" if per_line else one
    lora.add_argument(
        "--use-adapter",
        metavar="NAME",
        help=f"the adapter of {runs} (default: the base model)",
    )


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        metavar="NAME",
        help="a Hugging Face Hub repo id (org/name: from the Hugging Face cache, else "
        "downloaded into it) or a checkpoint folder (default: the model shipped with "
        "logitloop)",
    )
    model.add_argument(
        "--revision",
        metavar="REV",
        help="--model's branch, tag or commit hash on the Hub (default: main)",
    )
    model.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="parameter dtype (default: the checkpoint's own)",
    )
    model.add_argument(
        "--quantize",
        choices=("int8", "int4", "fp8"),
        help="weight-only quantized attention and MLP projections (Qwix; needs the extra "
        "`quant`): int8/fp8 per output channel, int4 per --group-size (default: float)",
    )
    model.add_argument(
        "--group-size",
        type=int,
        default=None,
        metavar="N",
        help="--quantize int4: contraction entries per scale (default: the largest of 128, "
        "64, 32 that divides every contraction)",
    )
    model.add_argument(
        "--quantize-embedding",
        action="store_true",
        help="--quantize: the token embedding and LM head too (default: kept in float)",
    )
    model.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="do not keep compiled programs between runs (see LOGITLOOP_COMPILE_CACHE below)",
    )


def _add_sampling_flags(s, *, generation: bool, chat: bool = False) -> None:
    """The sampling knobs, one flag each; `generation=False` (explain) leaves out those that
    only matter after the next token (max tokens, stop strings and sequences, logprobs, -n),
    `chat=True` those a conversation on a terminal has no use for (logprobs, -n)."""
    s.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default: 1.0)")
    s.add_argument("--top-k", type=int, metavar="K", help="<= 0 disables (default: 0)")
    s.add_argument("--top-p", type=float, metavar="P", help="in (0, 1] (default: 1.0)")
    s.add_argument("--min-p", type=float, metavar="P", help="in [0, 1] (default: 0.0)")
    s.add_argument("--repetition-penalty", type=float, metavar="R", help="> 0 (default: 1.0)")
    s.add_argument("--presence-penalty", type=float, metavar="X", help="in [-2, 2] (default: 0)")
    s.add_argument("--frequency-penalty", type=float, metavar="X", help="in [-2, 2] (default: 0)")
    s.add_argument(
        "--logit-bias",
        type=_parse_bias,
        action="append",
        metavar="TOKEN=BIAS",
        help="add BIAS (in [-100, 100]) to token id TOKEN's logit (repeatable)",
    )
    s.add_argument(
        "--ban", type=int, action="append", metavar="TOKEN", help="ban token id (repeatable)"
    )
    s.add_argument(
        "--allow",
        type=int,
        action="append",
        metavar="TOKEN",
        help="allow only these token ids (repeatable)",
    )
    s.add_argument(
        "--seed",
        type=int,
        metavar="S",
        help="per-row random seed (default: generate draws one per run and writes it in "
        "each record; explain and chat use 0)",
    )
    if generation:
        s.add_argument(
            "--max-tokens", "--max-new-tokens", type=int, metavar="N", help="(default: 16)"
        )
    s.add_argument("--min-tokens", type=int, metavar="N", help="(default: 0)")
    s.add_argument(
        "--repetition-guard",
        type=_parse_guard,
        metavar="P,R",
        help="end a row whose last tokens repeat a period of at most P tokens (1-32) R times "
        '(R >= 2) with finish reason "repetition" (default: off)',
    )
    if generation:
        s.add_argument(
            "--stop",
            type=_parse_stop,
            action="append",
            metavar="STR",
            help="stop string (repeatable); backslash escapes are read: \\n \\t \\r \\\\ "
            "\\xHH \\uHHHH (so --stop '\\n\\n' stops at a blank line)",
        )
    s.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        metavar="TOKEN",
        help="stop after this token id (repeatable; the model's EOS is always one)",
    )
    if generation:
        s.add_argument(
            "--stop-sequence",
            type=_parse_id_sequence,
            action="append",
            metavar="ID,ID,...",
            help="stop after this token-id sequence (repeatable)",
        )
        s.add_argument(
            "--include-stop-str-in-output",
            action="store_true",
            help="keep a matched stop string in the text",
        )
    if generation and not chat:
        s.add_argument(
            "--logprobs",
            type=int,
            metavar="N",
            help="record logprobs and the top-N raw alternatives, N in [0, 20] (default: 0)",
        )
        for flag, how, what in (  # structured output: at most one per prompt
            ("--json-schema", {"type": _read_schema, "metavar": "FILE"}, "JSON of FILE's schema"),
            ("--regex", {"metavar": "RE"}, "text that fully matches RE"),
            ("--choice", {"action": "append", "metavar": "STR"}, "one of these (repeatable)"),
        ):
            s.add_argument(flag, **how, help=f"constrain the output to {what}")
        s.add_argument(
            "-n", "--n", type=int, default=1, metavar="N", help="samples per prompt (default: 1)"
        )
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS")
    _add_deterministic_flags(
        s, "a prompt's output", "depend on its batch (a near-tied draw can flip)"
    )
    s.add_argument(
        "--deterministic-model-parallel",
        dest="deterministic",
        action="store_const",
        const="model-parallel",
        help="--deterministic in the mode that a model-parallel mesh reproduces: the output "
        "of generate(..., deterministic='model-parallel') on a model axis of 1, 2, 4 or 8 "
        "devices (slower still)",
    )


def _add_explain_parser(sub) -> None:
    ex = sub.add_parser(
        "explain",
        help="show what every sampling knob does to the next token",
        description=(  # RawDescriptionHelpFormatter prints it as is: lines kept short
            "For the token after PROMPT, print a table of the top candidates: the model's\n"
            "raw probability, the probability after each step of the sampler (masks, bias\n"
            "and penalties; temperature; top-k; top-p; min-p = final) and the step that cut\n"
            "each token. The numbers come from the sampler's own code."
        ),
        epilog=_EXPLAIN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ex.add_argument("prompt", metavar="PROMPT", help="prompt text")
    out = ex.add_argument_group("output")
    out.add_argument(
        "--top",
        type=int,
        default=10,
        metavar="N",
        help="candidates to show: the N most likely after masks, bias and penalties, plus any "
        "of the model's own N most likely they pushed out (default: 10)",
    )
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also write a figure: temperature sweep, raw vs final, draws (needs matplotlib)",
    )
    out.add_argument(
        "--draws",
        type=int,
        default=2000,
        metavar="N",
        help="tokens drawn with ll.sample (seeds S, S+1, ...) for --plot (default: 2000)",
    )
    _add_model_flags(ex)
    s = ex.add_argument_group("sampling (defaults: SamplingParams.create's)")
    _add_sampling_flags(s, generation=False)
    _add_adapter_flags(ex, one="the prompt")


_CHAT_HELP = """\
Type a message and press Enter; the reply streams as it is generated, and the conversation
is kept for the next message. /reset starts a new conversation, /exit or Ctrl-D leaves.
Ctrl-C during a reply ends that reply (the part shown stays in the conversation); Ctrl-C at
the prompt leaves. Each turn uses seed S + turn, so a session replays exactly.
The prompt is the conversation rendered with the checkpoint's chat template
(tokenizer_config.json or chat_template.jinja); a reply ends at the model's EOS ids
(generation_config.json) or the template's end-of-turn token.
"""


def _add_chat_parser(sub) -> None:
    chat = sub.add_parser(
        "chat",
        help="talk with the model on a terminal, with its own chat template",
        description="An interactive conversation with a chat model, replies streamed.",
        epilog=_CHAT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument(
        "--system", metavar="TEXT", help="a system message that starts every conversation"
    )
    _add_model_flags(chat)
    _add_generation_config_flag(chat)
    s = chat.add_argument_group(
        "sampling (defaults: generation_config.json's, then SamplingParams.create's, "
        "max tokens 256)"
    )
    _add_sampling_flags(s, generation=True, chat=True)
    _add_adapter_flags(chat, one="the conversation")
