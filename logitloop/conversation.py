"""Conversations: the checkpoint's own chat template, end-of-turn stops, generation defaults.

    model = ll.load_pretrained("path/to/instruct_checkpoint")
    result = ll.chat(model, [[{"role": "user", "content": "What does a with statement do?"}]])
    result.text[0]                      # the reply, without the end-of-turn token

- The template is the checkpoint's (`chat_template` in `tokenizer_config.json`, a string or a
  list of named templates, or a `chat_template.jinja` file, which takes precedence), rendered
  the way `transformers`' `apply_chat_template` renders it: jinja2's sandbox with
  `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a
  `tojson` filter that neither escapes HTML nor sorts keys, and the special tokens of
  `tokenizer_config.json` (`bos_token`, `eos_token`, ...) as variables. The rendered text is
  tokenized without adding special tokens: the template writes the BOS itself.
- A reply ends at the model's end-of-sequence ids (`generation_config.json` first) or at the
  template's end-of-turn token (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`: the added token
  the template writes right after an assistant message); a matched stop token is not part
  of the reply text.
- The sampling settings the checkpoint recommends (`generation_config.json`) are read by
  `logitloop.decoding.sampling.params.generation_defaults`; `chat_params` puts the user's
  settings over them, and them over `CHAT_MAX_TOKENS` (the same defaults as `logitloop chat`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np

from logitloop.decoding.engine.generate import GenerationResult, StreamEvent, generate, stream
from logitloop.decoding.engine.plan import sampling_names, sampling_params
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.models.generation_config import checkpoint_dir
from logitloop.models.json_file import read_json as _read_json
from logitloop.template_limits import BoundedSandbox, LimitExceeded, RenderLimits
from logitloop.template_limits import render as render_bounded

# A reply's max_tokens where the checkpoint's generation_config.json sets none: a chat reply
# needs more room than generate's 16 tokens.
CHAT_MAX_TOKENS = 256
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"  # more named templates, one .jinja file each
# The special-token names transformers hands every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Older names a message's reasoning is passed under; transformers copies them to the one
# templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# ------------------------------------------------------------------------ the jinja side


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates may use to mark
    assistant text: the body renders as it is (in its own scope, as in transformers)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no reaching Python internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 -- jinja's own signature trick: self in args
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set {name!r} on a namespace (underscore names)"
            )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own filter escapes <, >, & and ' and sorts keys; transformers' does neither.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=4)
def _environment(limits: RenderLimits) -> BoundedSandbox:
    env = BoundedSandbox(
        limits,
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str, where: str, limits: RenderLimits) -> jinja2.Template:
    """The template compiled in the environment of `limits` (its `*`, `**`, `+` bounds)."""
    try:
        return _environment(limits).from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{where}: the chat template does not parse: line {e.lineno}: {e}") from e


# --------------------------------------------------------------------------- templates


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The token variables transformers passes a template: the named special tokens, any
    other `*_token` entry, and `extra_special_tokens` when it is a dict of named tokens."""
    extra = config.get("extra_special_tokens")
    named = dict(extra) if isinstance(extra, dict) else {}
    named.update((k, v) for k, v in config.items() if k.endswith("_token"))
    out = {}
    for key, value in named.items():
        text = _token_text(value)
        if text is not None:
            out[key] = text
    return out


