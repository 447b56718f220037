"""logitloop: a functional decoding framework for JAX.

import logitloop as ll
params = ll.SamplingParams.create(batch_size=2, temperature=[0.0, 0.8], top_p=0.9, seed=[0, 1])
out = ll.sample(logits, params, positions)
"""

from logitloop.compile_cache import CompileCache, enable_compile_cache
from logitloop.conversation import chat, stream_chat
from logitloop.decoding.engine.batching import Request, generate_many, iter_generate_many
from logitloop.decoding.engine.beam import Beam, beam_search
from logitloop.decoding.engine.generate import GenerationResult, StreamEvent, generate, stream
from logitloop.decoding.engine.score import ScoreResult, score
from logitloop.decoding.engine.trainer import TokenLogprobs, token_logprobs
from logitloop.decoding.loop.decode_loop import DecodeState
from logitloop.decoding.loop.runner import FunctionModel
from logitloop.decoding.loop.speculative import DraftModel, PromptLookup
from logitloop.decoding.sampling.history import History
from logitloop.decoding.sampling.params import SamplingParams
from logitloop.decoding.sampling.processors import Processor, Step
from logitloop.decoding.sampling.sampler import (
    STATUS_ALL_MASKED,
    STATUS_BAD_LOGITS,
    STATUS_OK,
    SampleOutput,
    TopLogprobs,
    sample,
    sampling_distribution,
)
from logitloop.models.loading import load_pretrained
from logitloop.processors import DRY, NoRepeatNGram, TypicalP

__all__ = [
    "Beam",
    "STATUS_ALL_MASKED",
    "STATUS_BAD_LOGITS",
    "STATUS_OK",
    "DRY",
    "CompileCache",
    "DecodeState",
    "DraftModel",
    "FunctionModel",
    "GenerationResult",
    "History",
    "NoRepeatNGram",
    "Processor",
    "PromptLookup",
    "Request",
    "SampleOutput",
    "SamplingParams",
    "ScoreResult",
    "Step",
    "StreamEvent",
    "TokenLogprobs",
    "TopLogprobs",
    "TypicalP",
    "beam_search",
    "chat",
    "enable_compile_cache",
    "generate",
    "generate_many",
    "iter_generate_many",
    "load_pretrained",
    "stream",
    "stream_chat",
    "sample",
    "sampling_distribution",
    "score",
    "token_logprobs",
]
__version__ = "0.1.0"
