"""The lm-eval backend's `pretrained=` (with `revision=`) and a Ray job's actor take a model by
its Hugging Face Hub name, against the fake Hub (`tests/models/fake_hub.py`): each loads the
snapshot of the shipped model. Built in process, evaluating and generating nothing (the
model is the folder's: tests/models/test_hub.py)."""

from __future__ import annotations

import pytest

from logitloop.integrations.ray import Generator
from tests.models.fake_hub import TINY, serving


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with serving(monkeypatch, tmp_path) as fake:
        yield fake


def test_lm_eval_pretrained_by_name_and_revision(hub):
    pytest.importorskip("lm_eval", reason="the lm-eval backend needs the eval extra (lm-eval)")
    from lm_eval.api.registry import get_model

    import logitloop  # noqa: F401 (registers the backend)

    args = f"pretrained={TINY},revision={hub.tiny},compile_cache=false"
    lm = get_model("logitloop").create_from_arg_string(args)
    snapshot = hub.cache / "models--org--tiny" / "snapshots" / hub.tiny
    assert lm.model.checkpoint_dir == snapshot
    assert lm.tok_encode("The for statement") == lm.model.tokenizer.encode("The for statement")
    with pytest.raises(ValueError, match="pretrained='org/tiny' does not load: .*'v9'"):
        get_model("logitloop").create_from_arg_string(f"pretrained={TINY},revision=v9")


def test_a_ray_actor_loads_a_name(hub):
    from logitloop.models.loading import SHIPPED_MODEL_DIR

    hub.add_folder(TINY, SHIPPED_MODEL_DIR, skip=("generation_config.json",))  # main moves
    actor = Generator(TINY, revision=hub.tiny, compile_cache=False)  # the first commit
    assert actor.model.checkpoint_dir == hub.cache / "models--org--tiny" / "snapshots" / hub.tiny
    with pytest.raises(ValueError, match="cannot load the model: model 'org/missing'"):
        Generator("org/missing", compile_cache=False)
