"""Classifier-free guidance (issue 72): each guided row's tokens and next-token
distribution equal transformers' `generate(guidance_scale=..., negative_prompt_ids=...)`
on a tiny Llama, with and without a negative prompt, rows of one batch under different
scales beside unguided rows; new scales compile nothing; `stream`, `n > 1` and
`deterministic=True` keep those rows; bad input is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")

import logitloop as ll  # noqa: E402
from tests.models.tiny_checkpoints import build_hf_model, random_prompts, save_hf_model  # noqa: E402

TOKENS = 6
ATOL = 1e-4  # the float32 parity tests' tolerance (tests/models/test_model_parity.py)
GREEDY = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny Llama in transformers and logitloop."""
    hf = build_hf_model("llama")
    model = ll.load_pretrained(str(save_hf_model(hf, tmp_path_factory.mktemp("cfg"))))
    return hf, model


def cfg_scores(hf, ids: list[int], negative: list[int], scale: float):
    """transformers' guided scores [V] (float64) after `ids`, the negative context being
    `negative` (`UnbatchedClassifierFreeGuidanceLogitsProcessor` on full contexts)."""
    from transformers.generation.logits_process import (
        UnbatchedClassifierFreeGuidanceLogitsProcessor,
    )

    with torch.no_grad():
        cond = hf(torch.tensor([ids])).logits[:, -1]
        cfg = UnbatchedClassifierFreeGuidanceLogitsProcessor(
            scale, hf, unconditional_ids=torch.tensor([negative]), use_cache=False
        )
        return cfg(torch.tensor([ids]), cond)[0].double()


def hf_generate(hf, prompt: list[int], scale: float | None, negative: list[int] | None):
    kw = {} if negative is None else dict(negative_prompt_ids=torch.tensor([negative]))
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), guidance_scale=scale, max_new_tokens=TOKENS,
            do_sample=False, eos_token_id=None, pad_token_id=0, **kw,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_rows_equal_transformers(setup):
    """Rows of one batch: a negative prompt at scale 2, the default negative (the last
    prompt token) at 3, unguided, and a negative prompt at 0.5 (a scale below 1)."""
    hf, model = setup
    prompts = random_prompts(160, [6, 4, 7, 5], 0)
    negatives = random_prompts(160, [4, 9, 3], 1)
    scales = [2.0, 3.0, None, 0.5]
    negative = [negatives[0], None, None, negatives[2]]
    out = ll.generate(model, prompts, guidance_scale=scales, negative_prompt=negative, **GREEDY)
    for r, prompt in enumerate(prompts):
        want = hf_generate(hf, prompt, scales[r], negative[r])
        assert out.token_ids[r] == want, r
        if scales[r] is not None:  # raw_logprobs: the guided scores' log-softmax
            ids, neg = list(prompt), list(negative[r] or prompt[-1:])
            for t in want:
                lp = cfg_scores(hf, ids, neg, scales[r]).log_softmax(-1)
                np.testing.assert_allclose(out.raw_logprobs[r][len(ids) - len(prompt)],
                                           float(lp[t]), rtol=0, atol=ATOL)  # fmt: skip
                ids.append(t)
                neg.append(t)


def test_sampled_distribution_equals_transformers(setup):
    """Each sampled token's log-probability under the final distribution equals
    transformers' (guidance, then the repetition penalty, temperature and top-k on the
    guided scores), at every step; a different scale and filters per row. (The penalty
    is what sees the guided scores' log-softmax: a shift of a row changes nothing else.)"""
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    hf, model = setup
    prompts = random_prompts(160, [5, 8], 2)
    negative = random_prompts(160, [3], 3)[0]
    rows = [
        dict(scale=1.5, temperature=0.7, top_k=20, repetition_penalty=1.3),
        dict(scale=4.0, temperature=1.3, top_k=0, repetition_penalty=1.0),
    ]
    out = ll.generate(
        model, prompts, guidance_scale=[r["scale"] for r in rows], negative_prompt=negative,
        **{k: [r[k] for r in rows] for k in ("temperature", "top_k", "repetition_penalty")},
        seed=[5, 6], max_new_tokens=TOKENS, ignore_eos=True,
    )  # fmt: skip
    for r, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        ids, neg = list(prompt), list(negative)
        for j, t in enumerate(out.token_ids[r]):
            scores = cfg_scores(hf, ids, neg, row["scale"])[None].float()
            penalty = RepetitionPenaltyLogitsProcessor(row["repetition_penalty"])
            scores = penalty(torch.tensor([ids]), scores)
            scores = TemperatureLogitsWarper(row["temperature"])(None, scores)
            if row["top_k"]:
                scores = TopKLogitsWarper(row["top_k"])(None, scores)
            lp = scores[0].double().log_softmax(-1)
            np.testing.assert_allclose(out.logprobs[r][j], float(lp[t]), rtol=0, atol=ATOL)
            ids.append(t)
            neg.append(t)


