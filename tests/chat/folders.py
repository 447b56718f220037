"""Checkpoint folders for the chat tests: a small byte-level BPE with the control tokens of
the common chat formats, and chat templates written in the styles of those families."""

from __future__ import annotations

import json
from pathlib import Path

CONTROL_TOKENS = [
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
]

CORPUS = [
    "You are a helpful assistant. What does a with statement do?",
    "The with statement wraps a block in a context manager's enter and exit methods.",
    'system user assistant model tool: naïve café, 日本語, 🙂 and {"json": [1, 2]}',
    "Cutting Knowledge Date: December 2023\nToday Date: 2026\n\n",
]

# Header per turn, a system prompt (default or the first message), the BOS written by the
# template; whitespace control with "-" everywhere, as Meta's template does.
LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "You are a helpful assistant." %}\n'
    "{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + strftime_now("%Y") + "\\n\\n" }}\n'
    '{{- system_message }}\n{{- "<|eot_id|>" }}\n'
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# ChatML (Qwen), written with plain {% %} tags over indented lines: its output depends on
# trim_blocks and lstrip_blocks.
CHATML = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# Gemma: no system role, strictly alternating user/model turns, both refused with
# raise_exception.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# tojson (non-ASCII, HTML characters, key order, indent) and loop controls (continue,
# break, loop.last / loop.length), a namespace and a {% generation %} block.
TOOLS = """{%- set ns = namespace(count=0) -%}
{{- eos_token if tools is none else tools | tojson -}}
{%- for message in messages -%}
{%- if message.role == 'system' %}{% continue %}{% endif -%}
{%- set ns.count = ns.count + 1 -%}
<|im_start|>{{ message.role }} {{ message | tojson }}
{%- if message.role == 'assistant' -%}
{% generation %}{{ message.content }}{% endgeneration %}
{%- endif -%}
{%- if message.meta is defined %}{{ message.meta | tojson(indent=2) }}{% endif -%}
{%- if message.content == 'STOP' %}{% break %}{% endif -%}
{%- if loop.last %} [{{ ns.count }} of {{ loop.length }}]{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


def chat_tokenizer(bos: str | None = None):
    """A byte-level BPE over `CORPUS` whose first ids are `CONTROL_TOKENS` (special); with
    `bos`, its post-processor adds that token in front, as Llama's and Gemma's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos is not None:
        bos_id = CONTROL_TOKENS.index(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


def write_folder(
    folder: Path,
    *,
    template: str | list | None,
    template_file: bool = False,
    bos: str | None = None,
    eos: str = "<|endoftext|>",
    **config,
) -> Path:
    """tokenizer.json and tokenizer_config.json in `folder`; the template goes in the config
    (`chat_template`), or in chat_template.jinja with `template_file`."""
    folder.mkdir(parents=True, exist_ok=True)
    chat_tokenizer(bos).save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": "<|endoftext|>",
        **config,
    }
    if template is not None and template_file:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif template is not None:
        tokenizer_config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return folder
