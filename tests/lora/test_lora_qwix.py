"""Qwix / tunix LoRA states as adapters (issue 71): the LoRA state of a tunix Llama 3
under qwix's `LoraProvider` (a rank per rule), loaded with `ll.load_adapter(model, state,
alpha=)` into the table beside PEFT's adapters, decodes as tunix's own forward of that
policy (qwix's products, `alpha / rank`) in a batch beside PEFT and base rows; bad states
are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tunix", reason="a tunix LoRA policy needs the extra `rl` (google-tunix)")
pytest.importorskip("qwix", reason="a tunix LoRA policy needs qwix")

import logitloop as ll  # noqa: E402
from tests.models.tiny_checkpoints import random_prompts  # noqa: E402

from .peft_adapters import torch_greedy  # noqa: E402
from .tunix_policy import ALPHA, lora_policy, tunix_greedy  # noqa: E402

TOKENS = 4
ATOL = 1e-4  # the float32 parity tests' tolerance


@pytest.fixture(scope="module")
def policy(setup):
    """`(tunix LoRA policy of the shared checkpoint, its LoRA state, its RoPE theta)`."""
    config = setup["merged"][None].config
    lora_model, state = lora_policy(setup["dir"] / "base", config, seed=3)
    return lora_model, state, config.rope_parameters["rope_theta"]


def test_qwix_state_decodes_as_the_tunix_policy_beside_peft_rows(setup, policy):
    lora_model, state, theta = policy
    model = setup["model"]
    table = ll.load_adapter(model, state, name="q", adapters=setup["table"], alpha=ALPHA)
    prompts = random_prompts(160, [5, 7, 4], 21)
    greedy = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    out = ll.generate(model, prompts, adapters=table, adapter=["q", None, "a"], **greedy)
    tokens, logprobs = tunix_greedy(lora_model, prompts[0], TOKENS, theta)
    assert out.token_ids[0] == tokens
    np.testing.assert_allclose(out.raw_logprobs[0], logprobs, rtol=0, atol=ATOL)
    for row, name in ((1, None), (2, "a")):  # the rows beside it: the merged models'
        assert out.token_ids[row] == torch_greedy(setup["merged"][name], prompts[row], TOKENS)[0]


def test_qwix_state_refused_by_name(setup, policy):
    _, state, _ = policy
    model = setup["model"]
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        ll.load_adapter(model, state, name="q")
    with pytest.raises(ValueError, match="config= goes with PEFT tensors"):
        ll.load_adapter(model, state, name="q", alpha=ALPHA, config={"r": 4})
    peft = {"layers.0.self_attn.q_proj.lora_A.weight": np.ones((4, 64))}
    with pytest.raises(ValueError, match="alpha= goes with a Qwix LoRA state"):
        ll.load_adapter(model, peft, name="a", alpha=ALPHA, config={"r": 4, "lora_alpha": 8})
    with pytest.raises(ValueError, match="max_rank=4"):  # the MLP's rank 8
        ll.load_adapter(model, state, name="q", alpha=ALPHA, max_rank=4)
    fused = {"layers": {0: {"attn": {"kv_einsum": {
        "w_lora_a": np.ones((64, 4)), "w_lora_b": np.ones((4, 2, 2, 16))}}}}}  # fmt: skip
    with pytest.raises(ValueError, match="targets module 'kv_einsum' of layer 0"):
        ll.load_adapter(model, fused, name="g", alpha=ALPHA)
    one_sided = {"layers": {0: {"attn": {"q_proj": {"w_lora_a": np.ones((64, 4))}}}}}
    with pytest.raises(ValueError, match="q_proj has only its lora_a"):
        ll.load_adapter(model, one_sided, name="g", alpha=ALPHA)