@pytest.mark.slow  # 1024 rows: a row bucket of its own (~10 s to compile)
def test_first_token_draws_follow_transformers(setup):
    """Chi-square: 512 rows of one guided prompt with seeds 0..511 draw their first token
    from transformers' guided distribution."""
    hf, model = setup
    prompt, negative = random_prompts(160, [6, 4], 4)
    draws = 512
    out = ll.generate(
        model, [prompt] * draws, guidance_scale=2.5, negative_prompt=negative,
        seed=list(range(draws)), max_new_tokens=1, ignore_eos=True,
    )  # fmt: skip
    probs = cfg_scores(hf, prompt, negative, 2.5).softmax(-1).numpy()
    observed = np.bincount([t[0] for t in out.token_ids], minlength=probs.size)
    expected = probs * draws
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3


def test_new_scales_and_negative_prompts_compile_nothing(setup, compile_counter):
    _, model = setup
    prompts = random_prompts(160, [6, 4, 7], 5)
    first = ll.generate(
        model, prompts, guidance_scale=[2.0, None, 1.5], negative_prompt=[[5, 6], None, [7]],
        **GREEDY,
    )  # fmt: skip
    with compile_counter as c:
        again = ll.generate(
            model, prompts, guidance_scale=[0.5, None, 4.0],
            negative_prompt=[[9, 10, 11], None, None], **GREEDY,
        )  # fmt: skip
    assert c.count == 0
    assert again.token_ids[1] == first.token_ids[1]  # the unguided row
    assert again.token_ids[0] != first.token_ids[0]


def test_a_guided_row_and_its_negative_row_stop_together(setup):
    """A guided row that stops early (its max_tokens, or a stop token) ends its negative
    row with it; the rows after it run on, equal to transformers."""
    hf, model = setup
    prompts = random_prompts(160, [6, 4, 7], 8)
    want = [hf_generate(hf, p, 2.0, None) for p in prompts]
    out = ll.generate(
        model, prompts, guidance_scale=2.0, max_new_tokens=[2, TOKENS, TOKENS],
        stop_token_ids=[[], [want[1][2]], []], temperature=0, ignore_eos=True,
    )  # fmt: skip
    assert out.token_ids[0] == want[0][:2]
    assert out.finish_reason[0] == "length"
    stop = want[1].index(want[1][2]) + 1
    assert out.token_ids[1] == want[1][:stop] and out.finish_reason[1] == "stop"
    assert out.token_ids[2] == want[2]


@pytest.mark.slow  # the adapters' programs (~15 s to compile)
def test_a_negative_row_runs_under_its_rows_adapter(setup, tmp_path):
    """A guided row under a LoRA adapter equals transformers' guidance on the merged
    model: both its scores come from the adapted model."""
    pytest.importorskip("peft")
    from tests.lora.peft_adapters import make_adapter

    hf, model = setup
    merged = make_adapter(hf, tmp_path / "a", rank=8, alpha=16, seed=1)
    table = ll.load_adapter(model, tmp_path / "a", name="a")
    prompts = random_prompts(160, [6, 5], 9)
    negative = random_prompts(160, [4], 10)[0]
    out = ll.generate(
        model, prompts, adapters=table, adapter=["a", None], guidance_scale=2.0,
        negative_prompt=negative, **GREEDY,
    )  # fmt: skip
    assert out.token_ids[0] == hf_generate(merged, prompts[0], 2.0, negative)
    assert out.token_ids[1] == hf_generate(hf, prompts[1], 2.0, negative)


