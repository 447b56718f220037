"""The model that ships inside the package: a standard checkpoint folder that works offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll
from logitloop.models.loading import SHIPPED_MODEL_DIR


@pytest.fixture(scope="module")
def shipped():
    return ll.load_pretrained()


def test_folder_is_a_small_standard_checkpoint():
    names = {p.name for p in SHIPPED_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert sum(p.stat().st_size for p in SHIPPED_MODEL_DIR.iterdir()) <= 10 * 2**20
    assert json.loads((SHIPPED_MODEL_DIR / "config.json").read_text())["model_type"] == "llama"


def guide_greedy_sample() -> tuple[str, int, str]:
    """(prompt, max_tokens, continuation) of the greedy sample of the shipped model in
    docs/models.md: the command quoted in the line that introduces it, and the text block
    after it."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    m = re.search(
        r'A greedy sample, `logitloop generate "([^"]+)" --temperature 0 --max-tokens (\d+)`'
        r".*?```text\n(.*?)\n```",
        guide,
        re.S,
    )
    assert m is not None, "docs/models.md no longer shows the shipped model's greedy sample"
    return m.group(1), int(m.group(2)), m.group(3)


def test_greedy_sample_is_the_guide_s(shipped):
    prompt, max_tokens, continuation = guide_greedy_sample()
    params = ll.SamplingParams.create(batch_size=1, temperature=0.0, max_tokens=max_tokens)
    res = ll.generate(shipped, [prompt], params)
    assert res.num_tokens == [max_tokens]
    assert res.text[0] == continuation


def test_transformers_loads_the_same_folder(shipped):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL_DIR, dtype=torch.float32)
    ids = shipped.tokenizer.encode("The for statement is used to iterate")
    cache = shipped.init_cache(1, 32)
    ours, _ = shipped(jnp.asarray([ids]), jnp.arange(len(ids))[None], cache)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1].float().numpy()
    # The checkpoint is bfloat16; both compute in bfloat16 here, so compare loosely.
    np.testing.assert_allclose(np.asarray(ours[0]), ref, atol=0.15)
    assert int(np.argmax(ours[0])) == int(np.argmax(ref))
