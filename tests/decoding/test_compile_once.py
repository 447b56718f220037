"""A closed set of programs: after `ll.precompile` of a job's buckets, no call inside them
compiles (docs/performance.md, "What compiles").

Counted with JAX's compile events (`compile_counter`), never timed. The model is a small
random Llama with the shipped model's tokenizer, so stop strings and JSON schemas run
through real tables at a small compile cost; each test builds its own, so its first
programs are new whatever ran before in the worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import logitloop as ll
from logitloop.decoding.engine.host import row_bucket
from logitloop.decoding.runtime import compiles

from .random_llama import small_llama

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
OTHER_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}


@pytest.fixture(autouse=True)
def _forget_precompile():
    """`ll.precompile` makes every later new program of its model warn, for the rest of the
    process (the models here are the tests' own; forgotten all the same)."""
    yield
    compiles._prepared.clear()


def _model(seed: int):
    shipped = ll.load_pretrained()
    c = shipped.config
    model = small_llama(c.vocab_size, c.max_position_embeddings, seed, eos_token_id=c.eos_token_id)
    model.tokenizer = shipped.tokenizer
    return model


def _prompts(rng, rows: int, longest: int = 16) -> list[list[int]]:
    return [rng.integers(3, 400, int(rng.integers(1, longest + 1))).tolist() for _ in range(rows)]


def test_row_buckets():
    assert [row_bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 33, 49, 65)] == [
        1, 2, 4, 4, 8, 8, 16, 48, 64, 96,
    ]  # fmt: skip
    assert row_bucket(3, multiple=8) == 8 and row_bucket(9, multiple=8) == 16
    assert row_bucket(5, multiple=3) == 9


def test_the_table_compiles_nothing_after_precompile(compile_counter):
    """Issue 64's table: after the job's buckets are compiled, batch sizes, max_tokens,
    logprob widths, a stop string, a schema and n inside them compile nothing; the results
    are those of a call that compiled its own programs."""
    model = _model(1)
    rng = np.random.default_rng(0)
    with compile_counter as c:
        report = ll.precompile(model, rows=[3, 8], prompt_len=16, max_tokens=60)
        ll.precompile(model, rows=3, prompt_len=16, max_tokens=60, logprobs=1)
        ll.precompile(model, rows=3, prompt_len=16, max_tokens=60, n=2)
        ll.precompile(model, rows=3, prompt_len=16, max_tokens=60, json_schema=SCHEMA)
    assert report.programs == 4 and report.cached == 0 and c.count >= 10
    again = ll.precompile(model, rows=[4, 7], prompt_len=9, max_tokens=20)  # the same buckets
    assert again.programs == 0 and again.cached == 4
    calls = [
        dict(rows=3, max_tokens=16),
        dict(rows=4, max_tokens=16, seed=3, temperature=0.5, top_k=5),
        dict(rows=5, max_tokens=16),
        dict(rows=7, max_tokens=16),
        dict(rows=3, max_tokens=17),
        dict(rows=3, max_tokens=40),
        dict(rows=3, max_tokens=16, logprobs=2),
        dict(rows=3, max_tokens=16, logprobs=3),
        dict(rows=3, max_tokens=16, stop=["e", "the"]),
        dict(rows=3, max_tokens=16, json_schema=OTHER_SCHEMA),
        dict(rows=3, max_tokens=16, n=2),
        dict(rows=4, max_tokens=16, n=2, temperature=0.8),
    ]
    results = []
    with compile_counter as c:
        for call in calls:
            rows = call.pop("rows")
            results.append(ll.generate(model, _prompts(rng, rows), **call))
        events = list(ll.stream(model, _prompts(rng, 6), max_tokens=30, stop=["a"]))
    assert c.count == 0, ll.compile_stats().summary()
    assert sum(len(e.token_ids) for e in events) > 0
    lp = results[6]
    assert all(len(step) == 2 for row in lp.top_logprobs for step in row)  # cut on the host
    assert len(results[10].token_ids) == 6  # 3 prompts x n = 2, dummy rows dropped
    assert [len(r.token_ids) for r in results[:4]] == [3, 4, 5, 7]


def test_a_padded_batch_gives_each_row_its_own_tokens():
    """Dummy rows change nothing in the real ones: with deterministic=True a row's tokens
    and logprobs are bit for bit those of the row alone, and a batch of 3 (run as 4) ends
    each row by its own max_tokens."""
    model = _model(2)
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, 3)
    knobs = dict(temperature=[0.0, 0.9, 1.2], seed=[4, 5, 6], max_tokens=[3, 9, 5], logprobs=2)
    batch = ll.generate(model, prompts, deterministic=True, **knobs)
    assert len(batch.token_ids) == len(batch.finish_reason) == 3  # the real rows only
    assert batch.num_tokens == [3, 9, 5] or all(r in ("stop",) for r in batch.finish_reason)
    for r in range(3):
        alone = ll.generate(
            model, [prompts[r]], deterministic=True,
            **{k: [v[r]] if isinstance(v, list) else v for k, v in knobs.items()},
        )  # fmt: skip
        assert alone.token_ids[0] == batch.token_ids[r]
        assert alone.logprobs[0] == batch.logprobs[r]
        assert alone.top_logprobs[0] == batch.top_logprobs[r]


