"""Steering in `generate_many` (issue 72): each request's vectors, on the paged pool with
the prefix cache on and more requests than slots, give `generate(..., steer=)`'s greedy
tokens (which `test_inside` holds equal to transformers with a forward hook), steered and
unsteered rows in one batch; the prefix cache keys pages by the vectors that reached the
prompt; new vectors compile nothing; a bad vector is refused with its request's index."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import logitloop as ll  # noqa: E402
from tests.models.tiny_checkpoints import random_prompts  # noqa: E402

from .test_inside import STEERS, WIDTH, vector  # noqa: E402

TOKENS = 4
PAGE = 4  # a 10-token prompt has 2 full pages a later row may share
GREEDY = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
# One set of bounds for every job here: the jobs share their compiled programs.
JOB = dict(
    slots=2, prefill_batch=1, chunk_steps=2, max_prompt_len=10, max_tokens_bound=TOKENS,
    page_size=PAGE, kv_cache_tokens=128, prefix_cache=True, **GREEDY,
)  # fmt: skip


def alone(model, prompt, steers):
    """`generate`'s greedy tokens for `prompt` alone under `steers` (a list)."""
    return ll.generate(model, [prompt], steer=[steers or None], **GREEDY).token_ids[0]


CONTIGUOUS = {**JOB, "kv_cache_tokens": None, "prefix_cache": False}  # a cache row a slot


@pytest.mark.parametrize("job", [JOB, pytest.param(CONTIGUOUS, marks=pytest.mark.slow)])
def test_steered_requests_equal_generate_row_by_row(setup, job):
    """Six requests through two slots (refills), the four rows of `test_inside`'s
    parity batch (layer 0 or 1; all, generated or prompt tokens; two vectors; none) and
    a job-wide `steer=` for the requests that give none: each equals `generate` alone,
    on the paged pool with the prefix cache and on the contiguous slots."""
    model = setup["model"]
    prompts = random_prompts(160, [5, 8, 4, 6, 9, 7], 2)
    default = [ll.Steer(vector(11), 1, 6.0)]
    steers = [*STEERS, None, [ll.Steer(vector(12), 0, 5.0, tokens="prompt")]]
    requests = [ll.Request(p, steer=s) for p, s in zip(prompts, steers, strict=True)]
    out = ll.generate_many(model, requests, steer=default[0], **job)
    for i, (prompt, s) in enumerate(zip(prompts, steers, strict=True)):
        assert out[i].token_ids == [alone(model, prompt, default if s is None else s)], i


def test_prefix_cache_keys_pages_by_steering(setup):
    """One 10-token prompt (2 shareable pages) under vectors A (all tokens), none, A
    again, B, A on generated tokens only, A on the prompt only, and none again: only A's
    second and prompt-only rows read A's pages, and the generated-only row and the second
    unsteered row the unsteered pages. A key without the steering would serve A's pages
    to the unsteered row (other tokens) and count more cached tokens."""
    model = setup["model"]
    prompt = random_prompts(160, [10], 21)[0]
    a, b = vector(13), vector(14)
    steers = [
        [ll.Steer(a, 0, 8.0)], [], [ll.Steer(a, 0, 8.0)], [ll.Steer(b, 0, 8.0)],
        [ll.Steer(a, 0, 8.0, tokens="generated")], [ll.Steer(a, 0, 8.0, tokens="prompt")], [],
    ]  # fmt: skip
    stats = {}
    out = ll.generate_many(model, [ll.Request(prompt, steer=s) for s in steers], stats=stats, **JOB)
    want = [alone(model, prompt, s) for s in steers]
    assert want[0] != want[1] != want[3]  # the vectors change these tokens
    assert [r.token_ids for r in out] == [[w] for w in want]
    full = (len(prompt) - 1) // PAGE * PAGE  # tokens a row may read from shared pages
    assert stats["cached_tokens"] == full * 4


def test_new_vectors_in_a_job_of_the_same_bounds_compile_nothing(setup, compile_counter):
    """A second job of the same bounds whose requests bring other vectors, scales, layers
    and spans (and one none), read lazily from a generator: no program compiles."""
    model = setup["model"]
    prompts = random_prompts(160, [6, 9, 10], 22)
    first = [ll.Request(p, steer=ll.Steer(vector(15 + i), 0, 3.0)) for i, p in enumerate(prompts)]
    ll.generate_many(model, first, **JOB)
    steers = [[ll.Steer(vector(20), 1, -4.0, tokens="generated")], [],
              [ll.Steer(vector(21), 0, 7.0, tokens="prompt")]]  # fmt: skip

    def requests():
        yield from (ll.Request(p, steer=s) for p, s in zip(prompts, steers, strict=True))

    with compile_counter as c:
        out = dict(ll.iter_generate_many(model, requests(), **JOB))
    assert c.count == 0
    for i, s in enumerate(steers):
        assert out[i].token_ids == [alone(model, prompts[i], s)], i


@pytest.mark.parametrize(
    "steer, match",
    [
        (ll.Steer(np.zeros(WIDTH + 1, np.float32), 0), r"requests\[1\]: steer\.vector must have"),
        (ll.Steer(np.zeros(WIDTH, np.float32), 2), r"requests\[1\]: steer\.layer = 2 is out"),
        ("up", r"requests\[1\]: steer must be an ll\.Steer, a list"),
    ],
)
def test_bad_steering_is_refused_with_the_requests_index(setup, steer, match, compile_counter):
    requests = [ll.Request([1, 2, 3]), ll.Request([4, 5], steer=steer)]
    with compile_counter as c, pytest.raises(ValueError, match=match):
        ll.generate_many(setup["model"], requests, **JOB)
    assert c.count == 0


@pytest.mark.slow
def test_preempted_steered_rows_resume_under_their_vectors(setup):
    """A pool of 6 pages for two rows that need 5 each: the newer row is preempted and
    resumed (its prompt and tokens recomputed under its own vectors, `pool.resume`), and
    every row still equals `generate` alone."""
    model = setup["model"]
    prompts = random_prompts(160, [10, 9, 10, 8], 23)
    steers = [[ll.Steer(vector(30), 0, 6.0)], [], [ll.Steer(vector(31), 1, 5.0)],
              [ll.Steer(vector(32), 0, 6.0, tokens="generated")]]  # fmt: skip
    keywords = {**JOB, "max_new_tokens": 8, "max_tokens_bound": 8, "kv_cache_tokens": 24}
    stats = {}
    requests = [ll.Request(p, steer=s) for p, s in zip(prompts, steers, strict=True)]
    out = ll.generate_many(model, requests, stats=stats, **keywords)
    assert stats["preemptions"] > 0
    for i, s in enumerate(steers):
        want = ll.generate(
            model, [prompts[i]], steer=[s or None], **{**GREEDY, "max_new_tokens": 8}
        )
        assert out[i].token_ids == want.token_ids, i


@pytest.mark.slow
def test_a_generators_later_request_starts_the_steering(setup):
    """A generator whose first two requests give no vectors (the job starts without any
    steering state) and whose third steers, `n = 2` rows a request: every row equals
    `generate` alone (the state gains the vectors mid-job, compiling once)."""
    model = setup["model"]
    prompts = random_prompts(160, [7, 10, 9], 24)
    steers = [None, None, [ll.Steer(vector(33), 0, 6.0)]]

    def requests():
        yield from (ll.Request(p, steer=s) for p, s in zip(prompts, steers, strict=True))

    out = dict(ll.iter_generate_many(model, requests(), n=2, **JOB))
    for i, s in enumerate(steers):
        assert out[i].token_ids == [alone(model, prompts[i], s or [])] * 2, i
