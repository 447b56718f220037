"""logitloop as tunix's rollout engine for a LoRA policy (`logitloop.integrations.tunix`,
docs/rl.md "tunix"): tunix's Llama 3 of the shipped checkpoint under qwix's
`LoraProvider` is the policy, the shipped logitloop model decodes it with the policy's
LoRA state in an adapter table. Each rollout equals `ll.generate` with the state loaded
by `ll.load_adapter` (tokens, and the engine's log-probs bit for bit its `raw_logprobs`,
`deterministic=True`), and a weight sync with new LoRA values compiles nothing, then or
in the next rollout. `-m slow` (the deterministic rollout and scorer compile on the
shipped model)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip(
    "tunix", reason="the tunix adapter's tests need the optional extra: pip install 'logitloop[rl]'"
)
pytest.importorskip("torch")

from flax import nnx  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

import logitloop as ll  # noqa: E402
from logitloop.decoding.runtime.compiles import CompileWatch  # noqa: E402
from logitloop.integrations import tunix as ll_tunix  # noqa: E402
from logitloop.models.loading import SHIPPED_MODEL_DIR  # noqa: E402
from tests.lora.tunix_policy import ALPHA, lora_policy, randomize  # noqa: E402

PROMPTS = ["def f(x):", "import", "The for statement"]
CONFIG = base_rollout.RolloutConfig(max_tokens_to_generate=5, temperature=0, max_prompt_length=8)


def _reference(engine, model, state, out):
    """`ll.generate` of the engine's prompts under `state` loaded by `ll.load_adapter`."""
    # The engine's table shape (one slot of the state's largest rank, 8): the stacked
    # products' sums run over every slot's columns, so a row's bits depend on it.
    table = ll.load_adapter(model, state, name="policy", alpha=ALPHA, max_adapters=1, max_rank=8)
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    params = ll_tunix.sampling_params(CONFIG, [0] * len(ids))
    want = ll.generate(model, ids, params, deterministic=True, adapters=table, adapter="policy")
    assert [list(t) for t in out.tokens] == [list(t) for t in want.token_ids]
    for got, raw in zip(out.logprobs, want.raw_logprobs, strict=True):
        assert np.array_equal(np.asarray(got, np.float32), np.asarray(raw, np.float32))


@pytest.mark.slow
def test_lora_policy_rollout_equals_generate_under_its_adapter_and_syncs_compile_nothing():
    import transformers

    model = ll.load_pretrained()
    hf_config = transformers.AutoConfig.from_pretrained(SHIPPED_MODEL_DIR)
    policy, state = lora_policy(SHIPPED_MODEL_DIR, hf_config, seed=7)
    with pytest.raises(ValueError, match="pass model= .* and lora_alpha="):
        ll_tunix.LogitloopRollout(policy, rollout_config=CONFIG)
    engine = ll_tunix.LogitloopRollout(
        policy, ll_tunix.TunixTokenizer(model.tokenizer), rollout_config=CONFIG,
        model=model, lora_alpha=ALPHA,
    )  # fmt: skip
    assert engine.model() is model  # not the trainer's weights: tunix syncs them
    first = engine.generate(PROMPTS, CONFIG)
    _reference(engine, model, state, first)
    base = ll.generate(model, [model.tokenizer.encode(p) for p in PROMPTS], temperature=0,
                       max_new_tokens=5, deterministic=True)  # fmt: skip
    assert [list(t) for t in first.tokens] != [list(t) for t in base.token_ids]

    new = randomize(policy, seed=8)  # the trainer's step, LoRA values only
    with CompileWatch() as watch:
        engine.update_params(nnx.state(policy, nnx.LoRAParam), (nnx.LoRAParam,))
        second = engine.generate(PROMPTS, CONFIG)
    assert watch.count == 0
    assert [list(t) for t in second.tokens] != [list(t) for t in first.tokens]
    _reference(engine, model, new, second)


def test_model_and_lora_alpha_without_a_lora_policy_are_refused():
    model = ll.load_pretrained()
    with pytest.raises(ValueError, match="model= and lora_alpha= go with a LoRA policy"):
        ll_tunix.LogitloopRollout(model, rollout_config=CONFIG, lora_alpha=ALPHA)
