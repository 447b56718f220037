"""The lm-evaluation-harness backend against lm-eval's own `hf` backend, on offline tasks
(multiple choice, rolling perplexity, generation with stop strings): the same per-sample
log-likelihoods (1e-4, float32), `is_greedy` flags, rolling sums (1e-3), generated strings
and metrics; bitwise-equal per-sample results at batch sizes 1, 3 and 8."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="the lm-eval backend needs the eval extra (lm-eval)")
pytest.importorskip("accelerate", reason="lm-eval's hf reference backend needs lm-eval[hf]")

import logitloop as ll  # noqa: E402
from tests.integrations.lm_eval_tasks import TASKS, evaluate, random_llama, write_tasks  # noqa: E402

SHIPPED = Path(ll.__file__).parent / "models" / "tiny"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return random_llama(tmp_path_factory.mktemp("llama"))


def assert_same_as_hf(ours: dict, ref: dict) -> None:
    for task in ref["samples"]:
        for doc, (a, b) in enumerate(zip(ours["samples"][task], ref["samples"][task], strict=True)):
            where = f"{task} doc {doc}"
            if task == "ll_mc":
                got = np.array([r[0][0] for r in a]), [r[0][1] for r in a]
                want = np.array([r[0][0] for r in b]), [r[0][1] for r in b]
                np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-4, err_msg=where)
                assert got[1] == want[1], where
            elif task == "ll_rolling":
                np.testing.assert_allclose(a[0][0], b[0][0], rtol=0, atol=1e-3, err_msg=where)
            else:
                assert a == b, where
    for task, metrics in ref["results"].items():
        for name, value in metrics.items():
            if "stderr" in name or not isinstance(value, float):
                continue
            tol = 1e-3 * abs(value) if "perplexity" in name else 1e-5
            assert abs(ours["results"][task][name] - value) <= tol, (task, name)


def _compare(folder: Path, task_dir: Path, tasks: list[str]) -> None:
    args = f"pretrained={folder},dtype=float32"
    ours = evaluate("logitloop", args, task_dir, tasks, batch_size=3)
    ref = evaluate("hf", args, task_dir, tasks, batch_size=3, device="cpu")
    assert_same_as_hf(ours, ref)


def test_random_llama_scores_match_hf(llama_dir, task_dir):
    """The rolling documents span several of this model's 48-token windows."""
    _compare(llama_dir, task_dir, ["ll_mc", "ll_rolling"])


@pytest.mark.slow
def test_random_llama_generation_matches_hf(llama_dir, task_dir):
    _compare(llama_dir, task_dir, ["ll_gen"])


@pytest.mark.slow
def test_shipped_model_matches_hf(task_dir):
    _compare(SHIPPED, task_dir, list(TASKS))


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["llama", "shipped"])
def test_batch_size_does_not_change_results(folder, llama_dir, task_dir):
    from logitloop.integrations.lm_eval import LogitloopLM

    model = ll.load_pretrained(llama_dir if folder == "llama" else SHIPPED, dtype="float32")
    runs = [
        evaluate(LogitloopLM(pretrained=model, batch_size=size), None, task_dir, list(TASKS))
        for size in (1, 3, 8)
    ]
    for run in runs[1:]:
        assert run["samples"] == runs[0]["samples"]  # floats compared exactly


def test_registration_keeps_the_builtin_backends():
    from lm_eval.api.registry import get_model

    from logitloop.integrations.lm_eval import LogitloopLM

    assert get_model("logitloop") is LogitloopLM
    assert get_model("hf").__name__ == "HFLM"


@pytest.mark.parametrize(
    "args, message",
    [
        ("pretrained=/nonexistent/ckpt", "pretrained='/nonexistent/ckpt' does not load"),
        ("dtype=float32,temperature=0.5", "unknown key(s) temperature"),
        ("batch_size=0", "batch_size=0"),
        ("mesh=2by1", "mesh='2by1'"),
        ("max_length=100000", "max_length=100000"),
    ],
)
def test_bad_model_args_are_named(args, message):
    from lm_eval.api.registry import get_model

    with pytest.raises(ValueError) as err:
        get_model("logitloop").create_from_arg_string(args)
    assert message in str(err.value)


def test_a_context_over_the_model_maximum_is_named():
    from lm_eval.api.instance import Instance

    from logitloop.integrations.lm_eval import LogitloopLM

    lm = LogitloopLM(max_length=16)
    request = Instance("loglikelihood", {}, ("word " * 40, " end"), 0)
    with pytest.raises(ValueError, match=r"loglikelihood request 0 .* over the model's maximum"):
        lm.loglikelihood([request], disable_tqdm=True)


@pytest.mark.slow  # 8 s: lm-eval's CLI indexes its whole task library
def test_cli_eval_hands_its_arguments_to_lm_eval(task_dir, capsys, monkeypatch):
    from logitloop.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    argv = ["eval", "--model", "logitloop", "--model_args", "bogus=1", "--tasks", "ll_mc"]
    assert main([*argv, "--include_path", str(task_dir)]) == 2
    assert "logitloop: error: model_args: unknown key(s) bogus" in capsys.readouterr().err
