"""The tiny Llama both inside test modules run (`setup`)."""

from __future__ import annotations

import pytest

import logitloop as ll
from tests.models.tiny_checkpoints import build_hf_model, save_hf_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny Llama (2 layers), in transformers and logitloop."""
    d = tmp_path_factory.mktemp("inside")
    hf = build_hf_model("llama")
    save_hf_model(hf, d)
    return dict(hf=hf, model=ll.load_pretrained(str(d)))
