"""Models for logitloop: Flax NNX implementations, checkpoint loading, tokenizer.

Every model follows the decode-loop protocol: `config`, `tokenizer`,
`init_cache(batch_size, max_length, dtype=None)` and
`__call__(tokens, positions, cache) -> (last-column logits [B, V] float32, cache)`.

Where things live: `decoder.py` is the body every family shares (embedding, blocks,
final norm, LM head on the last column, the cache); `gpt2.py` and `llama.py` fill it in
(`gemma.py`, `phi3.py` and `moe.py` extend the Llama block) and register their
`model_type`s in `registry.py`, which `config_from_hf`,
`load_pretrained` and the Orbax restore consult; `layers.py` holds attention, the KV cache
and the norms; `config.py` the configs and their `config.json` parsers; `hub.py` turns a
Hugging Face Hub name into its folder in the Hugging Face cache.
"""

from logitloop.models import phi3 as _phi3  # noqa: F401  (registers "phi3")
from logitloop.models.config import (
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MoeConfig,
    RopeConfig,
    config_from_hf,
)
from logitloop.models.decoder import DecoderModel
from logitloop.models.gemma import GemmaModel  # registers "gemma2", "gemma3_text", "gemma3"
from logitloop.models.gpt2 import GPT2Model  # registers "gpt2"
from logitloop.models.llama import LlamaModel  # registers "llama", "mistral", "qwen2", "qwen3"
from logitloop.models.loading import load_pretrained
from logitloop.models.moe import MoeModel  # registers "mixtral", "qwen3_moe"
from logitloop.models.orbax_io import restore_converted, save_converted
from logitloop.models.registry import ModelFamily, family_for, register
from logitloop.models.tokenizer import Tokenizer

__all__ = [
    "DecoderModel",
    "GemmaConfig",
    "GemmaModel",
    "GPT2Config",
    "GPT2Model",
    "LlamaConfig",
    "LlamaModel",
    "MoeConfig",
    "MoeModel",
    "ModelFamily",
    "RopeConfig",
    "Tokenizer",
    "config_from_hf",
    "family_for",
    "load_pretrained",
    "register",
    "restore_converted",
    "save_converted",
]