def _folder_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """name -> (template source, where it came from). Template files replace the config's
    entries, as in transformers."""
    files: dict[str, tuple[str, str]] = {}
    main = folder / TEMPLATE_FILE
    if main.is_file():
        files["default"] = main.read_text(encoding="utf-8"), str(main)
    if (folder / TEMPLATE_DIR).is_dir():
        for path in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8"), str(path)
    if files:
        return files
    where = str(folder / "tokenizer_config.json")
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": (value, where)}
    if isinstance(value, list) and all(
        isinstance(t, dict) and all(isinstance(t.get(k), str) for k in ("name", "template"))
        for t in value
    ):
        return {t["name"]: (t["template"], f"{where} (template {t['name']!r})") for t in value}
    raise ValueError(
        f"{where}: chat_template must be a string or a list of {{'name', 'template'}} objects"
    )


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A jinja chat template and the token variables it is rendered with.

    Build with `ChatTemplate.from_folder(checkpoint_folder)`, or directly, e.g.
    `ChatTemplate(source, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})` for a
    model that was not loaded from a folder (a `FunctionModel`).
    """

    source: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    where: str = "chat template"  # the file it came from, for error messages
    # How long one rendering may take and how much text it may make (template_limits.py).
    limits: RenderLimits = RenderLimits()

    @classmethod
    def from_folder(cls, folder: str | Path, name: str | None = None) -> ChatTemplate:
        """The template of a checkpoint folder; `name` picks one of several named templates
        (default: the one named "default").

        Raises ValueError when the folder has no template, or several and none is chosen.
        """
        folder = Path(folder)
        config = _read_config(folder / "tokenizer_config.json")
        templates = _folder_templates(folder, config)
        if not templates:
            raise ValueError(
                f"{folder} has no chat template (no 'chat_template' in tokenizer_config.json "
                f"and no {TEMPLATE_FILE}): chat needs one; generate works without it"
            )
        choice = "default" if name is None else name
        if choice not in templates:
            raise ValueError(
                f"{folder}: no chat template named {choice!r}; it has {sorted(templates)}"
            )
        source, where = templates[choice]
        return cls(source, _special_tokens(config), where)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        where: str = "messages",
        **variables: Any,
    ) -> str:
        """The conversation as text, exactly as transformers' `apply_chat_template(...,
        tokenize=False)` renders it. `variables` reach the template too (e.g. `tools`,
        `enable_thinking`) and override the special tokens of the same name.

        The template renders once, within `self.limits` (`RenderLimits`: 2 s and 4 million
        characters by default; `dataclasses.replace(template, limits=RenderLimits(...))`
        to change them).

        Raises ValueError naming `where` (the conversation) and this template's file: when
        it goes past a limit, or when it raises (then with the last message it read, the
        one it refused in templates that check messages in order, and its reason).
        """
        messages = _plain_messages(messages, where)
        template = _compile(self.source, self.where, self.limits)
        context = {
            "tools": None,
            "documents": None,
            **self.special_tokens,
            **variables,
            "add_generation_prompt": bool(add_generation_prompt),
        }
        try:
            return render_bounded(template, messages, context, self.limits)
        except LimitExceeded as e:
            raise ValueError(
                f"{where}: the chat template ({self.where}) was stopped: {e} (ChatTemplate's "
                "limits=RenderLimits(time_s=..., max_chars=...) sets the limits)"
            ) from None
        except Exception as e:  # the template is foreign code: any failure is its refusal
            culprit = getattr(e, "message_index", None)
            at = ""
            if culprit is not None:
                at = f", messages[{culprit}] (role {messages[culprit].get('role')!r})"
            raise ValueError(f"{where}{at}: the chat template ({self.where}) raised: {e}") from e

    def end_of_turn_token(self, tokenizer) -> int | None:
        """The id of the added token the template writes right after an assistant message
        (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`, or the EOS), or None if there is none."""
        probe = "logitloop-end-of-turn-probe"
        turns = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": probe},
            {"role": "user", "content": "Bye"},
        ]
        try:
            text = self.render(turns, add_generation_prompt=False)
        except ValueError:
            return None
        at = text.find(probe)
        if at < 0:
            return None
        tail = text[at + len(probe) :].lstrip()
        added = [(i, t) for i, t in tokenizer.added_tokens().items() if t and not t.isspace()]
        hits = [(len(t), i) for i, t in added if tail.startswith(t)]
        return max(hits)[1] if hits else None


def _plain_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Copies of the messages as transformers hands them to a template: keys whose value is
    None dropped, reasoning under `reasoning_content` (and `thinking`) whatever it came as."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"{where} must be a list of {{'role', 'content'}} messages")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(
                f"{where}, messages[{index}] = {message!r} is not a message: a dict with a "
                "'role' string and its 'content'"
            )
        plain = {key: value for key, value in message.items() if value is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


# ------------------------------------------------------------------- model-level helpers


def model_template(model: Any) -> ChatTemplate:
    """The chat template of the checkpoint the model was loaded from."""
    folder = checkpoint_dir(model)
    if folder is None:
        raise ValueError(
            "chat needs a chat template, and this model was not loaded from a checkpoint "
            "folder (ll.load_pretrained): pass chat_template=ChatTemplate(...)"
        )
    return ChatTemplate.from_folder(folder)


def _tokenizer(model: Any):
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("chat needs a model that carries a tokenizer (tokenizer.json)")
    return tokenizer


def _vocab_size(model: Any) -> int:
    config = getattr(model, "config", None)
    return int(config.vocab_size if config is not None else model.vocab_size)


def end_of_turn_ids(model: Any, chat_template: ChatTemplate | None = None) -> tuple[int, ...]:
    """Every id that ends a reply: the model's EOS ids (`generation_config.json` first), the
    tokenizer's, and the template's end-of-turn token; only ids inside the model's
    vocabulary (it can emit no other)."""
    template = model_template(model) if chat_template is None else chat_template
    tokenizer = _tokenizer(model)
    config = getattr(model, "config", None)
    eos = config.eos_token_id if config is not None else model.eos_token_ids
    ids = [*((eos,) if isinstance(eos, int) else eos or ()), *tokenizer.eos_token_ids]
    end_of_turn = template.end_of_turn_token(tokenizer)
    if end_of_turn is not None:
        ids.append(end_of_turn)
    vocab = _vocab_size(model)
    return tuple(i for i in dict.fromkeys(int(i) for i in ids) if 0 <= i < vocab)


def render_messages(
    model: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: ChatTemplate | None = None,
    where: str = "messages",
    **variables: Any,
) -> str:
    """One conversation rendered with the model's chat template (e.g. a JSONL line's
    `messages`), ready for a reply."""
    template = model_template(model) if chat_template is None else chat_template
    return template.render(
        messages, add_generation_prompt=add_generation_prompt, where=where, **variables
    )


def prompt_ids(
    model: Any,
    messages: Sequence[Mapping[str, Any]],
    **kwargs: Any,
) -> list[int]:
    """The token ids of `render_messages(model, messages, **kwargs)`, tokenized as transformers'
    `apply_chat_template` does: without adding special tokens (the template wrote the BOS)."""
    text = render_messages(model, messages, **kwargs)
    return _tokenizer(model).encode(text, add_special_tokens=False)


def chat_request(
    model: Any,
    messages: Sequence[Mapping[str, Any]],
    knobs: Mapping[str, Any] | None = None,
    *,
    where: str = "messages",
    chat_template: ChatTemplate | None = None,
) -> tuple[list[int], dict[str, Any]]:
    """One conversation as a `generate_many` request: the ids of its rendered prompt, and
    `knobs` (one row's `SamplingParams.create` arguments) with `end_of_turn_ids(model)`
    added to `stop_token_ids`. For many lines, load `model_template(model)` once and pass
    it as `chat_template`."""
    template = model_template(model) if chat_template is None else chat_template
    ids = prompt_ids(model, messages, chat_template=template, where=where)
    knobs = dict(knobs or {})
    stops = knobs.get("stop_token_ids")
    if stops is None:
        stops = []
    elif isinstance(stops, (int, np.integer)):
        stops = [stops]
    elif isinstance(stops, Sequence) and len(stops) == 1 and isinstance(stops[0], Sequence):
        stops = stops[0]  # one list for the one row
    if not isinstance(stops, Sequence):
        raise ValueError(f"{where}: stop_token_ids must be a list of token ids, got {stops!r}")
    ends = end_of_turn_ids(model, template)
    knobs["stop_token_ids"] = [*stops, *(i for i in ends if i not in stops)]
    return ids, knobs


# ------------------------------------------------------------------------ conversations


def chat_params(
    model: Any,
    batch_size: int,
    params: SamplingParams | Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """The params of `batch_size` replies: `params` and `settings` as `ll.generate` reads
    them (`logitloop.decoding.engine.plan.sampling_params`), over the checkpoint's
    `generation_config.json`, over `CHAT_MAX_TOKENS` tokens (`ll.chat`, `ll.stream_chat`,
    `repl` and `logitloop chat` all start from these defaults)."""
    fallback = {"max_tokens": CHAT_MAX_TOKENS}
    return sampling_params(model, batch_size, params, settings or {}, fallback)


def _chat_inputs(
    model,
    conversations,
    params,
    add_generation_prompt: bool = True,
    chat_template: ChatTemplate | None = None,
    template_variables: Mapping[str, Any] | None = None,
    ignore_eos: bool = False,
    settings: Mapping[str, Any] | None = None,
) -> tuple[list[list[int]], SamplingParams]:
    """The conversations' prompt ids, and params (`chat_params`) that stop at the end of a
    turn (unless `ignore_eos`: then neither EOS nor the end-of-turn token stops a row)."""
    if (
        isinstance(conversations, (str, Mapping))
        or not isinstance(conversations, Sequence)
        or not conversations
    ):
        raise ValueError("conversations must be a non-empty list of conversations")
    if any(isinstance(c, Mapping) for c in conversations):
        raise ValueError(
            "conversations is one conversation (a list of messages): pass a list of "
            "conversations, e.g. [messages]"
        )
    template = model_template(model) if chat_template is None else chat_template
    prompts = [
        prompt_ids(
            model,
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            where=f"conversations[{i}]",
            **(template_variables or {}),
        )
        for i, messages in enumerate(conversations)
    ]
    params = chat_params(model, len(prompts), params, settings)
    if ignore_eos:
        return prompts, params
    return prompts, params.with_stop_token_ids(end_of_turn_ids(model, template))


def chat(
    model: Any,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    params: SamplingParams | Mapping[str, Any] | None = None,
    *,
    n: int = 1,
    add_generation_prompt: bool = True,
    chat_template: ChatTemplate | None = None,
    template_variables: Mapping[str, Any] | None = None,
    ignore_eos: bool = False,
    **generate_kwargs: Any,
) -> GenerationResult:
    """Reply to each conversation (a list of `{"role", "content"}` messages).

    Each conversation is rendered with the checkpoint's chat template (or `chat_template`)
    and generated from like any prompt, one row per conversation (`n` replies each,
    prompt-major). `params`: as in `ll.generate` (a `SamplingParams`, a dict of
    `SamplingParams.create` arguments, or those as keywords: `temperature=0.7`), over the
    checkpoint's `generation_config.json`, over `CHAT_MAX_TOKENS` = 256 tokens: the
    defaults of `logitloop chat` too (`chat_params`). Seeds are explicit (default 0).
    Every row also stops at `end_of_turn_ids(model)`. Like `ll.generate`, it returns one
    `GenerationResult` for the batch: `result.text[i]` is row i's reply without the
    end-of-turn token, `result.prompt_token_ids[i]` the rendered conversation.
    `template_variables` reach the template (e.g. `{"enable_thinking": False}`);
    `ignore_eos=True`: neither EOS nor the end-of-turn token stops a row (`max_tokens` and
    the params' own stops do); the other keywords (the shared options) reach `ll.generate`.
    """
    settings = _pop_settings(generate_kwargs)
    prompts, params = _chat_inputs(
        model,
        conversations,
        params,
        add_generation_prompt,
        chat_template,
        template_variables,
        ignore_eos,
        settings,
    )
    return generate(model, prompts, params, n=n, ignore_eos=ignore_eos, **generate_kwargs)


def _pop_settings(keywords: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings among `keywords`, taken out (the rest are options)."""
    return {name: keywords.pop(name) for name in list(keywords) if name in sampling_names()}


def stream_chat(
    model: Any,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    params: SamplingParams | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Iterator[StreamEvent]:
    """`chat` through `ll.stream`: per-row text deltas of the replies as they are generated.

    Takes `chat`'s keyword arguments (`n`, `add_generation_prompt`, `chat_template`,
    `template_variables`, sampling settings) and `stream`'s (`chunk_steps`, ...), with
    `chat`'s defaults. The conversations are rendered and checked when it is called,
    before the first event.
    """
    names = ("add_generation_prompt", "chat_template", "template_variables")
    options = {name: kwargs.pop(name) for name in names if name in kwargs}
    options["ignore_eos"] = kwargs.get("ignore_eos", False)
    options["settings"] = _pop_settings(kwargs)
    prompts, params = _chat_inputs(model, conversations, params, **options)
    return stream(model, prompts, params, **kwargs)


# ------------------------------------------------------------------- interactive loop

PROMPT = "> "
HELP = (
    "/reset starts a new conversation; /exit, Ctrl-D or Ctrl-C at the prompt leave; "
    "Ctrl-C during a reply ends it"
)
INTERRUPTED = " [interrupted]"


def repl(
    model: Any,
    params_kwargs: Mapping[str, Any] | None = None,
    *,
    input: TextIO = sys.stdin,  # noqa: A002 -- the name a caller expects beside output
    output: TextIO = sys.stdout,
    system: str | None = None,
    chat_template: ChatTemplate | None = None,
    checkpoint_defaults: bool = True,
    ignore_eos: bool = False,
    adapters: Any = None,
    adapter: str | None = None,
) -> None:
    """An interactive conversation: read a line, stream the reply, keep the conversation.

    `params_kwargs` are `SamplingParams.create` arguments for one row, over `chat`'s
    defaults (`chat_params`: the checkpoint's `generation_config.json`, else 256 tokens)
    unless `checkpoint_defaults=False` (then over `create`'s); turn t uses seed `seed + t`
    so that replies differ but a session replays exactly. `/reset` forgets the conversation
    (keeping the `system` message); `/exit`, end of input (Ctrl-D) or Ctrl-C
    (KeyboardInterrupt) at the prompt leave. Ctrl-C during a reply ends that reply, which
    stays in the conversation as far as it was shown (what the user saw is what the model is
    told it said), marked `INTERRUPTED` on the screen only. A turn the model cannot take
    (e.g. past its context) prints the error and leaves the conversation as it was.
    `ignore_eos`, `adapters`, `adapter` (every turn under that LoRA adapter): as in `chat`.
    """
    template = model_template(model) if chat_template is None else chat_template
    lora = {} if adapters is None else dict(adapters=adapters, adapter=adapter)
    knobs = dict(params_kwargs or {})
    seed = int(knobs.pop("seed", 0) or 0)
    start = [] if system is None else [{"role": "system", "content": system}]
    messages = list(start)
    turn = 0
    output.write(f"({HELP})\n")
    while True:
        try:
            output.write(PROMPT)
            output.flush()
            line = input.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:
            output.write("\n")
            return
        text = line.rstrip("\r\n")
        command = text.strip()
        if command == "/exit":
            return
        if command == "/reset":
            messages = list(start)
            output.write("(new conversation)\n")
            continue
        if not command:
            continue
        if command.startswith("/"):
            output.write(f"unknown command {command}: {HELP}\n")
            continue
        asked = [*messages, {"role": "user", "content": text}]
        params = {**knobs, "seed": seed + turn}
        try:
            reply = _reply(
                model, asked, params, checkpoint_defaults, ignore_eos, template, output, lora
            )
        except KeyboardInterrupt:  # pressed just as the reply ended: it is not kept
            output.write("\n")
            reply = None
        if reply is not None:
            messages = [*asked, {"role": "assistant", "content": reply}]
            turn += 1


def _reply(
    model, messages, knobs, checkpoint_defaults, ignore_eos, template, output: TextIO, lora
) -> str | None:
    """Stream one reply to `output` (under `lora`: `stream`'s `adapters=`, `adapter=`);
    its text (as far as shown), or None on an error."""
    shown: list[str] = []
    events = None
    try:
        if checkpoint_defaults:
            params = chat_params(model, 1, knobs)
        else:
            params = SamplingParams.create(1, **knobs)
        events = stream_chat(
            model, [messages], params, chat_template=template, ignore_eos=ignore_eos, **lora
        )
        for event in events:
            output.write(event.text)
            output.flush()
            shown.append(event.text)
    except KeyboardInterrupt:
        output.write(INTERRUPTED)
    except ValueError as e:
        output.write(f"error: {e} (/reset starts a new conversation)\n")
        return None
    finally:
        if events is not None:
            events.close()
    output.write("\n")
    return "".join(shown)