def _rows(setup):
    """Two prompts, the first guided by a negative prompt at scale 2, and its tokens from
    transformers."""
    hf, _ = setup
    prompts = random_prompts(160, [6, 4], 6)
    negative = random_prompts(160, [5], 7)[0]
    keywords = dict(guidance_scale=[2.0, None], negative_prompt=[negative, None], **GREEDY)
    return prompts, negative, keywords, hf_generate(hf, prompts[0], 2.0, negative)


def test_stream_keeps_the_guided_rows(setup):
    prompts, _, keywords, want = _rows(setup)
    events = list(ll.stream(setup[1], prompts, chunk_steps=2, **keywords))
    assert [t for e in events if e.row == 0 for t in e.token_ids] == want
    assert [e.finish_reason for e in events if e.finish_reason] == ["length", "length"]


@pytest.mark.slow  # the paged pool's programs (~20 s to compile on 2 loaded cores)
def test_n_samples_each_get_their_own_negative_row(setup):
    prompts, _, keywords, want = _rows(setup)
    forked = ll.generate(setup[1], prompts, n=2, **keywords)
    assert forked.token_ids[0] == forked.token_ids[1] == want


@pytest.mark.slow  # the fixed-order programs at two row buckets (~45 s to compile)
def test_deterministic_guided_row_bits_do_not_depend_on_the_batch(setup):
    prompts, negative, _, want = _rows(setup)
    model = setup[1]
    alone = ll.generate(
        model, prompts[:1], guidance_scale=2.0, negative_prompt=negative,
        deterministic=True, **GREEDY,
    )  # fmt: skip
    mixed = ll.generate(
        model, [prompts[1], prompts[0]], guidance_scale=[None, 2.0],
        negative_prompt=[None, negative], deterministic=True, **GREEDY,
    )  # fmt: skip
    assert alone.token_ids[0] == mixed.token_ids[1] == want
    bits = [np.asarray(x, np.float32) for x in (alone.raw_logprobs[0], mixed.raw_logprobs[1])]
    assert np.array_equal(*bits)


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(guidance_scale=float("nan")), "guidance_scale = nan is not finite"),
        (dict(guidance_scale=[1.5, float("inf")]), r"guidance_scale\[1\] = inf is not finite"),
        (dict(guidance_scale="2"), "guidance_scale must be a finite number"),
        (dict(guidance_scale=[2.0, 2.0, 2.0]), "guidance_scale has 3 entries for 2 prompts"),
        (dict(negative_prompt=[4, 5]), "negative_prompt= is given without guidance_scale="),
        (
            dict(guidance_scale=[2.0, None], negative_prompt=[[4], [5]]),
            r"negative_prompt\[1\] is given but guidance_scale\[1\] is None",
        ),
        (dict(guidance_scale=2.0, negative_prompt=[[4], [999]]), r"negative_prompt\[1\] holds"),
        (dict(guidance_scale=2.0, negative_prompt=[4] * 130), "over the model's context"),
        (
            dict(guidance_scale=2.0, steer=[None] * 3),
            "steer= must be an ll.Steer for every prompt or a list of 2 entries",
        ),
    ],
)
def test_bad_input_is_refused_by_name(setup, keywords, message):
    _, model = setup
    with pytest.raises(ValueError, match=message):
        ll.generate(model, [[3, 4], [5, 6]], **keywords)


def test_entry_points_without_guidance_refuse_it(setup):
    _, model = setup
    with pytest.raises(NotImplementedError, match="guidance_scale= and negative_prompt= run in"):
        ll.precompile(model, rows=1, prompt_len=4, max_tokens=4, guidance_scale=2.0)
    with pytest.raises(TypeError, match="guidance_scale"):
        ll.score(model, [[3, 4]], [[5]], guidance_scale=2.0)
    with pytest.raises(NotImplementedError, match="does not run with speculative="):
        ll.generate(model, [[3, 4]], guidance_scale=2.0, speculative=ll.PromptLookup())