def test_compile_stats_name_what_was_new_and_a_prepared_model_warns():
    """`ll.compile_stats` names each program's new dimension against the closest earlier
    one; after `ll.precompile`, a call outside its buckets warns with that dimension (one
    model for both: each new program is a few seconds of the default suite)."""
    model = _model(3)
    ll.compile_stats(reset=True)
    ll.precompile(model, rows=1, prompt_len=8, max_tokens=4)
    ll.generate(model, [[5, 6]], max_tokens=4)  # inside the buckets: nothing new
    with pytest.warns(UserWarning, match=r"rows 1 -> 8.*outside the buckets ll.precompile"):
        ll.generate(model, [[5, 6]] * 5, max_tokens=4)
    with pytest.warns(UserWarning, match=r"outside the buckets ll.precompile"):  # 2 programs
        ll.generate(model, [[5, 6]] * 5, max_tokens=100)
    stats = ll.compile_stats()
    reasons = [(e.program, e.reason) for e in stats.events]
    assert stats.programs == len(reasons) == 6, reasons
    assert ("prefill", "rows 1 -> 8") in reasons and ("decode", "rows 1 -> 8") in reasons
    assert any(p == "prefill" and "buffer_len 64 -> 128" in r for p, r in reasons), reasons
    assert "6 programs compiled" in stats.summary()
    with warnings.catch_warnings():  # another model's programs are its own business
        warnings.simplefilter("error")
        ll.generate(_model(7), [[4], [5], [6]], max_tokens=4)


@pytest.mark.parametrize(
    "bad",
    [
        dict(rows=0),
        dict(prompt_len=[]),
        dict(max_tokens=-1),
        dict(rows=2.0, match=r"rows must be an int in \[1, inf\), got float 2.0"),
        dict(slots=2, rows=[1, 8], match=r"rows=\[1, 8\] with slots=2: .* not both"),
        dict(slots=0, match=r"slots = 0 is outside the allowed range"),
    ],
)
def test_precompile_names_a_bad_size(bad):
    model = _model(4)
    bad = dict(bad)
    match = bad.pop("match", next(iter(bad)))
    with pytest.raises(ValueError, match=match):
        ll.precompile(model, **bad)


def test_a_precompiled_generate_many_job_compiles_nothing(compile_counter):
    """`precompile(slots=...)` compiles a `generate_many` job's programs: the job itself,
    requests of any length and settings inside its bounds, stop strings included, then
    compiles nothing."""
    model = _model(5)
    rng = np.random.default_rng(2)
    before = ll.compile_stats().programs
    report = ll.precompile(model, slots=4, prompt_len=16, max_tokens=12, prefill_batch=2)
    # Programs as compile_stats counts them (it counted XLA's compiles, 9 for 2 programs).
    assert report.programs == ll.compile_stats().programs - before > 0
    assert report.cached == 0
    again = ll.precompile(model, slots=4, prompt_len=16, max_tokens=12, prefill_batch=2)
    assert (again.programs, again.cached) == (0, report.programs)  # it said 0 already compiled
    requests = [
        ll.Request(p, {"max_tokens": int(rng.integers(1, 13)), "temperature": 0.7, "seed": i,
                       "stop": ["e"] if i % 2 else []})
        for i, p in enumerate(_prompts(rng, 7))
    ]  # fmt: skip
    with compile_counter as c:
        results = ll.generate_many(
            model, requests, slots=4, max_prompt_len=16, max_tokens_bound=12, prefill_batch=2
        )
    assert c.count == 0, ll.compile_stats().summary()
    assert [len(r.token_ids[0]) <= 12 for r in results] == [True] * 7


def test_importing_logitloop_sets_no_jax_option():
    """The persistent cache is one documented call away, never on by import."""
    code = (
        "import jax, logitloop; c = jax.config; "
        "print(c.jax_compilation_cache_dir, c.jax_persistent_cache_min_compile_time_secs)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOGITLOOP")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "1.0"]


def test_what_was_new_is_said_in_the_fields_that_changed():
    """The reason a program compiled names the fields of a static argument that changed,
    down to plain values (it said `program.pool PoolShape -> PoolShape`), a pool that came
    or went, and the rows once, by the change most arrays' first axis made (n = 2: the
    prompts go 1 -> 4 while the samples' rows go 2 -> 8)."""
    import dataclasses

    from logitloop.decoding.loop.pool import PoolShape

    @dataclasses.dataclass(frozen=True)
    class Program:
        pool: PoolShape | None

    def sig(pool, prompts, rows):
        arrays = {f"knob{i}": np.zeros((rows,), np.float32) for i in range(3)}
        program = Program(None if pool is None else PoolShape(pool, 16, 2))
        prompt = np.zeros((prompts, 8), np.int32)
        return compiles.signature({"program": program, "prompt": prompt, **arrays})

    assert compiles._differences(sig(10, 1, 2), sig(40, 4, 8)) == [
        "rows 2 -> 8",
        "program.pool.num_pages 10 -> 40",
        "prompt int32[1, 8] -> int32[4, 8]",
    ]
    assert compiles._differences(sig(None, 1, 2), sig(10, 1, 2)) == ["program.pool added"]
