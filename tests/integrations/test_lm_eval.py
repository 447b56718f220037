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
from tests.integrations.lm_eval_tasks import (  # noqa: E402
    BOS_ID,
    TASKS,
    evaluate,
    random_llama,
    write_task,
    write_tasks,
)

SHIPPED = Path(ll.__file__).parent / "models" / "tiny"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def tasks(task_dir):
    """One `TaskManager` for the module's evaluations (building one indexes lm-eval's whole
    task library: seconds each)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return random_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def bos_llama_dir(tmp_path_factory) -> Path:
    """Its tokenizer adds BOS to every text, as Llama's does."""
    return random_llama(tmp_path_factory.mktemp("bos_llama"), bos=True)


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


def _compare(folder: Path, tasks, names: list[str], ours_args: str = "", batch_size: int = 3,
             **kw) -> tuple[dict, dict]:  # fmt: skip
    args = f"pretrained={folder},dtype=float32"
    ours = evaluate("logitloop", args + ours_args, tasks, names, batch_size=batch_size, **kw)
    ref = evaluate("hf", args, tasks, names, batch_size=batch_size, device="cpu", **kw)
    assert_same_as_hf(ours, ref)
    return ours, ref


def test_bos_adding_tokenizer_scores_match_hf(bos_llama_dir, tasks):
    """A tokenizer that adds BOS (the empty context is BOS; rolling windows predict after
    it, log P(BOS | BOS) counted as `hf` counts it); the rolling documents span several of
    this model's 48-token windows; the choices of a context share its prompt pass. Kept
    cheap for the default suite: `deterministic=false` and one batch per call (few
    programs; a deterministic program compiles for seconds); the deterministic comparison
    at batch size 3 is the -m slow test below."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bos_llama_dir))
    assert tokenizer.encode("The cat")[0] == tokenizer.bos_token_id == BOS_ID
    _compare(bos_llama_dir, tasks, ["ll_mc", "ll_rolling"], ",deterministic=false", 16)


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["llama", "bos_llama"])
def test_random_llama_scores_match_hf(folder, llama_dir, bos_llama_dir, tasks):
    """Deterministic (the default), batches of 3 that split a question's choices; without
    BOS the empty context is EOS."""
    _compare(llama_dir if folder == "llama" else bos_llama_dir, tasks, ["ll_mc", "ll_rolling"])


@pytest.mark.slow
def test_random_llama_generation_matches_hf(llama_dir, tasks):
    _compare(llama_dir, tasks, ["ll_gen"])


@pytest.mark.slow
def test_shipped_model_matches_hf(tasks):
    _compare(SHIPPED, tasks, list(TASKS))


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["llama", "bos_llama"])
def test_chat_template_matches_hf(folder, llama_dir, bos_llama_dir, tasks):
    """`apply_chat_template=True` (lm-eval's `--apply_chat_template`): the contexts are the
    tokenizer's chat rendering (which starts with the BOS variant's BOS text, so no second
    BOS is added, as in `hf`), with the same scores, generations and metrics."""
    folder = llama_dir if folder == "llama" else bos_llama_dir
    ours, _ = _compare(folder, tasks, ["ll_mc", "ll_gen"], apply_chat_template=True)
    for task in ("ll_mc", "ll_gen"):
        for args in ours["arguments"][task]:
            assert args[0][0].startswith("<|im_start|>user\n"), (task, args)


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["llama", "shipped"])
def test_batch_size_does_not_change_results(folder, llama_dir, tasks):
    from logitloop.integrations.lm_eval import LogitloopLM

    model = ll.load_pretrained(llama_dir if folder == "llama" else SHIPPED, dtype="float32")
    runs = [
        evaluate(LogitloopLM(pretrained=model, batch_size=size), None, tasks, list(TASKS))
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


def test_a_continuation_over_the_model_maximum_is_named():
    from lm_eval.api.instance import Instance

    from logitloop.integrations.lm_eval import LogitloopLM

    lm = LogitloopLM(max_length=16)
    request = Instance("loglikelihood", {}, ("Once", " word" * 17), 0)
    with pytest.raises(ValueError, match=r"loglikelihood request 0 .* the continuation alone "
                       r"has 17 tokens, over the model's maximum of 16"):  # fmt: skip
        lm.loglikelihood([request], disable_tqdm=True)


def test_requests_scored_from_bad_logits_are_counted_in_a_warning(monkeypatch):
    """`ll.score`'s `error` (logits gone NaN or inf) reaches the user: lm-eval would
    otherwise average a -inf log-likelihood in silence."""
    from logitloop.decoding.engine.score import ScoreResult
    from logitloop.integrations.lm_eval import LogitloopLM

    def score(model, prompts, continuations, **kwargs):
        return [
            ScoreResult(c, p, [-np.inf] * len(c), [False] * len(c), error="NaN" if i else None)
            for i, (p, c) in enumerate(zip(prompts, continuations, strict=True))
        ]

    lm = LogitloopLM(compile_cache="false")
    monkeypatch.setattr(ll, "score", score)
    with pytest.warns(UserWarning, match=r"1 of 2 requests were scored from logits holding NaN"):
        lm._score_tokens([([1, 2], [3]), ([4], [5])], ["r0", "r1"], True)


# Questions longer than the random Llama's 48-token window (choices of 1 to 6 tokens, so each
# row keeps another part of its context), and one that fits.
LONG_MC_DOCS = [
    {
        "question": "Once upon a time there was a little girl named Lily who lived in a small "
        "house near the big green park with her mom, her dad and a very old dog. Every day",
        "choices": [" she played", " the dog ran to the park", " rain"],
        "answer": 0,
    },
    {
        "question": "The cat sat on the mat. " * 9 + "Then the cat",
        "choices": [" slept", " ran away from the big red ball", " sat"],
        "answer": 2,
    },
    {"question": "Tom had a", "choices": [" red ball", " dog"], "answer": 0},
]


def test_a_context_over_max_length_is_truncated_as_hf_does(llama_dir, tmp_path):
    """Contexts longer than the model's 48 tokens: each request keeps the last
    max_length + 1 tokens of context and continuation, as the `hf` backend cuts them, so
    the per-request log-likelihoods and `is_greedy` are `hf`'s; one warning names how many
    requests were cut (the 6 choices of the two long questions)."""
    from lm_eval.tasks import TaskManager

    folder = write_task(tmp_path, "ll_mc", TASKS["ll_mc"], LONG_MC_DOCS)
    manager = TaskManager(include_path=str(folder))
    with pytest.warns(UserWarning, match=r"6 of 8 requests were longer than max_length 48"):
        _compare(llama_dir, manager, ["ll_mc"], ",deterministic=false", 16)


# A process that scores two requests with the backend and prints, as JSON, the persistent
# cache's events (`/jax/compilation_cache/...`: a hit loads a program; a miss compiles and
# writes one) and the log-likelihoods.
CACHE_RUN = """
import collections, json, sys
import jax
events = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **kw: events.update([event]))
from lm_eval.api.instance import Instance
from logitloop.integrations.lm_eval import LogitloopLM
lm = LogitloopLM(pretrained=sys.argv[1], dtype="float32", deterministic=False)
requests = [Instance("loglikelihood", {}, ("The cat sat on the", " mat"), 0),
            Instance("loglikelihood", {}, ("Once upon a time", " there was"), 1)]
