"""Speculative decoding: strict acceptance reproduces `generate` token for token, rejection
acceptance reproduces its distribution, and acceptance never exceeds what exactness allows."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from scipy import stats

import logitloop as ll
from logitloop.decoding.loop import decode_loop as loop
from logitloop.decoding.loop import speculative
from logitloop.decoding.loop.runner import model_info
from logitloop.decoding.sampling.history import History

COPY_PROMPT = (
    "Return the list of words. The for statement in Python differs a bit from what you may "
    "be used to in C or Pascal. Again: The for statement in Python differs a bit"
)


@pytest.fixture(scope="module")
def model():
    return ll.load_pretrained(dtype=jnp.float32)


def _mixed_params(batch: int) -> ll.SamplingParams:
    return ll.SamplingParams.create(
        batch_size=batch,
        temperature=[0.0, 0.7, 1.0, 1.3][:batch],
        top_k=[0, 40, 0, 100][:batch],
        top_p=[1.0, 0.9, 0.95, 1.0][:batch],
        min_p=[0.0, 0.0, 0.05, 0.0][:batch],
        repetition_penalty=[1.0, 1.1, 1.0, 1.2][:batch],
        presence_penalty=[0.0, 0.0, 0.5, 0.0][:batch],
        frequency_penalty=[0.0, 0.3, 0.0, 0.0][:batch],
        logit_bias={13: -2.0},
        min_tokens=[0, 3, 0, 5][:batch],
        max_tokens=[24, 17, 20, 24][:batch],
        stop=[[], ["Pascal"], ["\n\n"], []][:batch],
        seed=[0, 1, 2, 3][:batch],
    )


def test_strict_prompt_lookup_equals_generate_token_for_token(model):
    params = _mixed_params(4)
    prompts = [COPY_PROMPT, COPY_PROMPT, "The for statement", COPY_PROMPT]
    plain = ll.generate(model, prompts, params)
    # cycle_cost 1: the batch gate open, so that the rows that draw speculate too
    lookup = ll.PromptLookup(max_ngram=3, num_draft=4, cycle_cost=1.0)
    spec = ll.generate(model, prompts, params, speculative=lookup)
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason
    np.testing.assert_allclose(
        np.concatenate(spec.logprobs), np.concatenate(plain.logprobs), atol=1e-4
    )
    assert sum(row["drafted"] for row in spec.speculation) > 0
    # Rows whose drafts all fail switch themselves off after two tries (no probe within 24).
    assert all(row["drafted"] <= 2 * 4 for row in spec.speculation if row["accepted"] == 0)


@pytest.mark.slow
def test_draft_identical_to_target_accepts_everything_at_temperature_zero(model):
    params = ll.SamplingParams.create(batch_size=2, temperature=0.0, max_tokens=[24, 17])
    prompts = ["The for statement", "A dictionary"]
    plain = ll.generate(model, prompts, params)
    spec = ll.generate(model, prompts, params, speculative=ll.DraftModel(model=model, num_draft=4))
    assert spec.token_ids == plain.token_ids
    for row, ids in zip(spec.speculation, spec.token_ids, strict=True):
        # After the prefill's token, every cycle takes all 4 drafts and its own token, the
        # last one cut short by max_tokens.
        assert row["cycles"] == -(-(len(ids) - 1) // 5)
        assert row["accepted"] >= row["drafted"] - 4


# ------------------------------------------------------------------ a bigram FunctionModel

VOCAB = 6


def _bigram_apply(table, tokens, positions, cache):
    return table[tokens], cache  # [B, T, V]: the logits depend on the token fed only


@functools.cache  # one model per seed: a FunctionModel is identity-hashed, so compiles once
def _bigram(seed: int) -> ll.FunctionModel:
    table = 2.0 * np.random.default_rng(seed).normal(size=(VOCAB, VOCAB)).astype(np.float32)
    return ll.FunctionModel(
        apply_fn=_bigram_apply,
        params=jnp.asarray(table),
        init_cache=lambda batch, length: jnp.zeros((batch,), jnp.int32),
        vocab_size=VOCAB,
        max_length=64,
    )


@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model"])
def test_rejection_matches_plain_sampling_distribution(kind):
    """Per-position chi-square (two samples, 1000 rows each) of the tokens drawn."""
    target = _bigram(0)
    rows, steps = 1000, 6
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]

    def params(seed0):
        return ll.SamplingParams.create(
            batch_size=rows,
            temperature=1.0,
            top_p=0.95,
            repetition_penalty=1.3,
            max_tokens=steps,
            seed=list(range(seed0, seed0 + rows)),
        )

    # cycle_cost 1: the batch gate open, so the drafts are tested whatever the rows gain
    knobs = dict(num_draft=3, acceptance="rejection", cycle_cost=1.0)
    spec = (
        ll.PromptLookup(**knobs, max_ngram=2, min_acceptance=0.0)
        if kind == "prompt_lookup"
        else ll.DraftModel(**knobs, model=_bigram(1))
    )
    plain = np.asarray(ll.generate(target, [prompt] * rows, params(0)).token_ids)
    result = ll.generate(target, [prompt] * rows, params(10**6), speculative=spec)
    fast = np.asarray(result.token_ids)
    assert sum(r["accepted"] for r in result.speculation) > rows / 2  # drafts were taken
    for t in range(steps):
        table = np.stack([np.bincount(x[:, t], minlength=VOCAB) for x in (plain, fast)])
        table = table[:, table.sum(axis=0) > 0]
        p_value = stats.chi2_contingency(table).pvalue
        assert p_value > 1e-3, (t, table)


def test_strict_rejection_and_plain_coincide_on_greedy_rows():
    """A greedy bigram walk soon cycles: prompt lookup then drafts it right, every time."""
    target = _bigram(0)
    params = ll.SamplingParams.create(batch_size=2, temperature=0.0, max_tokens=24)
    prompts = [[0, 1, 2, 0, 1], [3, 4]]
    plain = ll.generate(target, prompts, params).token_ids
    for acceptance in ("strict", "rejection"):
        spec = ll.PromptLookup(
            num_draft=3, acceptance=acceptance, min_acceptance=0.0, cycle_cost=1.0
        )
        result = ll.generate(target, prompts, params, speculative=spec)
        assert result.token_ids == plain
        for row in result.speculation:
            assert row["accepted"] >= 0.6 * row["drafted"]
            assert row["cycles"] < 24 / 2


def test_identical_draft_model_accepts_every_greedy_draft():
    target = _bigram(0)
    params = ll.SamplingParams.create(batch_size=2, temperature=0.0, max_tokens=[21, 14])
    prompts = [[0, 1, 2], [3]]
    plain = ll.generate(target, prompts, params).token_ids
    spec = ll.DraftModel(model=target, num_draft=4)
    result = ll.generate(target, prompts, params, speculative=spec)
    assert result.token_ids == plain
    for row, ids in zip(result.speculation, plain, strict=True):
        assert row["cycles"] == -(-(len(ids) - 1) // 5)
        assert row["accepted"] >= row["drafted"] - 4


def test_prompt_lookup_proposes_after_the_latest_longest_match():
    # Row 0: last tokens [7, 8] occur earlier twice; the latest is followed by 9, 5.
    # Row 1: only its last token (4) matches, at index 0, followed by 6.
    hist = History.create([[7, 8, 1, 7, 8, 9, 5, 7, 8], [4, 6, 4]], vocab_size=16, capacity=4)
    state = loop.DecodeState.empty(
        cache=None,
        history=hist,
        prompt_len=hist.length,
        buffer_len=4,
        num_top=0,
        window=1,
        text=0,
    )
    spec = ll.PromptLookup(max_ngram=2, num_draft=3)
    drafts, num, q, _ = spec.propose(None, state, None, None)
    assert num.tolist() == [3, 2]
    assert drafts.tolist() == [[9, 5, 7], [6, 4, -1]]
    assert q is None


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ll.PromptLookup(num_draft=0), r"num_draft = 0 is outside the allowed range"),
        (lambda: ll.PromptLookup(num_draft=9), r"num_draft = 9 is outside the allowed range"),
        (lambda: ll.PromptLookup(max_ngram=0), r"max_ngram = 0 is outside"),
        (lambda: ll.PromptLookup(acceptance="greedy"), r"acceptance = 'greedy' is not one of"),
        (lambda: ll.DraftModel(num_draft=2), r"DraftModel.model is required"),
        (
            lambda: ll.PromptLookup(num_draft=3, cycle_cost=0.5),
            r"PromptLookup.cycle_cost = 0.5 is outside the allowed range \[1.0, 4.0\]",
        ),
    ],
)
def test_bad_settings_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_numpy_numbers_are_settings_as_everywhere_else():
    spec = ll.PromptLookup(
        num_draft=np.int64(3), min_acceptance=np.float32(0.5), max_ngram=np.int32(2)
    )
    assert (spec.num_draft, spec.min_acceptance, spec.max_ngram) == (3, 0.5, 2)
    assert type(spec.num_draft) is int and type(spec.min_acceptance) is float
    with pytest.raises(ValueError, match=r"PromptLookup.num_draft must be an int, got True"):
        ll.PromptLookup(num_draft=True)


def test_bad_speculative_argument_raises():
    target = _bigram(0)
    params = ll.SamplingParams.create(batch_size=1, max_tokens=2)
    with pytest.raises(ValueError, match="speculative must be None"):
        ll.generate(target, [[1]], params, speculative="ngram")
    with pytest.raises(ValueError, match="vocab_size"):
        speculative.resolve(ll.DraftModel(model=ll.load_pretrained()), model_info(target))


def test_stream_and_generate_many_take_the_same_tokens():
    target = _bigram(0)
    spec = ll.PromptLookup(max_ngram=2, num_draft=3)
    knobs = dict(temperature=[0.0, 1.0, 0.7], top_p=[1.0, 0.9, 1.0], max_tokens=[20, 13, 17])
    params = ll.SamplingParams.create(batch_size=3, seed=[5, 6, 7], **knobs)
    prompts = [[0, 1, 2, 0, 1], [3, 4], [5, 5, 1]]
    want = ll.generate(target, prompts, params).token_ids
    got = [[] for _ in prompts]
    for event in ll.stream(target, prompts, params, chunk_steps=2, speculative=spec):
        got[event.row] += event.token_ids
    assert got == want
    requests = [
        (p, {k: v[i] for k, v in knobs.items()} | {"seed": 5 + i}) for i, p in enumerate(prompts)
    ]
    many = ll.generate_many(target, requests, slots=2, chunk_steps=3, speculative=spec)
    assert [r.token_ids[0] for r in many] == want


@pytest.mark.parametrize(
    "text, want",
    [("ngram:3:4", ("ngram", 3, 4)), ("draft:2", ("draft", 0, 2))],
)
def test_cli_parses_speculative(text, want):
    from logitloop.cli.parser import build_parser

    args = build_parser().parse_args(["generate", "x", "--speculative", text])
    assert args.speculative == want
    assert args.acceptance == "strict"


@pytest.mark.parametrize("text", ["ngram:3", "ngram:0:4", "ngram:3:9", "lookup:3:4"])
def test_cli_rejects_bad_speculative(text):
    from logitloop.cli.common import CLIError
    from logitloop.cli.parser import build_parser

    with pytest.raises(CLIError, match=r"--speculative: .*(ngram:N:K|outside the allowed)"):
        build_parser().parse_args(["generate", "x", "--speculative", text])


@pytest.mark.slow
def test_cli_speculative_prints_the_plain_text():
    import subprocess
    import sys

    base = [sys.executable, "-m", "logitloop", "generate", "The for statement", "-q"]
    base += ["--max-tokens", "16", "--temperature", "0.8", "--seed", "3"]
    plain = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    spec = subprocess.run(
        [*base, "--speculative", "ngram:3:4"], capture_output=True, text=True, check=True
    ).stdout
    assert spec == plain and plain.strip()


@struct.dataclass
class _BanByCount:
    """A stateful processor: bans token `count % V`, where count is the tokens drawn."""

    offset: jax.Array  # [B] i32

    def init(self, batch_size, vocab_size):
        return jnp.zeros((batch_size,), jnp.int32)

    def apply(self, state, logits, step):
        banned = (state + self.offset) % logits.shape[1]
        return jnp.where(jnp.arange(logits.shape[1]) == banned[:, None], -jnp.inf, logits)

    def update(self, state, tokens, step):
        return state + 1


def test_strict_keeps_processor_states_to_the_accepted_tokens():
    target = _bigram(0)
    params = ll.SamplingParams.create(
        batch_size=2, temperature=[0.0, 1.0], max_tokens=24, seed=[4, 9]
    )
    prompts = [[0, 1, 2, 0, 1], [3, 4, 3, 4]]
    procs = [_BanByCount(offset=jnp.asarray([0, 3], jnp.int32))]
    plain = ll.generate(target, prompts, params, processors=procs).token_ids
    spec = ll.PromptLookup(max_ngram=2, num_draft=3, min_acceptance=0.0, cycle_cost=1.0)
    result = ll.generate(target, prompts, params, processors=procs, speculative=spec)
    assert result.token_ids == plain
    assert sum(row["accepted"] for row in result.speculation) > 0


# ------------------------------------------------- a model that copies: acceptance is known

PERIOD, COPY_VOCAB = 5, 16


def _copy_apply(period, _, tokens, positions, cache):
    """Greedy next token at position q: the token at q + 1 - period (0 before the start).
    The cache is the row's tokens by position, so this reads the context, as a model does."""
    batch, slots = cache.shape
    cache = cache.at[jnp.arange(batch)[:, None], jnp.where(positions >= 0, positions, slots)].set(
        tokens, mode="drop"
    )
    src = positions + 1 - period
    pred = jnp.where(src >= 0, jnp.take_along_axis(cache, jnp.clip(src, 0, slots - 1), 1), 0)
    return 4.0 * jax.nn.one_hot(pred, COPY_VOCAB), cache  # [B, T, V]


