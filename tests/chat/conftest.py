"""Models for the chat tests.

- `chat_folder` / `chat_model`: a tiny Llama checkpoint folder (random weights written
  straight to safetensors: nothing is initialised or compiled) with a Llama-3-style chat
  template (`<|eot_id|>` ends a turn) and a generation_config.json with sampling defaults.
- `scripted_chat`: a `FunctionModel` with the same tokenizer and a ChatML template whose
  greedy reply to any prompt is `reply_ids`, then `<|im_end|>`, then `reply_ids` again...
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import logitloop as ll
from logitloop.conversation import ChatTemplate
from logitloop.models import LlamaConfig, Tokenizer
from logitloop.models.export import hf_config
from logitloop.models.llama import checkpoint_tensors

from .folders import CHATML, CONTROL_TOKENS, LLAMA3, write_folder

EOT = CONTROL_TOKENS.index("<|eot_id|>")  # the Llama-3-style template ends a turn with it
IM_END = CONTROL_TOKENS.index("<|im_end|>")  # and ChatML with this
GENERATION_CONFIG = {
    "eos_token_id": [0, 3],  # <|endoftext|> and <|end_header_id|>
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.9,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 24,
    "max_length": 256,
}


def _tokenizer_vocab(folder) -> dict[str, int]:
    return json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]


@pytest.fixture(scope="session")
def chat_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_model")
    write_folder(folder, template=LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>")
    config = LlamaConfig(
        vocab_size=len(_tokenizer_vocab(folder)),
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    rng = np.random.default_rng(0)
    tensors = {
        name: rng.normal(size=spec.shape).astype(np.float32)
        for name, spec in checkpoint_tensors(config).items()
    }
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config(config)))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder


@pytest.fixture(scope="session")
def chat_model(chat_folder):
    return ll.load_pretrained(chat_folder)


def _next_token(successor, tokens, positions, cache):
    """Logits that pick `successor[last token]`, whatever came before."""
    vocab = successor.shape[0]
    return 10.0 * jax.nn.one_hot(successor[tokens[:, -1]], vocab), cache  # [B, V]


def _no_cache(batch_size, max_length):
    return jnp.zeros((batch_size,), jnp.int32)


@dataclasses.dataclass(frozen=True)
class Scripted:
    model: ll.FunctionModel
    template: ChatTemplate
    reply_ids: list[int]  # the tokens of one reply, before its end-of-turn token
    tokenizer_json: str


@pytest.fixture(scope="session")
def scripted_chat(tmp_path_factory):
    folder = write_folder(tmp_path_factory.mktemp("scripted"), template=CHATML)
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    # The next token is the successor of the last one in the cycle reply -> <|im_end|> ->
    # reply; any other token is followed by the reply's first. The reply's tokens are
    # words (each a whole one, so every stream delta holds text); every ChatML prompt ends
    # with "\n", not a word.
    words = [i for i in range(300, tokenizer.vocab_size) if tokenizer.token_bytes(i).isalpha()]
    reply = words[:12]
    cycle = [*reply, IM_END]
    successor = np.full(tokenizer.vocab_size, cycle[0], np.int64)
    successor[cycle] = cycle[1:] + cycle[:1]
    model = ll.FunctionModel(
        apply_fn=_next_token,
        params=jnp.asarray(successor, jnp.int32),
        init_cache=_no_cache,
        vocab_size=tokenizer.vocab_size,
        max_length=512,
        eos_token_ids=(0,),
        tokenizer=tokenizer,
    )
    return Scripted(
        model=model,
        template=ChatTemplate.from_folder(folder),
        reply_ids=reply,
        tokenizer_json=str(folder / "tokenizer.json"),
    )