out = lm.loglikelihood(requests, disable_tqdm=True)
print(json.dumps({"hits": events["/jax/compilation_cache/cache_hits"],
                  "misses": events["/jax/compilation_cache/cache_misses"], "out": out}))
"""


def test_a_second_process_compiles_nothing_the_first_compiled(llama_dir, tmp_path):
    """The backend keeps JAX's persistent compilation cache by default: a second process
    scoring the same requests loads every program from it and compiles (writes) none."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env |= dict(JAX_PLATFORMS="cpu", LOGITLOOP_COMPILE_CACHE=str(tmp_path / "cache"),
                HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")  # fmt: skip
    cmd = [sys.executable, "-c", CACHE_RUN, str(llama_dir)]
    runs = [
        json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True,
                                  timeout=600).stdout.strip().splitlines()[-1])
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0]["misses"] > 0  # the first compiled and kept its programs
    assert runs[1]["misses"] == 0 and runs[1]["hits"] >= runs[0]["misses"]
    assert runs[1]["out"] == runs[0]["out"]


def test_compile_cache_false_keeps_the_cache_off(llama_dir, tmp_path, monkeypatch):
    import jax

    from logitloop.integrations.lm_eval import LogitloopLM

    monkeypatch.setenv("LOGITLOOP_COMPILE_CACHE", str(tmp_path / "cache"))
    before = jax.config.jax_compilation_cache_dir
    model = ll.load_pretrained(llama_dir, dtype="float32")
    lm = LogitloopLM(pretrained=model, compile_cache="false")
    assert lm.compile_cache is None and jax.config.jax_compilation_cache_dir == before
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow  # 8 s: lm-eval's CLI indexes its whole task library
def test_cli_eval_hands_its_arguments_to_lm_eval(task_dir, capsys, monkeypatch):
    from logitloop.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    argv = ["eval", "--model", "logitloop", "--model_args", "bogus=1", "--tasks", "ll_mc"]
    assert main([*argv, "--include_path", str(task_dir)]) == 2
    assert "logitloop: error: model_args: unknown key(s) bogus" in capsys.readouterr().err


def test_mesh_model_arg_scores_as_no_mesh(bos_llama_dir):
    """`mesh=1x1` on this process's one CPU device: the same loglikelihoods (the 2-device
    mesh, bit for bit in the deterministic mode, is the -m slow test below)."""
    from lm_eval.api.instance import Instance

    from logitloop.integrations.lm_eval import LogitloopLM

    requests = [Instance("loglikelihood", {}, ("The cat sat", c), i)
                for i, c in enumerate([" on", " under the", " mat"])]  # fmt: skip
    model = ll.load_pretrained(bos_llama_dir, dtype="float32")
    runs = [
        LogitloopLM(pretrained=model, mesh=mesh, deterministic=False).loglikelihood(
            requests, disable_tqdm=True
        )
        for mesh in (None, "1x1")
    ]
    np.testing.assert_allclose(np.array(runs[1])[:, 0], np.array(runs[0])[:, 0], atol=1e-5)
    assert [r[1] for r in runs[1]] == [r[1] for r in runs[0]]


@pytest.mark.slow  # a subprocess with 2 fake CPU devices compiles every program again
def test_mesh_model_arg_on_two_devices(bos_llama_dir):
    """`mesh=2x1`: the data shards split the rows (and a context's shared prompt pass);
    the loglikelihoods are those on no mesh, bit for bit (deterministic)."""
    import subprocess
    import sys

    from tests.sharding._run import parse, worker_env

    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.lm_eval_mesh_worker", str(bos_llama_dir)],
        cwd=Path(__file__).resolve().parents[2], env=worker_env(2), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = parse(proc.stdout, proc.stderr, "lm_eval_mesh_worker")
    assert out["1x1"] == out["None"]
    assert out["2x1"] == out["None"]
