"""Models by their Hugging Face Hub name (`logitloop.models.hub`): `huggingface_hub` itself
downloads from a fake Hub on 127.0.0.1 (`tests/models/fake_hub.py`) into a real cache
(`models--org--name/refs/main`, `snapshots/<commit>/`), and a name loads what the same
checkpoint's folder loads, online and offline, at a branch and at a commit hash. Each bad
input is refused with a message naming the repo and what is missing, before any weights or
code are fetched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from huggingface_hub import constants
from safetensors.numpy import load_file, save

import logitloop as ll
from logitloop.models.hub import model_folder
from logitloop.models.loading import SHIPPED_MODEL_DIR
from tests.models.fake_hub import TINY, offline, serving
from tests.models.test_shipped_model import guide_greedy_sample

METADATA = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with serving(monkeypatch, tmp_path) as fake:
        yield fake


@pytest.fixture(scope="module")
def folder_model():
    return ll.load_pretrained(SHIPPED_MODEL_DIR)


def assert_same_model(model, folder_model) -> None:
    """The shipped folder's weights, bit for bit, and its tokenizer."""
    ours, want = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (model, folder_model))
    for a, b in zip(ours, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = "The for statement is used to iterate"
    assert model.tokenizer.encode(text) == folder_model.tokenizer.encode(text)


def _snapshot_files(hub, repo: str, commit: str) -> set[str]:
    folder = hub.cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_a_name_loads_what_its_folder_loads(hub, monkeypatch, folder_model):
    """Online at main (downloaded), then offline at main and at the commit hash, while main
    has moved on: each the shipped folder's model, offline without a request. The greedy
    sample is the guide's (docs/models.md), which `test_shipped_model` pins as the folder's
    (one generation: each new model object compiles its programs)."""
    model = ll.load_pretrained(TINY, revision="main")
    prompt, max_tokens, continuation = guide_greedy_sample()
    params = ll.SamplingParams.create(batch_size=1, temperature=0.0, max_tokens=max_tokens)
    assert ll.generate(model, [prompt], params).text == [continuation]
    assert_same_model(model, folder_model)
    repo_dir = hub.cache / "models--org--tiny"
    assert (repo_dir / "refs" / "main").read_text() == hub.tiny
    assert model.checkpoint_dir == repo_dir / "snapshots" / hub.tiny
    # what the loader reads, not the training report beside it
    assert _snapshot_files(hub, TINY, hub.tiny) == METADATA | {"model.safetensors"}

    first = hub.tiny
    hub.add_folder(TINY, SHIPPED_MODEL_DIR, skip=("generation_config.json",))  # main moves
    offline(monkeypatch)
    before = len(hub.requests)
    assert_same_model(ll.load_pretrained(TINY), folder_model)  # the cached main
    at_commit = ll.load_pretrained(TINY, revision=first)
    assert at_commit.checkpoint_dir.name == first
    assert_same_model(at_commit, folder_model)
    assert hub.requests[before:] == []


def test_a_commit_hash_online_is_that_commit(hub):
    first = hub.tiny
    second = hub.add_folder(TINY, SHIPPED_MODEL_DIR, skip=("generation_config.json",))
    assert model_folder(TINY, revision=first).name == first
    assert model_folder(TINY).name == second
    assert "generation_config.json" not in _snapshot_files(hub, TINY, second)


def test_a_sharded_repo_gets_its_index_and_shards_only(hub, folder_model):
    """Shards of the shipped weights beside files the loader never reads: pickles, a GGUF,
    a consolidated copy, code. The model is the folder's, tensor for tensor."""
    tensors = load_file(SHIPPED_MODEL_DIR / "model.safetensors")
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    files = {n: (SHIPPED_MODEL_DIR / n).read_bytes() for n in METADATA}
    files |= {shard: save({k: tensors[k] for k in keys}) for shard, keys in halves.items()}
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    files["model.safetensors.index.json"] = json.dumps({"weight_map": weight_map}).encode()
    junk = {"pytorch_model.bin", "model.gguf", "consolidated.safetensors", "modeling_x.py"}
    files |= {n: b"never fetched" for n in junk}
    commit = hub.add_commit("org/sharded", files)

    model = ll.load_pretrained("org/sharded")
    assert _snapshot_files(hub, "org/sharded", commit) == set(files) - junk
    assert_same_model(model, folder_model)


def _dead_endpoint(monkeypatch) -> None:
    """The Hub unreachable: its address a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )


def test_network_down_loads_from_the_cache(hub, monkeypatch):
    folder = model_folder(TINY)
    _dead_endpoint(monkeypatch)
    assert model_folder(TINY) == folder
    with pytest.raises(FileNotFoundError) as e:
        model_folder("org/other")
    message = str(e.value)
    assert "model 'org/other' (revision 'main')" in message
    assert "the Hub could not be reached" in message
    assert f"the Hugging Face cache {hub.cache} lacks it" in message


def test_offline_and_not_cached_says_how_to_download(hub, monkeypatch):
    model_folder(TINY)  # main is cached, v2 is not
    offline(monkeypatch)
    before = len(hub.requests)
    with pytest.raises(FileNotFoundError) as e:
        ll.load_pretrained(TINY, revision="v2")
    assert str(e.value) == (
        f"model 'org/tiny' (revision 'v2') is not a local folder, and the Hugging Face "
        f"cache {hub.cache} lacks it; HF_HUB_OFFLINE is set. Download it once with the "
        "network (without HF_HUB_OFFLINE), e.g. `hf download org/tiny --revision v2`"
    )
    assert hub.requests[before:] == []


@pytest.mark.parametrize(
    "removed, lacks",
    [("model.safetensors", "its weights (model.safetensors)"), ("tokenizer.json", "some of")],
)
def test_offline_with_files_missing_from_the_cache(hub, monkeypatch, removed, lacks):
    (model_folder(TINY) / removed).unlink()
    offline(monkeypatch)
    with pytest.raises(FileNotFoundError) as e:
        model_folder(TINY)
    assert f"the Hugging Face cache {hub.cache} lacks {lacks}" in str(e.value)


def test_gated_repo_needs_a_token(hub, tmp_path, monkeypatch):
    hub.add_folder("org/gated", SHIPPED_MODEL_DIR)
    hub.gate("org/gated", "hf_right")
    with pytest.raises(PermissionError) as e:
        model_folder("org/gated")
    assert str(e.value) == (
        "model 'org/gated' (revision 'main'): the repo is gated, and without a token it "
        "cannot be read: accept its terms on its Hub page, then log in (`hf auth login`), "
        "set HF_TOKEN or pass token="
    )
    with pytest.raises(PermissionError, match="gated, and with the token given it cannot"):
        model_folder("org/gated", token="hf_wrong")
    assert model_folder("org/gated", token="hf_right").is_dir()
    saved = tmp_path / "saved-token"  # `hf auth login` writes it
    saved.write_text("hf_right")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(saved))
    assert model_folder("org/gated").is_dir()


def _weights_fetched(hub, repo: str) -> list[str]:
    return [p for m, p in hub.requests if m == "GET" and p.startswith(f"/{repo}/resolve/")]


@pytest.mark.parametrize(
    "name, revision, error, message",
    [
        ("a/b/c", None, FileNotFoundError, "checkpoint folder not found: a/b/c (nor is it a "),
        ("org/bad--name", None, FileNotFoundError, "nor is it a Hugging Face Hub repo id"),
        ("org/missing", None, FileNotFoundError, "'org/missing' (revision 'main') is not a lo"),
        (TINY, "v9", FileNotFoundError, "'org/tiny' (revision 'v9'): the repo has no revi"),
    ],
)
def test_names_that_are_nothing(hub, name, revision, error, message):
    with pytest.raises(error) as e:
        ll.load_pretrained(name, revision=revision)
    assert message in str(e.value)
    if name == "org/missing":
        assert "Hub has no such repo (or it is private, and without a token it" in str(e.value)


def test_a_repo_of_pickled_weights_is_refused(hub):
    config = (SHIPPED_MODEL_DIR / "config.json").read_bytes()
    hub.add_commit("org/bin-only", {"config.json": config, "pytorch_model.bin": b"pickle"})
    with pytest.raises(ValueError) as e:
        ll.load_pretrained("org/bin-only")
    assert str(e.value) == (
        "model 'org/bin-only' (revision 'main'): the repo has no safetensors weights "
        "(model.safetensors or model.safetensors.index.json), only pytorch_model.bin; "
        "logitloop reads safetensors only (pickled weights can run code)"
    )
    assert _weights_fetched(hub, "org/bin-only") == []


def test_a_repo_asking_for_remote_code_is_refused(hub):
    config = json.loads((SHIPPED_MODEL_DIR / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.Model"}
    marker = "import pathlib; pathlib.Path('RAN').touch()\n"
    hub.add_commit(
        "org/remote-code",
        {
            "config.json": json.dumps(config).encode(),
            "model.safetensors": (SHIPPED_MODEL_DIR / "model.safetensors").read_bytes(),
            "modeling_x.py": marker.encode(),
        },
    )
    with pytest.raises(ValueError) as e:
        ll.load_pretrained("org/remote-code")
    assert str(e.value) == (
        "model 'org/remote-code' (revision 'main'): its config.json asks for remote code "
        "(auto_map); logitloop runs no code from a repo: it loads the architectures it "
        "implements (logitloop.models.registry)"
    )
    fetched = _weights_fetched(hub, "org/remote-code")
    assert fetched and all(p.endswith("/config.json") for p in fetched)  # no weights, no code


def test_a_revision_of_a_folder_is_refused():
    with pytest.raises(ValueError, match="revision='main' applies to a Hugging Face Hub repo"):
        ll.load_pretrained(SHIPPED_MODEL_DIR, revision="main")


def test_the_environment_users_set(hub, tmp_path):
    """HF_HUB_OFFLINE=1 and HF_HOME (its hub/ the cache) in a fresh process, as
    `huggingface_hub` reads them when imported: the cached model, no request to HF_ENDPOINT."""
    cache = tmp_path / "home" / "hub"
    folder = model_folder(TINY, cache_dir=cache)
    before = len(hub.requests)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env |= {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home"), "HF_ENDPOINT": hub.url}
    script = "import sys; from logitloop.models.hub import model_folder as f; print(f(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", script, TINY], env=env | {"JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(folder)
    assert folder == cache / "models--org--tiny" / "snapshots" / hub.tiny
    assert hub.requests[before:] == []
