"""Qwix / tunix LoRA states as adapters (issue 71): the LoRA state of a tunix Llama 3
under qwix's `LoraProvider` (a rank per rule), loaded with `ll.load_adapter(model, state,
alpha=)` into the table beside PEFT's adapters, decodes as tunix's own forward of that
policy (qwix's products, `alpha / rank`) in a batch beside PEFT and base rows; so does a
tunix Gemma 2's, whose attention is fused einsums (`qkv_einsum`, or `q_einsum` and
`kv_einsum`); bad states are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tunix", reason="a tunix LoRA policy needs the extra `rl` (google-tunix)")
pytest.importorskip("qwix", reason="a tunix LoRA policy needs qwix")

import logitloop as ll  # noqa: E402
from tests.models.tiny_checkpoints import build_hf_model, random_prompts, save_hf_model  # noqa: E402

from .peft_adapters import torch_greedy  # noqa: E402
from .tunix_policy import ALPHA, gemma_lora_policy, lora_policy, tunix_greedy  # noqa: E402

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


# (transformers case, key/value heads of 4 query heads): with 4, tunix fuses q, k and v
# in one einsum; with 2, q is apart and k and v fused. The checkpoints are made as
# tunix's Gemma runs (`gemma_lora_policy`).
GEMMAS = {
    "gemma2_qkv_einsum": ("gemma2", 4),
    "gemma2_q_kv_einsum": ("gemma2", 2),
    "gemma3_q_kv_einsum": ("gemma3_text", 2),
}
AS_TUNIX = {
    "gemma2": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "gemma3_text": dict(sliding_window_pattern=6),
}


@pytest.fixture(
    scope="module",
    params=[pytest.param(k, marks=[pytest.mark.slow] if i else []) for i, k in enumerate(GEMMAS)],
)
def gemma(request, tmp_path_factory):
    """`(transformers Gemma, logitloop's, the tunix LoRA policy of it, its LoRA state)`
    of a tiny Gemma 2 or 3 (`GEMMAS`)."""
    pytest.importorskip("torch")
    case, kv_heads = GEMMAS[request.param]
    if case == "gemma3_text":
        pytest.importorskip("einops", reason="tunix 0.1.7's Gemma 3 imports einops undeclared")
    hf = build_hf_model(
        case,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=True,
        query_pre_attn_scalar=16,  # head_dim
        **AS_TUNIX[case],
    )
    folder = save_hf_model(hf, tmp_path_factory.mktemp("gemma") / "base")
    policy, state = gemma_lora_policy(folder, hf.config, seed=5)
    return hf, ll.load_pretrained(str(folder)), policy, state


def test_qwix_gemma_einsums_decode_as_the_tunix_policy(gemma):
    hf, model, policy, state = gemma
    table = ll.load_adapter(model, state, name="g", alpha=ALPHA)
    prompts = random_prompts(160, [6, 4], 7)
    greedy = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    out = ll.generate(model, prompts, adapters=table, adapter=["g", None], **greedy)
    tokens, logprobs = tunix_greedy(policy, prompts[0], TOKENS)
    assert out.token_ids[0] == tokens
    np.testing.assert_allclose(out.raw_logprobs[0], logprobs, rtol=0, atol=ATOL)
    assert out.token_ids[1] == torch_greedy(hf, prompts[1], TOKENS)[0]  # the base row


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

    def lora(module, a, b):  # a state of one module of layer 0
        return {"layers": {0: {"attn": {module: {"w_lora_a": np.ones(a), "w_lora_b": np.ones(b)}}}}}

    for name in ("gating_einsum", "k_einsum"):  # no module of tunix's Gemma 2 / 3
        with pytest.raises(ValueError, match=f"targets module '{name}' of layer 0"):
            ll.load_adapter(model, lora(name, (64, 4), (4, 2, 16)), name="g", alpha=ALPHA)
    with pytest.raises(ValueError, match=r"kv_einsum: lora_b \(4, 3, 2, 16\) is not \[rank, 2,"):
        ll.load_adapter(model, lora("kv_einsum", (64, 4), (4, 3, 2, 16)), name="g", alpha=ALPHA)
    with pytest.raises(ValueError, match="do not share a rank"):  # a batch axis first
        ll.load_adapter(model, lora("q_proj", (2, 64, 4), (2, 4, 64)), name="g", alpha=ALPHA)
    twice = lora("q_einsum", (64, 4), (4, 4, 16))
    twice["layers"][0]["attn"]["q_proj"] = twice["layers"][0]["attn"]["q_einsum"]
    with pytest.raises(ValueError, match="layer 0's q_proj is targeted twice"):
        ll.load_adapter(model, twice, name="g", alpha=ALPHA)
    one_sided = {"layers": {0: {"attn": {"q_proj": {"w_lora_a": np.ones((64, 4))}}}}}
    with pytest.raises(ValueError, match="q_proj has only its lora_a"):
        ll.load_adapter(model, one_sided, name="g", alpha=ALPHA)
