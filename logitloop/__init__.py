"""logitloop: a functional decoding framework for JAX.

import logitloop as ll
params = ll.SamplingParams.create(batch_size=2, temperature=[0.0, 0.8], top_p=0.9, seed=[0, 1])
out = ll.sample(logits, params, positions)
"""

from logitloop.compile_cache import CompileCache, enable_compile_cache
from logitloop.conversation import chat, stream_chat
from logitloop.decoding.engine.batching import Request, generate_many, iter_generate_many
from logitloop.decoding.engine.beam import Beam, beam_search
from logitloop.decoding.engine.check import CheckReport, check_model
from logitloop.decoding.engine.generate import GenerationResult, StreamEvent, generate, stream
from logitloop.decoding.engine.inside import Capture, Steer, logit_lens
from logitloop.decoding.engine.precompile import PrecompileReport, precompile
from logitloop.decoding.engine.score import ScoreResult, score
from logitloop.decoding.engine.trainer import (
    RolloutBatch,
    TokenLogprobs,
    rollout_batch,
    token_logprobs,
)
from logitloop.decoding.loop.decode_loop import DecodeState
from logitloop.decoding.loop.runner import FunctionModel, NNXModel, from_linen, from_nnx
from logitloop.decoding.loop.speculative import DraftModel, PromptLookup
from logitloop.decoding.runtime.compiles import CompileStats, compile_stats
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
from logitloop.models.adapters import Adapters, load_adapter
from logitloop.models.kv import (
    CONTRACT_VERSION,
    KV,
    KVSpec,
    Rows,
    attention,
    dense,
    lm_head,
    mean,
    residual,
)
from logitloop.models.loading import load_pretrained
from logitloop.processors import (
    DRY,
    GreenListScore,
    GreenListWatermark,
    NoRepeatNGram,
    SynthIDScore,
    SynthIDWatermark,
    TypicalP,
    watermark_score,
)

__all__ = [
    "Adapters",
    "Beam",
    "Capture",
    "CheckReport",
    "STATUS_ALL_MASKED",
    "STATUS_BAD_LOGITS",
    "STATUS_OK",
    "DRY",
    "CompileCache",
    "CompileStats",
    "DecodeState",
    "DraftModel",
    "CONTRACT_VERSION",
    "FunctionModel",
    "GreenListScore",
    "GreenListWatermark",
    "KV",
    "KVSpec",
    "NNXModel",
    "GenerationResult",
    "PrecompileReport",
    "History",
    "NoRepeatNGram",
    "Processor",
    "PromptLookup",
    "Rows",
    "Request",
    "SampleOutput",
    "SamplingParams",
    "ScoreResult",
    "Steer",
    "Step",
    "StreamEvent",
    "SynthIDScore",
    "SynthIDWatermark",
    "TokenLogprobs",
    "RolloutBatch",
    "TopLogprobs",
    "TypicalP",
    "attention",
    "beam_search",
    "chat",
    "check_model",
    "compile_stats",
    "enable_compile_cache",
    "dense",
    "from_linen",
    "from_nnx",
    "generate",
    "generate_many",
    "iter_generate_many",
    "lm_head",
    "load_adapter",
    "load_pretrained",
    "logit_lens",
    "mean",
    "precompile",
    "stream",
    "stream_chat",
    "sample",
    "sampling_distribution",
    "score",
    "token_logprobs",
    "watermark_score",
    "rollout_batch",
    "residual",
]
__version__ = "0.1.0"


def _register_lm_eval() -> None:
    """Make `lm_eval.simple_evaluate(model="logitloop")` work after `import logitloop`
    when lm-eval is installed (the `eval` extra): a lazy entry in its model registry, so
    neither lm-eval's backends nor `logitloop.integrations.lm_eval` are imported until
    lm-eval asks for the name. lm-eval fills its built-in names only into an empty registry,
    so they go in first (else `hf` and the rest would be hidden)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        return
    import lm_eval.models  # noqa: F401  (registers the built-in names, lazily)
    from lm_eval.api.registry import model_registry

    if "logitloop" not in model_registry:
        model_registry.register("logitloop", target="logitloop.integrations.lm_eval:LogitloopLM")


_register_lm_eval()
