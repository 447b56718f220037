"""LoRA adapters in `generate_many` (issue 71): each request's adapter, on the paged pool
with the prefix cache keyed by adapter, equals transformers with that adapter merged
(PEFT's `merge_and_unload`); an adapter a request brings is loaded into the running job
compiling nothing; bad adapters are refused with the request's index."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

import logitloop as ll  # noqa: E402
from logitloop.decoding.engine import job_adapters, reuse  # noqa: E402
from tests.models.tiny_checkpoints import random_prompts  # noqa: E402

from .peft_adapters import torch_greedy  # noqa: E402

TOKENS = 4
PAGE = 4  # pages of 4 tokens: a 10-token prompt has 2 full pages a later row may share
GREEDY = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
# One set of bounds for every job here: the jobs share their compiled programs.
JOB = dict(
    slots=2, prefill_batch=1, chunk_steps=4, max_prompt_len=10, max_tokens_bound=TOKENS,
    page_size=PAGE, kv_cache_tokens=256, **GREEDY,
)  # fmt: skip


def test_mixed_adapters_on_the_prefix_cache_equal_peft_merged(setup):
    """One prompt under "a", "b", the base and "a" again, n=2 rows each: every row's
    tokens equal the merged model's, and only rows of one adapter share pages (a request's
    second row its first's, the second "a" request the first's): the cache keys pages by
    adapter. A key without the adapter would serve "a"'s pages to "b" and the base."""
    prompt = random_prompts(160, [10], 11)[0]
    names = ["a", "b", None, "a"]
    stats = {}
    out = ll.generate_many(
        setup["model"], [ll.Request(prompt, adapter=name) for name in names],
        adapters=setup["table"], n=2, stats=stats, **JOB,
    )  # fmt: skip
    want = {name: torch_greedy(setup["merged"][name], prompt, TOKENS)[0] for name in names}
    assert want["a"] != want["b"] != want[None]  # the adapters change these tokens
    for name, result in zip(names, out, strict=True):
        assert result.token_ids == [want[name]] * 2, name
    full = (len(prompt) - 1) // PAGE * PAGE  # tokens a row may read from shared pages
    assert stats["cached_tokens"] == full * (3 + 2)  # 3 second rows, "a" again twice


def test_a_job_default_adapter_names_the_adapter_of_requests_that_name_none(setup):
    prompts = random_prompts(160, [6, 9], 12)
    requests = [ll.Request(prompts[0]), ll.Request(prompts[1], adapter="b")]
    out = ll.generate_many(setup["model"], requests, adapters=setup["table"], adapter="a", **JOB)
    assert out[0].token_ids == [torch_greedy(setup["merged"]["a"], prompts[0], TOKENS)[0]]
    assert out[1].token_ids == [torch_greedy(setup["merged"]["b"], prompts[1], TOKENS)[0]]


def test_loading_an_adapter_into_a_running_job_compiles_nothing(setup, compile_counter):
    """A second job of the same bounds, whose third request brings a new adapter (b's
    folder as "c", into a free slot) while the first two run: no program compiles, and
    its row runs the loaded adapter."""
    model, table = setup["model"], setup["table"]
    prompts = random_prompts(160, [10, 9, 10], 13)
    # Only this test's own calls (as test_lora.py's twin): no shape recorded by another
    # test of this worker (`reuse`, whose programs a cleared jit cache may have dropped),
    # and the host side of a load once before counting. It counted 5 programs in a full
    # run, 0 alone.
    reuse.forget()
    ll.load_adapter(model, setup["dir"] / "b", name="c", adapters=table)
    first = [ll.Request(prompts[0], adapter="a"), ll.Request(prompts[1]), ll.Request(prompts[2])]
    ll.generate_many(model, first, adapters=table, **JOB)

    def requests():  # read lazily: the third while the first two decode
        yield ll.Request(prompts[0], adapter="b")
        yield ll.Request(prompts[1], adapter="a")
        yield ll.Request(prompts[2], adapter=("c", setup["dir"] / "b"))

    with compile_counter as c:
        out = dict(ll.iter_generate_many(model, requests(), adapters=table, **JOB))
    assert c.count == 0
    assert out[2].token_ids == [torch_greedy(setup["merged"]["b"], prompts[2], TOKENS)[0]]
    assert setup["table"].loaded == ("a", "b")  # the caller's table is a value


