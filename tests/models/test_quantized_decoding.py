"""Everything works on a quantized model: `generate`, `stream`, `score`, `generate_many` on
pages, `beam_search`, speculative decoding with a quantized target or draft and
`deterministic=True` across batches.

The anchor is independent of Qwix's product: a float model carrying the quantized
weights' float64-dequantized values (NumPy: values times scales) gives the quantized
model's logits. The rest checks each entry point against the quantized model's own greedy
`generate` (`score` through the beam test's log-likelihoods). The default case uses the
shipped draft model (2 layers, hidden 64: cheap to compile) in int4 with groups of 32; the
shipped model in int8 and int4 runs every entry point under `-m slow`."""

from pathlib import Path

import numpy as np
import pytest

qwix = pytest.importorskip("qwix", reason="quantized weights need the extra `quant` (qwix)")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import logitloop as ll  # noqa: E402
from logitloop.models import quantization  # noqa: E402
from logitloop.models.quantization_accuracy import all_logits  # noqa: E402
from tests.models.quantized_reference import dequantized as _dequantized  # noqa: E402

DRAFT = Path(ll.__file__).parent / "models" / "tiny_draft"
# token ids (the draft model ships without a tokenizer): "Once upon a time", "The
# function returns", "In the beginning"
PROMPTS = [[47, 411, 937, 265, 261, 1352], [341, 431, 941], [983, 268, 2451, 1495]]
GREEDY = dict(temperature=0.0, max_new_tokens=6)


def _float_twin(path, quantized):
    """The float model of `path` with `quantized`'s weights, dequantized, in its params."""
    twin = ll.load_pretrained(path, dtype=jnp.float32)
    q_params = dict(nnx.iter_graph(quantized))
    for key, param in nnx.iter_graph(twin):
        if isinstance(param, nnx.Param) and quantization.is_quantized(q_params[key][...]):
            value = _dequantized(q_params[key][...]).reshape(param.get_value().shape)
            param.set_value(jnp.asarray(value, jnp.float32))
    return twin


@pytest.fixture(scope="module")
def int4_draft():
    return ll.load_pretrained(DRAFT, dtype=jnp.float32, quantize="int4", group_size=32)


def test_generate_and_stream_on_a_quantized_model_match_its_dequantized_float_twin(int4_draft):
    model = int4_draft
    greedy = ll.generate(model, PROMPTS, **GREEDY)
    events = list(ll.stream(model, PROMPTS, chunk_steps=3, **GREEDY))
    streamed = [[] for _ in PROMPTS]
    for event in events:
        streamed[event.row] += event.token_ids
    assert streamed == greedy.token_ids
    # The independent anchor: the float model carrying the dequantized weights gives the
    # same logits at every position of prompt + greedy tokens (teacher-forced), so the
    # greedy tokens are its argmaxes too. Same-length rows: one [3, T] forward each.
    rows = np.asarray([(p + g)[:8] for p, g in zip(PROMPTS, greedy.token_ids, strict=True)])
    got = np.asarray(all_logits(model)(rows))
    want = np.asarray(all_logits(_float_twin(DRAFT, model))(rows))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for p, g, logits in zip(PROMPTS, greedy.token_ids, want, strict=True):
        n = min(len(g), 8 - len(p))
        assert logits[len(p) - 1 : len(p) - 1 + n].argmax(-1).tolist() == g[:n]


# The shipped model in each format: every entry point (compiles ~10 programs: -m slow).
@pytest.fixture(scope="module", params=[("int8", None), ("int4", 32)], ids=["int8", "int4"])
def shipped(request):
    fmt, group = request.param
    model = ll.load_pretrained(quantize=fmt, group_size=group)
    return model, ll.generate(model, PROMPTS, **GREEDY)


@pytest.mark.slow
def test_generate_many_on_pages_equals_generate(shipped):
    model, greedy = shipped
    requests = [(p, {"temperature": 0.0, "max_tokens": 6}) for p in PROMPTS]
    many = ll.generate_many(model, requests, slots=2, chunk_steps=3, page_size=4)
    assert [r.token_ids[0] for r in many] == greedy.token_ids


@pytest.mark.slow
def test_beam_search_scores_are_the_models_log_likelihoods(shipped):
    model, _ = shipped
    beams = ll.beam_search(model, PROMPTS, num_beams=2, max_tokens=6, ignore_eos=True)
    best = [b[0] for b in beams]
    assert all(len(b.token_ids) == 6 for b in best)
    scores = ll.score(model, PROMPTS, [b.token_ids for b in best])
    for beam, s in zip(best, scores, strict=True):
        # score = sum of log-probs / length (length_penalty 1). In
        # bfloat16 the beam's step-by-step cache and score's one pass round differently:
        # the float model's own beams differ from its scores by up to 5e-3 too.
        assert beam.score == pytest.approx(s.raw_logprob_sum / len(beam.token_ids), abs=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("target_quantized", [True, False], ids=["q-target", "float-target"])
def test_speculative_with_a_quantized_draft_keeps_the_targets_greedy_tokens(
    shipped, target_quantized
):
    model, greedy = shipped
    fmt = model.quantization.spec.format
    draft = ll.load_pretrained(DRAFT, quantize=fmt, group_size=32 if fmt == "int4" else None)
    target = model if target_quantized else ll.load_pretrained()
    want = greedy if target_quantized else ll.generate(target, PROMPTS, **GREEDY)
    spec = ll.DraftModel(model=draft, num_draft=3, cycle_cost=1.0)
    got = ll.generate(target, PROMPTS, speculative=spec, **GREEDY)
    assert got.token_ids == want.token_ids
    assert sum(row["accepted"] for row in got.speculation) > 0  # the drafts were used


@pytest.mark.slow
def test_deterministic_batch_of_five_equals_micro_batches_of_two(shipped):
    model, _ = shipped
    prompts = [*PROMPTS, [33, 535, 308], [51, 262, 3461]]
    whole = ll.generate(model, prompts, deterministic=True, **GREEDY)
    parts = [
        ll.generate(model, prompts[i : i + 2], deterministic=True, **GREEDY) for i in (0, 2, 4)
    ]
    assert sum((p.token_ids for p in parts), []) == whole.token_ids
    assert sum((p.logprobs for p in parts), []) == whole.logprobs
