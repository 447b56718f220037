"""Processors that ship with logitloop: per-row logit transforms for `processors=[...]`.

Each is a `flax.struct.dataclass` whose per-row settings are [B] leaves (changing a value
never recompiles), built and validated by its `create(batch_size, ...)`, and off per row
when its value says so (the row's logits pass through bit-identical):

- `NoRepeatNGram(size)`: ban a token that would repeat an n-gram already in the row (0 = off).
- `DRY(multiplier, base, allowed_length, penalty_range, sequence_breakers)`: the "Don't
  Repeat Yourself" penalty of text-generation-webui and llama.cpp (multiplier 0 = off).
- `TypicalP(mass)`: locally typical sampling, after temperature and the filters (mass 1 = off).
- `GreenListWatermark(key, gamma, delta, seeding, context_width)`: Kirchenbauer et al.'s
  watermark, and `SynthIDWatermark(keys, ngram_len, ...)`: SynthID Text, both as
  transformers computes them, after temperature and the top-k/top-p/min-p filters
  (key None = off); `watermark_score`
  detects either (`logitloop.processors.watermark`).
"""

from logitloop.processors.dry import DRY
from logitloop.processors.no_repeat_ngram import NoRepeatNGram
from logitloop.processors.typical import TypicalP
from logitloop.processors.watermark.detect import GreenListScore, SynthIDScore, watermark_score
from logitloop.processors.watermark.green_list import GreenListWatermark
from logitloop.processors.watermark.synthid import SynthIDWatermark

__all__ = [
    "DRY",
    "GreenListScore",
    "GreenListWatermark",
    "NoRepeatNGram",
    "SynthIDScore",
    "SynthIDWatermark",
    "TypicalP",
    "watermark_score",
]