def test_bad_adapters_are_refused_with_the_requests_index(setup):
    model, table = setup["model"], setup["table"]
    prompt = [5, 6, 7]
    with pytest.raises(ValueError, match=r"requests\[1\]: adapter: unknown adapter 'zz'"):
        ll.generate_many(model, [prompt, ll.Request(prompt, adapter="zz")], adapters=table)
    with pytest.raises(ValueError, match=r"requests\[0\]: adapter='a' needs the job's adapters="):
        ll.generate_many(model, [ll.Request(prompt, adapter="a")])
    with pytest.raises(ValueError, match="one adapter's name"):
        ll.generate_many(model, [prompt], adapters=table, adapter=["a"])
    with pytest.raises(ValueError, match=r"^adapter: unknown adapter 'zz'"):
        ll.generate_many(model, [prompt], adapters=table, adapter="zz")
    small = ll.load_adapter(model, setup["dir"] / "a", name="a", max_adapters=1)
    bring = ll.Request(prompt, adapter=("c", setup["dir"] / "b"))
    with pytest.raises(ValueError, match=r"requests\[1\]: adapter 'c': the adapter table is full"):
        ll.generate_many(model, [prompt, bring], adapters=small)  # "a" is the job's: kept
    batcher = job_adapters.JobAdapters(small, None, 2)
    with pytest.raises(ValueError, match="the adapter table is full"):
        batcher.resolve(bring.adapter)
    assert batcher.table.loaded == ("a",)


def test_brought_adapters_evict_idle_ones_and_their_slots_pages(setup):
    """Six requests of one prompt bring five adapters into an empty table of 4 slots, two
    at a time in 2 slots: "e" takes the slot of "a" (idle: least recently used), then "a"
    comes back (loaded again from its source) into the slot "b" had. Every row equals its
    merged model: the prefix cache keys pages by the slot and how often the job wrote it,
    so "e" never reads the pages "a" left in that slot, nor "a" those of "b"."""
    model, d = setup["model"], setup["dir"]
    prompt = random_prompts(160, [10], 15)[0]
    brought = [("a", d / "a"), ("b", d / "b"), ("c", d / "a"), ("d", d / "b"), ("e", d / "b")]
    merged = [setup["merged"][w] for w in ("a", "b", "a", "b", "b", "a")]
    empty = ll.Adapters.create(model, max_adapters=4, max_rank=16)  # the setup table's shapes
    requests = [ll.Request(prompt, adapter=a) for a in [*brought, "a"]]
    out = ll.generate_many(model, requests, adapters=empty, **JOB)
    want = {id(m): torch_greedy(m, prompt, TOKENS)[0] for m in merged}
    assert len(set(map(tuple, want.values()))) == 2  # "a" and "b" differ here
    for result, m in zip(out, merged, strict=True):
        assert result.token_ids == [want[id(m)]]


@pytest.mark.slow  # a resumption program; the jobs above hold the admission and decode paths
def test_preempted_rows_resume_under_their_adapters(setup):
    """A pool of 5 pages for two rows that need 3 each: a row is preempted and resumes
    (its keys and values recomputed, `pool.resume`) under its adapter."""
    prompts = random_prompts(160, [8, 8, 8], 14)
    names = ["a", "b", None]
    stats = {}
    job = dict(JOB, kv_cache_tokens=5 * PAGE, prefix_cache=False)  # the prompt recomputed
    out = ll.generate_many(
        setup["model"], [ll.Request(p, adapter=a) for p, a in zip(prompts, names, strict=True)],
        adapters=setup["table"], stats=stats, **job,
    )  # fmt: skip
    assert stats["preemptions"] > 0
    for prompt, name, result in zip(prompts, names, out, strict=True):
        assert result.token_ids == [torch_greedy(setup["merged"][name], prompt, TOKENS)[0]]