@functools.cache
def _copier(period: int) -> ll.FunctionModel:
    return ll.FunctionModel(
        apply_fn=functools.partial(_copy_apply, period),
        params=jnp.zeros(()),
        init_cache=lambda batch, length: jnp.zeros((batch, length), jnp.int32),
        vocab_size=COPY_VOCAB,
        max_length=128,
    )


def _copy_prompt():
    cycle = [1, 2, 3, 4, 5]  # every n-gram of the period occurs once per period
    return cycle * 2 + cycle[:2]


@pytest.mark.parametrize("acceptance", ["strict", "rejection"])
@pytest.mark.parametrize("max_tokens", [21, 23])
def test_prompt_lookup_accepts_every_draft_of_a_model_that_copies(acceptance, max_tokens):
    """The greedy continuation of a periodic prompt is the period again; the latest earlier
    3-gram lies one period back and the 4 tokens after it are that continuation, so every
    cycle takes 4 drafts and its own token (the last one cut short by max_tokens), with the
    default per-row switch-off settings (the batch gate open: cycle_cost 1, as off CPU)."""
    target = _copier(PERIOD)
    params = ll.SamplingParams.create(batch_size=1, temperature=0.0, max_tokens=max_tokens)
    plain = ll.generate(target, [_copy_prompt()], params).token_ids
    assert plain[0][:6] == [3, 4, 5, 1, 2, 3]
    spec = ll.PromptLookup(max_ngram=3, num_draft=4, acceptance=acceptance, cycle_cost=1.0)
    result = ll.generate(target, [_copy_prompt()], params, speculative=spec)
    assert result.token_ids == plain
    cycles = -(-(max_tokens - 1) // 5)  # the prefill draws the first token
    assert result.speculation == [
        {
            "cycles": cycles,
            "proposed": cycles,
            "drafted": 4 * cycles,
            "accepted": max_tokens - 1 - cycles,
        }
    ]


def test_draft_model_catches_up_after_plain_steps():
    """An identical draft switched off after every cycle (min_acceptance 1) proposes at
    every third step only; in between the loop takes plain steps that skip the draft. Its
    drafts are right only if it was fed the tokens of those steps before it proposes."""
    target = _copier(PERIOD)
    params = ll.SamplingParams.create(batch_size=2, temperature=0.0, max_tokens=[30, 19])
    prompts = [_copy_prompt(), [6, 7, 8, 9, 10, 6]]
    plain = ll.generate(target, prompts, params).token_ids
    spec = ll.DraftModel(model=target, num_draft=4, min_acceptance=1.0, probe_every=3)
    result = ll.generate(target, prompts, params, speculative=spec)
    assert result.token_ids == plain
    for row in result.speculation:
        assert row["drafted"] >= 2 * 4 and row["cycles"] > row["drafted"] // 4  # plain steps
        assert row["accepted"] >= row["drafted"] - 4  # all but the last cycle's cut
        assert row["proposed"] * 4 == row["drafted"]  # the cycles with drafts, not the steps


def test_draft_model_rows_switch_off_when_drafts_miss():
    target, draft = _copier(PERIOD), _copier(3)  # the draft copies the wrong period
    params = ll.SamplingParams.create(batch_size=1, temperature=0.0, max_tokens=24)
    plain = ll.generate(target, [_copy_prompt()], params).token_ids
    result = ll.generate(
        target, [_copy_prompt()], params, speculative=ll.DraftModel(model=draft, num_draft=4)
    )
    assert result.token_ids == plain
    (row,) = result.speculation
    assert row["drafted"] <= 2 * 4 and row["cycles"] == 23  # off after two missed cycles


def test_a_cycle_that_costs_more_than_the_row_gains_is_not_run():
    """The per-batch gate: a draft that always misses, never switched off per row
    (min_acceptance 0), brings 1 token a cycle. A cycle costing 1 step runs every time; one
    costing 1.5 runs while the row's gain, starting at 3, decays (3 -> 2.4 -> 1.98 -> 1.69
    -> 1.48: four cycles), then plain steps, since the first probe (step 32) lies past the
    23 steps."""
    target, draft = _copier(PERIOD), _copier(3)
    params = ll.SamplingParams.create(batch_size=1, temperature=0.0, max_tokens=24)
    plain = ll.generate(target, [_copy_prompt()], params).token_ids
    drafted = {}
    for cost in (1.0, 1.5):
        spec = ll.DraftModel(model=draft, num_draft=4, min_acceptance=0.0, cycle_cost=cost)
        result = ll.generate(target, [_copy_prompt()], params, speculative=spec)
        assert result.token_ids == plain
        (row,) = result.speculation
        assert row["cycles"] == 23 and row["accepted"] == 0
        drafted[cost] = row["drafted"]
    assert drafted == {1.0: 4 * 23, 1.5: 4 * 4}


def test_the_slowest_row_decides_whether_a_cycle_runs():
    """Row 0 copies its period (5 tokens a cycle), row 1 takes the same drafts but draws at
    a temperature under which they mostly miss. With cycles costing one step the batch
    speculates every cycle; costing 2 steps, only row 0 pays: cycles run while row 1's gain
    decays from its start of 3 (3 -> 2.4 -> 1.98 with no hit), then plain steps for both
    rows (the first probe, at step 32, lies past the 23 steps)."""
    target = _copier(PERIOD)
    params = ll.SamplingParams.create(
        batch_size=2, temperature=[0.0, 3.0], max_tokens=24, seed=[0, 1]
    )
    prompts = [_copy_prompt(), _copy_prompt()]
    plain = ll.generate(target, prompts, params).token_ids
    drafted = {}
    for cost in (1.0, 2.0):
        spec = ll.PromptLookup(max_ngram=3, num_draft=4, min_acceptance=0.0, cycle_cost=cost)
        result = ll.generate(target, prompts, params, speculative=spec)
        assert result.token_ids == plain
        drafted[cost] = result.speculation
    hit, miss = drafted[1.0]
    assert hit["drafted"] >= 4 * 4 and hit["accepted"] >= hit["drafted"] - 4  # max_tokens cuts
    assert miss["accepted"] < 0.5 * miss["drafted"]
    hit_2, miss_2 = drafted[2.0]
    assert hit_2["drafted"] == miss_2["drafted"] <= 4 * 3 < hit["drafted"]
    assert hit_2["accepted"] == hit_2["drafted"]


def test_proposed_counts_the_cycles_in_which_a_row_had_drafts():
    """With the gate open and row 0 always drafting (and running longer), every iteration
    of row 1 is a cycle; row 1, whose drafts miss at a high temperature, switches off
    (min_acceptance 0.25) and sits out cycles that row 0 runs: they count in its cycles,
    not in its proposed."""
    target = _copier(PERIOD)
    params = ll.SamplingParams.create(
        batch_size=2, temperature=[0.0, 3.0], max_tokens=[96, 12], seed=[0, 1]
    )
    spec = ll.PromptLookup(max_ngram=3, num_draft=4, cycle_cost=1.0)
    hit, miss = ll.generate(target, [_copy_prompt()] * 2, params, speculative=spec).speculation
    assert hit["proposed"] == hit["cycles"] and hit["drafted"] == 4 * hit["cycles"]
    assert 0 < miss["proposed"] < miss["cycles"]


def test_default_cycle_cost_is_measured_on_cpu_and_one_elsewhere():
    lookup = ll.PromptLookup(num_draft=4)
    draft = speculative.resolve(ll.DraftModel(model=_bigram(0)), model_info(_bigram(1)))[0]
    for spec, kind in ((lookup, "lookup"), (draft, "draft")):
        want = speculative.CPU_CYCLE_COST[kind, "strict"]
        assert speculative.default_cycle_cost(spec, "cpu") == want
        assert speculative.default_cycle_cost(spec, "gpu") == 1.0
    two = ll.PromptLookup(num_draft=2)  # the part above one step scales with K
    want = 1 + (speculative.CPU_CYCLE_COST["lookup", "strict"] - 1) / 2
    assert speculative.default_cycle_cost(two, "cpu") == pytest.approx(want)
    resolved, _ = speculative.resolve(lookup, model_info(_bigram(0)))
    assert resolved.cycle_cost == speculative.default_cycle_cost(lookup, "cpu")
    mine, _ = speculative.resolve(ll.PromptLookup(cycle_cost=2.5), model_info(_bigram(0)))
    assert mine.cycle_cost == 2.5
    # probes: at most PROBE_SHARE of the steps lost, at least 32 steps apart
    assert speculative.default_probe_every(1.0) == 32
    assert speculative.default_probe_every(4.15) == 63
    assert mine.probe_every == 32 and resolved.probe_every == 32
    mine, _ = speculative.resolve(ll.PromptLookup(probe_every=5), model_info(_bigram(0)))
    assert mine.probe_every == 5


def test_a_chunk_stops_at_max_steps():
    """Plain steps and cycles both count against max_steps; none runs past it."""
    from logitloop.decoding.engine.generate import _start
    from logitloop.decoding.engine.plan import Options, plan

    target = _copier(PERIOD)
    params = ll.SamplingParams.create(batch_size=1, temperature=0.0, max_tokens=40)
    # never on but at the probe of step 4
    spec = ll.PromptLookup(max_ngram=3, num_draft=4, min_acceptance=1.0, probe_every=4)
    run = _start(target, plan(target, Options(speculative=spec)), [_copy_prompt()], params, {})
    state = loop.decode(run.plan.program, run.tables, run.state, jnp.asarray(5, jnp.int32))
    assert int(state.step) == 5
    assert int(state.speculation.cycles[0]) == 5
    assert int(state.num_tokens[0]) == 1 + 4 + 5  # prefill, 4 plain steps, one full cycle


def test_generate_many_counts_drafts_per_request():
    """Rows that never switch off run the same cycles whatever the chunks and slots, so
    generate_many's counts are generate's."""
    target = _bigram(0)
    spec = ll.PromptLookup(max_ngram=2, num_draft=3, min_acceptance=0.0, cycle_cost=1.0)
    knobs = dict(temperature=[0.0, 1.0, 0.0], max_tokens=[20, 13, 17])
    params = ll.SamplingParams.create(batch_size=3, seed=[5, 6, 7], **knobs)
    prompts = [[0, 1, 2, 0, 1], [3, 4], [5, 5, 1]]
    want = ll.generate(target, prompts, params, speculative=spec)
    requests = [
        (p, {k: v[i] for k, v in knobs.items()} | {"seed": 5 + i}) for i, p in enumerate(prompts)
    ]
    many = ll.generate_many(target, requests, slots=2, chunk_steps=3, speculative=spec)
    assert [r.token_ids[0] for r in many] == want.token_ids
    assert [r.speculation for r in many] == [[row] for row in want.speculation]
    assert sum(row["accepted"] for row in want.speculation) > 0
    assert ll.generate_many(target, requests[:1], slots=1)[0].speculation is None


def test_packaged_draft_matches_the_shipped_model_and_the_package_stays_small():
    from pathlib import Path

    package = Path(ll.__file__).parent
    draft = ll.load_pretrained(package / "models" / "tiny_draft")
    target = ll.load_pretrained()
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.num_layers < target.config.num_layers
    files = [f for f in package.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    # The shipped models (the tiny model and its draft: 9.0 MB) stay under 9.5 MB, and
    # the whole package, code included (1.3 MB in December 2026), under 12 MB: the
    # limit is on what ships as data; the code grows with the features.
    models = [f for f in files if f.parent.name in ("tiny", "tiny_draft")]
    assert sum(f.stat().st_size for f in models) < 9.5 * 10**6
    assert sum(f.stat().st_size for f in files) < 12 * 10**6
