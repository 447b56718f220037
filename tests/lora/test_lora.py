"""LoRA adapters per row (issue 71): a batch mixing two PEFT adapters and the base equals
transformers with each adapter merged (`merge_and_unload`), in `generate` and `score`;
new adapters and new rows' adapters compile nothing; `deterministic=True` keeps a row's
bits beside rows of other adapters; bad input is refused by name."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

import logitloop as ll  # noqa: E402
from logitloop.decoding.engine import reuse  # noqa: E402
from logitloop.decoding.runtime import compiles  # noqa: E402
from tests.models.tiny_checkpoints import build_hf_model, random_prompts, save_hf_model  # noqa: E402

from .peft_adapters import ATTENTION, TARGETS, make_adapter, torch_greedy  # noqa: E402

TOKENS = 5
ATOL = 1e-4  # the float32 parity tests' tolerance (tests/models/test_model_parity.py)


ROWS = ["a", None, "b"]


def test_generate_mixed_batch_equals_peft_merged(setup):
    prompts = random_prompts(160, [5, 7, 4], 0)
    out = ll.generate(
        setup["model"], prompts, adapters=setup["table"], adapter=ROWS,
        temperature=0, max_new_tokens=TOKENS, ignore_eos=True,
    )  # fmt: skip
    for row, (prompt, name) in enumerate(zip(prompts, ROWS, strict=True)):
        tokens, logprobs = torch_greedy(setup["merged"][name], prompt, TOKENS)
        assert out.token_ids[row] == tokens, (row, name)
        np.testing.assert_allclose(out.raw_logprobs[row], logprobs, rtol=0, atol=ATOL)


def test_score_mixed_batch_equals_peft_merged(setup):
    prompts = random_prompts(160, [5, 7, 4], 1)
    conts = random_prompts(160, [3, 2, 4], 2)
    scores = ll.score(setup["model"], prompts, conts, adapters=setup["table"], adapter=ROWS)
    for prompt, cont, name, got in zip(prompts, conts, ROWS, scores, strict=True):
        with torch.no_grad():
            logits = setup["merged"][name](torch.tensor([prompt + cont])).logits[0]
        lp = logits.double().log_softmax(-1)
        want = [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(cont)]
        np.testing.assert_allclose(got.raw_logprobs, want, rtol=0, atol=ATOL)


def test_new_adapters_and_new_row_adapters_compile_nothing(setup, compile_counter):
    model, d = setup["model"], setup["dir"]
    prompts = random_prompts(160, [5, 6, 4], 4)
    keywords = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    # Only this test's own calls: no shape recorded by another test of this worker (`reuse`,
    # whose programs a cleared jit cache may have dropped), and the host side of a load
    # (reading the folder, placing the arrays) once before counting.
    reuse.forget()
    ll.load_adapter(model, d / "b", name="c", adapters=setup["table"].remove("a"))
    first = ll.generate(
        model, prompts, adapters=setup["table"], adapter=["b", "a", None], **keywords
    )
    with compile_counter as c:
        table = setup["table"].remove("a")
        table = ll.load_adapter(model, d / "b", name="c", adapters=table)  # into a's slot
        again = ll.generate(model, prompts, adapters=table, adapter=["c", None, "b"], **keywords)
    assert c.count == 0
    assert again.token_ids[0] == first.token_ids[0]  # "c" is "b" under another name
    assert again.token_ids[1] != first.token_ids[1]  # a's row now runs the base


def _deterministic_rows(setup, batches):
    """`generate` under `deterministic=True` of each `(prompts, adapters)` batch."""
    keywords = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True, deterministic=True)
    return [
        ll.generate(setup["model"], p, adapters=setup["table"], adapter=a, **keywords)
        for p, a in batches
    ]


def _same_bits(x, i, y, j):
    assert x.token_ids[i] == y.token_ids[j]
    lp = [np.asarray(r.raw_logprobs[k], np.float32) for r, k in ((x, i), (y, j))]
    assert np.array_equal(*lp)  # bit for bit


def test_deterministic_row_bits_do_not_depend_on_other_rows_adapters(setup):
    """Row "a" among rows of "b" and the base, then at another place among others (one
    program: the same buckets)."""
    prompt = random_prompts(160, [6], 5)[0]
    o = random_prompts(160, [4, 7, 5, 3, 6, 5], 6)
    first, second = _deterministic_rows(
        setup,
        [
            ([prompt, *o[:3]], ["a", "b", None, "b"]),
            ([*o[3:5], prompt, o[5]], [None, "a", "a", "b"]),
        ],
    )
    _same_bits(first, 0, second, 2)


def test_deterministic_row_alone_equals_it_in_a_mixed_batch(setup):
    prompt = random_prompts(160, [6], 5)[0]
    others = random_prompts(160, [4, 7, 5], 6)
    alone, mixed = _deterministic_rows(
        setup, [([prompt], ["a"]), ([*others, prompt], ["b", None, "b", "a"])]
    )
    _same_bits(alone, 0, mixed, 3)


def test_dense_seam_adds_each_rows_adapter():
    """`ll.dense(x, w, kv, lora=(layer, target))` against the formula, per row and per
    token (a packed pass's `[B, T]` slots); without a table it is `x @ w`."""
    rng = np.random.default_rng(0)
    k, n, slots, rank = 8, 6, 3, 4
    sites = {(0, "q_proj"): (k, n)}
    table = ll.Adapters.create(sites=sites, max_adapters=slots, max_rank=rank)
    config = dict(r=2, lora_alpha=4)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    weights = {}
    for name in ("x", "y"):
        a, b = rng.normal(size=(2, k)), rng.normal(size=(n, 2))
        weights[name] = (a, b)
        tensors = {key.format("A"): a, key.format("B"): b}
        table = ll.load_adapter(None, tensors, name=name, adapters=table, config=config)
    x = jnp.asarray(rng.normal(size=(3, 2, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, n)), jnp.float32)
    spec = ll.KVSpec(1, 1, 4)
    positions = jnp.zeros((3, 2), jnp.int32)

    def expect(name):
        a, b = weights[name]
        return 2.0 * (np.asarray(x) @ a.T) @ b.T  # scale = alpha / r

    base = np.asarray(x) @ np.asarray(w)
    for adapter in (jnp.asarray([0, -1, 1]), jnp.asarray([[0, 0], [-1, -1], [1, 1]])):
        kv = ll.KV([], positions, spec, rows=ll.Rows(adapter, table.table))
        got = np.asarray(ll.dense(x, w, kv, lora=(0, "q_proj")))
        want = base + np.stack([expect("x")[0], 0 * base[1], expect("y")[2]])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    kv = ll.KV([], positions, spec, rows=ll.Rows(jnp.asarray([0, -1, 1]), table.table))
    np.testing.assert_allclose(
        np.asarray(ll.dense(x, w, kv, lora=(1, "q_proj"))), base, rtol=1e-5, atol=1e-5
    )  # no such site: the base product
    np.testing.assert_allclose(np.asarray(ll.dense(x, w, None)), base, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ bad input

KEY = "base_model.model.model.layers.{layer}.{part}.{target}.lora_{ab}.weight"


def tensors(target="q_proj", layer=0, k=64, n=64, r=4, part="self_attn"):
    rng = np.random.default_rng(0)
    return {
        KEY.format(layer=layer, part=part, target=target, ab="A"): rng.normal(size=(r, k)),
        KEY.format(layer=layer, part=part, target=target, ab="B"): rng.normal(size=(n, r)),
    }


@pytest.mark.parametrize(
    "given, config, match",
    [
        (tensors(k=32), {}, "do not fit this model's projection"),
        (tensors(target="fc1", part="mlp", k=64, n=96), {}, "targets module 'fc1'"),
        (tensors(layer=5), {}, "targets module 'q_proj' of layer 5"),
        (tensors(r=32), dict(r=32), "max_rank=16"),
        (tensors(), dict(use_dora=True), "DoRA"),
        (tensors(), dict(peft_type="PREFIX_TUNING"), "peft_type 'PREFIX_TUNING'"),
        (tensors(), dict(bias="all"), "bias='all'"),
        (tensors(), dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
        (
            {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": [1.0]},
            {},
            "not a LoRA A or B weight",
        ),
    ],
)
def test_bad_adapters_are_refused_by_name(setup, given, config, match):
    config = dict(dict(r=4, lora_alpha=8), **config)
    with pytest.raises(ValueError, match=match):
        ll.load_adapter(setup["model"], given, name="x", config=config)


def test_a_full_table_is_refused(setup):
    d = setup["dir"]
    table = ll.load_adapter(setup["model"], d / "a", name="a", max_adapters=1)
    with pytest.raises(ValueError, match="table is full.*max_adapters=1"):
        ll.load_adapter(setup["model"], d / "b", name="b", adapters=table)
    # the same name replaces the adapter in place
    assert ll.load_adapter(setup["model"], d / "b", name="a", adapters=table).loaded == ("a",)


def test_dora_folder_is_refused(setup, tmp_path):
    folder = tmp_path / "dora"
    folder.mkdir()
    config = json.loads((setup["dir"] / "a" / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(dict(config, use_dora=True)))
    (folder / "adapter_model.safetensors").write_bytes(
        (setup["dir"] / "a" / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(ValueError, match="DoRA"):
        ll.load_adapter(setup["model"], folder, name="d")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        ll.load_adapter(setup["model"], tmp_path, name="d")


def test_unknown_adapter_names_are_refused_with_the_row(setup):
    model, table = setup["model"], setup["table"]
    with pytest.raises(ValueError, match=r"adapter\[1\]: unknown adapter 'zz'"):
        ll.generate(model, [[5, 6], [7, 8]], adapters=table, adapter=["a", "zz"])
    with pytest.raises(ValueError, match=r"adapter\[0\]: unknown adapter 'zz'"):
        ll.score(model, [[5, 6]], [[7]], adapters=table, adapter=["zz"])
    with pytest.raises(ValueError, match="one of them per prompt"):
        ll.generate(model, [[5, 6], [7, 8]], adapters=table, adapter=["a"])
    with pytest.raises(ValueError, match="pass adapters="):
        ll.generate(model, [[5, 6]], adapter="a")


def test_precompiled_buckets_under_adapters_compile_nothing(setup, compile_counter):
    """`precompile(rows=, adapters=)` compiles generate's programs for the table: later
    calls in its buckets, any rows' adapters (the base included), compile nothing."""
    model, table = setup["model"], setup["table"]
    report = ll.precompile(model, rows=[2], prompt_len=[8], max_tokens=4, adapters=table,
                           temperature=0)  # fmt: skip
    assert report.programs + report.cached > 0
    prompts = random_prompts(160, [5, 7], 12)
    with compile_counter as c:
        for rows in (["a", "b"], [None, "a"], "b"):
            ll.generate(model, prompts, adapters=table, adapter=rows, temperature=0,
                        max_tokens=3)  # fmt: skip
    compiles._prepared.clear()  # later new programs of this model need not warn
    assert c.count == 0


def test_a_table_of_another_model_is_refused(setup):
    other = ll.Adapters.create(sites={(0, "q_proj"): (64, 64)})
    with pytest.raises(ValueError, match="made for another model"):
        ll.generate(setup["model"], [[5, 6]], adapters=other)


def test_tables_are_values(setup):
    """Loading returns a new table; the one loaded from is unchanged."""
    table = setup["table"]
    smaller = table.remove("a")
    assert table.loaded == ("a", "b") and smaller.loaded == ("b",)
    assert jax.tree.structure(smaller.table) == jax.tree.structure(table.table)


def test_n_rows_and_stream_take_the_prompts_adapter(setup):
    """`n > 1` (a prompt prefilled once, its rows sharing its pages) and `stream` give a
    prompt's rows its adapter: greedy rows equal the merged models' tokens."""
    model, table = setup["model"], setup["table"]
    prompts = random_prompts(160, [5, 7], 7)
    keywords = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    out = ll.generate(model, prompts, adapters=table, adapter=["b", "a"], n=2, **keywords)
    events = ll.stream(model, prompts, adapters=table, adapter=["b", None], **keywords)
    streamed = {0: [], 1: []}
    for e in events:
        streamed[e.row] += e.token_ids
    for i, (prompt, name) in enumerate(zip(prompts, ["b", "a"], strict=True)):
        want = torch_greedy(setup["merged"][name], prompt, TOKENS)[0]
        assert out.token_ids[2 * i] == out.token_ids[2 * i + 1] == want
    assert streamed[0] == torch_greedy(setup["merged"]["b"], prompts[0], TOKENS)[0]
    assert streamed[1] == torch_greedy(setup["merged"][None], prompts[1], TOKENS)[0]


def test_own_model_gets_adapters_through_ll_dense(setup):
    """examples/own_model.py's decoder (its projections through `ll.dense(..., lora=)`)
    with the tiny Llama's weights runs the same PEFT adapters: its rows equal the merged
    models' tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import own_model

    module = own_model.from_llama(setup["model"])
    c = setup["model"].config
    model = ll.from_nnx(module, vocab_size=c.vocab_size, max_length=64)
    table = ll.load_adapter(module, setup["dir"] / "a", name="a")
    table = ll.load_adapter(module, setup["dir"] / "b", name="b", adapters=table)
    prompts = random_prompts(160, [5, 7, 4], 8)
    out = ll.generate(
        model, prompts, adapters=table, adapter=ROWS, temperature=0, max_new_tokens=TOKENS,
        ignore_eos=True,
    )  # fmt: skip
    for row, (prompt, name) in enumerate(zip(prompts, ROWS, strict=True)):
        assert out.token_ids[row] == torch_greedy(setup["merged"][name], prompt, TOKENS)[0]


@pytest.mark.slow  # one more program set; the verification pass is one call's rows=
def test_speculative_rows_verify_under_their_adapters(setup):
    """A draft model (the base, without adapters) under strict acceptance: the rows'
    tokens are plain decoding's under their adapters (the target verifies with them)."""
    model, table = setup["model"], setup["table"]
    prompts = random_prompts(160, [6, 7], 9)
    keywords = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True, adapter=["a", "b"])
    plain = ll.generate(model, prompts, adapters=table, **keywords)
    draft = ll.DraftModel(model=model, num_draft=2, cycle_cost=1.0, min_acceptance=0.0)
    fast = ll.generate(model, prompts, adapters=table, speculative=draft, **keywords)
    assert fast.token_ids == plain.token_ids
    assert sum(r["drafted"] for r in fast.speculation) > 0  # drafts were verified


@pytest.mark.slow  # one more program set (the draft's passes under its table)
def test_a_draft_under_its_own_adapters_drafts_each_rows_adapter(setup):
    """`DraftModel(adapters=)`: the draft (here the target itself) holds "a" only. Row "a"
    drafts under "a", so the target under "a" accepts every draft (greedy: the same
    model and adapter) and the row takes the fewest cycles any draft could: 7 tokens after
    the prefill's first, 3 a cycle (2 drafts and the target's own). Row "b" drafts under
    the draft's base and takes more; the tokens are plain decoding's under each row's
    adapter (strict acceptance). Drafting row "a" without its adapter accepted none."""
    model, table = setup["model"], setup["table"]
    prompts = random_prompts(160, [6, 7], 9)
    keywords = dict(temperature=0, max_new_tokens=8, ignore_eos=True, adapter=["a", "b"])
    plain = ll.generate(model, prompts, adapters=table, **keywords)
    draft_table = ll.load_adapter(model, setup["dir"] / "a", name="a")
    draft = ll.DraftModel(
        model=model, adapters=draft_table, num_draft=2, cycle_cost=1.0, min_acceptance=0.0
    )
    fast = ll.generate(model, prompts, adapters=table, speculative=draft, **keywords)
    assert fast.token_ids == plain.token_ids
    a, b = fast.speculation
    assert a["proposed"] == a["cycles"] == 3 and a["accepted"] == 7 - 3, a
    assert b["cycles"] > 3, b


def test_a_jobs_draft_drafts_each_requests_adapter(setup):
    """`generate_many` with `DraftModel(adapters=)` (holding "a" only), requests under "a",
    "b" and the base through 2 slots with refills: each request's tokens are plain
    decoding's under its adapter, and each "a" request drafts under "a" (every draft
    accepted: the fewest cycles, as in `generate`) whichever slot it lands in and
    whatever held the slot before; the others draft under the draft's base (the target's:
    the base's drafts are all accepted too, "b"'s are not)."""
    model, table = setup["model"], setup["table"]
    prompts = random_prompts(160, [6, 7, 5, 6, 7], 9)
    names = ["b", "a", None, "a", "b"]
    keywords = dict(temperature=0, max_new_tokens=8, ignore_eos=True)
    plain = ll.generate(model, prompts, adapters=table, adapter=names, **keywords)
    draft_table = ll.load_adapter(model, setup["dir"] / "a", name="a")
    draft = ll.DraftModel(
        model=model, adapters=draft_table, num_draft=2, cycle_cost=1.0, min_acceptance=0.0
    )
    requests = [ll.Request(p, adapter=n) for p, n in zip(prompts, names, strict=True)]
    out = ll.generate_many(model, requests, adapters=table, speculative=draft, slots=2,
                           chunk_steps=2, **keywords)  # fmt: skip
    assert [r.token_ids[0] for r in out] == plain.token_ids
    for r, name in zip(out, names, strict=True):
        (spec,) = r.speculation
        if name == "b":  # drafted under the draft's base
            assert spec["cycles"] > 3, (name, spec)
        else:  # "a" under "a"; the base under the draft's base, which is the target's
            assert spec["proposed"] == spec["cycles"] == 3 and spec["accepted"] == 4, spec


def test_draft_adapters_are_refused_by_name(setup):
    model, table = setup["model"], setup["table"]
    draft = ll.DraftModel(model=model, adapters=table, num_draft=2)
    with pytest.raises(ValueError, match="DraftModel.adapters runs with the call's adapters="):
        ll.generate(model, [[3, 4, 5]], speculative=draft, max_new_tokens=2)
    with pytest.raises(ValueError, match="DraftModel.adapters runs with the call's adapters="):
        ll.generate_many(model, [[3, 4, 5]], speculative=draft, max_new_tokens=2, slots=1)
    other = ll.Adapters.create(sites={(0, "q_proj"): (64, 64)})
    bad = ll.DraftModel(model=model, adapters=other, num_draft=2)
    with pytest.raises(ValueError, match="DraftModel.adapters was made for another model"):
        ll.generate(model, [[3, 4, 5]], adapters=table, speculative=bad, max_new_tokens=2)


@pytest.mark.slow  # the tiny Llama above is the default twin
@pytest.mark.parametrize("case", ["shipped", "qwen2", "gemma2", "mixtral"])
def test_other_families_equal_peft_merged(case, tmp_path):
    """The shipped model (float32, tied embeddings), Qwen2 (q/k/v biases), Gemma 2 (its
    norms, soft-capping, sliding windows) and Mixtral (attention targets: its experts take
    no adapters) under two adapters and the base in one batch, against transformers with
    each adapter merged."""
    if case == "shipped":
        from transformers import AutoModelForCausalLM

        shipped = Path(ll.__file__).parent / "models" / "tiny"
        base = AutoModelForCausalLM.from_pretrained(shipped, dtype="float32").eval()
    else:
        base = build_hf_model(case)
    save_hf_model(base, tmp_path / "base")
    targets = ATTENTION if case == "mixtral" else TARGETS
    merged = {
        "a": make_adapter(base, tmp_path / "a", rank=8, alpha=16, seed=1, targets=targets),
        "b": make_adapter(base, tmp_path / "b", rank=16, alpha=8, seed=2, targets=targets),
        None: base,
    }
    model = ll.load_pretrained(str(tmp_path / "base"))
    table = ll.load_adapter(model, tmp_path / "a", name="a")
    table = ll.load_adapter(model, tmp_path / "b", name="b", adapters=table)
    prompts = random_prompts(model.config.vocab_size, [5, 7, 4], 0)
    out = ll.generate(
        model, prompts, adapters=table, adapter=ROWS, temperature=0, max_new_tokens=TOKENS,
        ignore_eos=True,
    )  # fmt: skip
    for row, (prompt, name) in enumerate(zip(prompts, ROWS, strict=True)):
        tokens, logprobs = torch_greedy(merged[name], prompt, TOKENS)
        assert out.token_ids[row] == tokens, (case, row, name)
        np.testing.assert_allclose(out.raw_logprobs[row], logprobs, rtol=0, atol=ATOL)


def _rollout(setup, rows):
    prompts = random_prompts(160, [5, 6], 10)
    out = ll.generate(
        setup["model"], prompts, adapters=setup["table"], adapter=rows, temperature=0,
        max_new_tokens=TOKENS, ignore_eos=True, deterministic=True,
    )  # fmt: skip
    return ll.rollout_batch(out)


def _token_logprobs(setup, batch, rows, table=None):
    adapters = setup["table"] if table is None else table
    return ll.token_logprobs(
        setup["model"], batch.token_ids, batch.prompt_lengths, lengths=batch.lengths,
        adapters=adapters, adapter=rows,
    )  # fmt: skip


def test_token_logprobs_under_adapters_equal_the_rollout(setup):
    """`token_logprobs` under each row's adapter: the rollout's raw log-probs bit for bit
    (deterministic=True)."""
    rows = ["a", None]
    batch = _rollout(setup, rows)
    got = _token_logprobs(setup, batch, rows)
    assert np.array_equal(np.asarray(got.raw_logprobs), batch.raw_logprobs)


@pytest.mark.slow  # a backward program; the default twin is the test above
def test_token_logprobs_differentiate_the_adapter_table(setup):
    """The gradient with respect to the table reaches the adapters the rows use only and
    matches a central difference along it."""
    rows, table = ["a", None], setup["table"]
    batch = _rollout(setup, rows)

    def loss(t):
        adapted = dataclasses.replace(table, table=t)
        return _token_logprobs(setup, batch, rows, adapted).raw_logprobs.sum()

    grad = jax.grad(loss)(table.table)
    a, b = grad.sites["0.q_proj"]  # [K, slots * rank], [slots * rank, N]
    rank = table.max_rank
    assert np.abs(np.asarray(b[:rank])).max() > 0  # slot 0, "a": used by row 0
    assert np.abs(np.asarray(b[rank:])).max() == 0  # "b" (slot 1) and the empty slots
    norm = np.sqrt(sum(float(np.vdot(g, g)) for g in jax.tree.leaves(grad)))
    eps = 1e-4  # a central difference along the gradient: its slope is the gradient's norm

    def step(e):
        return jax.tree.map(lambda t, g: t + e * g / norm, table.table, grad)

    slope = (loss(step(eps)) - loss(step(-eps))) / (2 * eps)
    np.testing.assert_allclose(float(slope), norm, rtol=0.02)


def test_beam_search_under_adapters_equals_transformers_on_the_merged_models(setup):
    """Each prompt's beams under its adapter: transformers' beam search on the merged
    model (no stop token: every beam runs `TOKENS` tokens)."""
    prompts = random_prompts(160, [5, 7, 4], 11)
    ours = ll.beam_search(
        setup["model"], prompts, num_beams=3, max_tokens=TOKENS, num_return_sequences=3,
        ignore_eos=True, adapters=setup["table"], adapter=ROWS,
    )  # fmt: skip
    for prompt, name, beams in zip(prompts, ROWS, ours, strict=True):
        with torch.no_grad():
            out = setup["merged"][name].generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, num_beams=3, num_return_sequences=3, max_new_tokens=TOKENS,
                min_new_tokens=TOKENS, eos_token_id=None, pad_token_id=0,
                return_dict_in_generate=True, output_scores=True,
            )  # fmt: skip
        seqs = out.sequences[:, len(prompt) :].tolist()
        assert [b.token_ids for b in beams] == seqs, name
        np.testing.assert_allclose([b.score for b in beams], out.sequences_scores, atol=ATOL)


@pytest.mark.slow  # another model's programs; the products are `layers.dense`'s either way
def test_an_int8_base_takes_float_adapters(setup):
    """QLoRA's layout: an int8 base with float adapters. Under adapter "a" its scores are
    the float model's under "a" within the int8 base's own error, and far from its base's."""
    quantized = ll.load_pretrained(str(setup["dir"] / "base"), quantize="int8")
    table = ll.load_adapter(quantized, setup["dir"] / "a", name="a")
    prompts = random_prompts(160, [5, 7], 12)
    conts = random_prompts(160, [4, 4], 13)

    def raw(model, adapters, names):
        got = ll.score(model, prompts, conts, adapters=adapters, adapter=names)
        return np.asarray([r.raw_logprobs for r in got])

    float_a = raw(setup["model"], setup["table"], ["a", "a"])
    float_base = raw(setup["model"], setup["table"], [None, None])
    int8_a, int8_base = raw(quantized, table, ["a", "a"]), raw(quantized, table, [None, None])
    base_error = np.abs(int8_base - float_base).max()
    assert np.abs(int8_a - float_a).max() < 3 * base_error + 1e-3
    assert np.abs(int8_a - int8_base).max() > 10 * base_error
