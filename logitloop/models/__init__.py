"""Models for logitloop: Flax NNX implementations, checkpoint loading, tokenizer.

Every model follows the decode-loop protocol: `config`, `tokenizer`,
`init_cache(batch_size, max_length, dtype=None)` and
`__call__(tokens, positions, cache) -> (last-column logits [B, V] float32, cache)`.
"""

from logitloop.models.config import GPT2Config, LlamaConfig, RopeConfig, config_from_hf
from logitloop.models.gpt2 import GPT2Model
from logitloop.models.llama import LlamaModel
from logitloop.models.loading import load_pretrained
from logitloop.models.orbax_io import restore_converted, save_converted
from logitloop.models.tokenizer import Tokenizer

__all__ = [
    "GPT2Config",
    "GPT2Model",
    "LlamaConfig",
    "LlamaModel",
    "RopeConfig",
    "Tokenizer",
    "config_from_hf",
    "load_pretrained",
    "restore_converted",
    "save_converted",
]
