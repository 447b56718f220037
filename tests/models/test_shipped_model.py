"""The model that ships inside the package: a standard checkpoint folder that works offline."""

from __future__ import annotations

import json

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


def test_loads_and_generates_text(shipped):
    assert shipped.tokenizer is not None
    params = ll.SamplingParams.create(batch_size=2, temperature=[0.0, 0.8], max_tokens=24, seed=1)
    res = ll.generate(shipped, ["The for statement", "A dictionary"], params)
    for text in res.text:
        words = text.split()
        assert len(words) >= 5
        # Python-documentation English: most words are in the tokenizer's training text.
        import pydoc_data.topics

        corpus = " ".join(pydoc_data.topics.topics.values())
        known = sum(w.strip('.,:;()"') in corpus for w in words)
        assert known / len(words) > 0.7, text


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
