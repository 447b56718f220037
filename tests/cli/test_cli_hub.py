"""`--model` and `--draft-model` by Hugging Face Hub name, in process against the fake Hub
(`tests/models/fake_hub.py`): the name (at `--revision`) becomes the snapshot folder in the
cache before anything reads it, and the job loads that folder; a `--ray` job hands its
actors the name and the commit; a bad name is one error line. The generation itself is the
folder's (tests/models/test_hub.py), so nothing here generates."""

from __future__ import annotations

import pytest

from logitloop.cli import main, run_generate
from logitloop.jobs import load_model
from logitloop.models.loading import SHIPPED_MODEL_DIR
from tests.models.fake_hub import TINY, serving


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with serving(monkeypatch, tmp_path) as fake:
        yield fake


def _job_args(monkeypatch, *argv: str):
    """`generate`'s arguments as its job gets them, with the model the job loads (the
    generation itself is the folder's: tests/models/test_hub.py)."""
    got = {}

    def load_and_stop(args, *rest):
        got["args"] = args
        got["model"] = load_model(args.model, args.dtype)
        return 0

    monkeypatch.setattr(run_generate, "_run_job", load_and_stop)
    assert main(["generate", "a prompt", *argv]) == 0
    return got["args"], got["model"]


@pytest.mark.parametrize("quiet", [False, True])
def test_model_and_draft_by_name(hub, monkeypatch, capsys, quiet):
    """Downloaded with the hub's progress bar on stderr, but for -q."""
    snapshot = hub.cache / "models--org--tiny" / "snapshots" / hub.tiny
    flags = ["--model", TINY, "--revision", hub.tiny, "--draft-model", TINY]
    args, model = _job_args(monkeypatch, *flags, *(["-q"] if quiet else []))
    assert ("Fetching 4 files" in capsys.readouterr().err) is not quiet
    assert args.model == args.draft_model == str(snapshot)
    assert model.checkpoint_dir == snapshot
    assert (snapshot / "model.safetensors").read_bytes() == (
        SHIPPED_MODEL_DIR / "model.safetensors"
    ).read_bytes()


def test_a_ray_job_gets_the_name_and_commit(hub, monkeypatch, tmp_path):
    pytest.importorskip("ray.data", reason="--ray needs the optional extra ray")
    from logitloop.integrations import ray as ll_ray

    got = {}

    def run_items(todo, base, write, **options):
        got.update(options)
        return 0

    monkeypatch.setattr(ll_ray, "run_items", run_items)
    prompts = tmp_path / "in.txt"
    prompts.write_text("a prompt\n")
    argv = ["--model", TINY, "--ray", "-i", str(prompts), "-o", str(tmp_path / "out.jsonl")]
    assert main(["generate", "-q", *argv]) == 0
    assert (got["model"], got["revision"]) == (TINY, hub.tiny)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--model", "org/missing"],
            "--model org/missing: model 'org/missing' (revision 'main') is not a local "
            "folder, and the Hugging Face Hub has no such repo",
        ),
        (["--model", TINY, "--revision", "v9"], "the repo has no revision 'v9'"),
        (["--revision", "v1"], "--revision needs --model naming a Hugging Face Hub repo"),
        (["--model", "/no/such/model"], "checkpoint folder not found: /no/such/model (nor"),
    ],
)
def test_bad_names_are_one_error_line(hub, capsys, flags, message):
    assert main(["generate", "a prompt", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("logitloop: error: ") and err.count("\n") == 1
    assert message in err
