"""The LoRA tests' shared setup: the tiny Llama with two PEFT adapters (`setup`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def setup(tmp_path_factory):
    """The tiny Llama (transformers and logitloop), adapters "a" (rank 8) and "b" (rank
    16, rsLoRA) saved by PEFT, their merged transformers models, and a table of both."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    import logitloop as ll
    from tests.models.tiny_checkpoints import build_hf_model, save_hf_model

    from .peft_adapters import make_adapter

    d = tmp_path_factory.mktemp("lora")
    base = build_hf_model("llama")
    save_hf_model(base, d / "base")
    merged = {
        "a": make_adapter(base, d / "a", rank=8, alpha=16, seed=1),
        "b": make_adapter(base, d / "b", rank=16, alpha=8, seed=2, use_rslora=True),
        None: base,
    }
    model = ll.load_pretrained(str(d / "base"))
    table = ll.load_adapter(model, d / "a", name="a")
    table = ll.load_adapter(model, d / "b", name="b", adapters=table)
    return dict(dir=d, model=model, table=table, merged=merged)
