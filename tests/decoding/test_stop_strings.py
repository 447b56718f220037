"""Stop strings matched inside the loop, trimmed on the host, and streamed without leaks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import logitloop as ll

from .scripted import ByteTokenizer, make_model


def forced_model(pieces: list[bytes], outputs: list[list[int]]):
    """A model that emits `outputs[r]` for the prompt `forced_prompt(r, outputs)`.

    The scripted table is keyed by (token, position); giving row r a prompt of
    1 + r * span tokens puts every row's positions in a range of its own.
    """
    span = max(len(o) for o in outputs) + 1
    table = np.zeros((len(pieces), span * (len(outputs) + 1) + 64), np.int64)
    for r, out in enumerate(outputs):
        start = r * span  # position of the prompt's last token
        for i, tok in enumerate(out):
            table[0 if i == 0 else out[i - 1], start + i] = tok
    model = make_model(table)
    return ll.FunctionModel(
        model.apply_fn,
        model.params,
        model.init_cache,
        len(pieces),
        4096,
        tokenizer=ByteTokenizer(pieces),
    )


def forced_prompts(outputs: list[list[int]]) -> list[list[int]]:
    span = max(len(o) for o in outputs) + 1
    return [[0] * (1 + r * span) for r in range(len(outputs))]


def reference_stop_index(pieces, seq, stops, min_tokens=0):
    """Host-side reference: index of the first token after which the text has a stop string."""
    data = b""
    for i, tok in enumerate(seq):
        data += pieces[tok]
        if i + 1 >= min_tokens and any(s.encode() in data for s in stops):
            return i
    return None


def run(pieces, outputs, stops, include=False, max_tokens=None):
    model = forced_model(pieces, outputs)
    params = ll.SamplingParams.create(
        batch_size=len(outputs),
        temperature=0.0,
        max_tokens=max_tokens or max(len(o) for o in outputs),
        stop=stops,
        include_stop_str_in_output=include,
    )
    return ll.generate(model, forced_prompts(outputs), params), params, model


# Pieces chosen so stop strings span tokens and begin/end inside them. "é" is split in two.
PIECES = [b"a", b"b", b"aa", b"ab", b"</", b"ans", b"wer>", b"\xc3", b"\xa9", b"x\n", b"\n", b"z"]
A, B, AA, AB, LT, ANS, WER, E1, E2, XN, NL, Z = range(len(PIECES))


@pytest.mark.parametrize(
    "seq, stops, want_text, want_stop",
    [
        ([Z, LT, ANS, WER, Z], ["</answer>"], "z", "</answer>"),  # spans 3 tokens
        ([Z, Z, XN, NL, Z], ["\n\n"], "zzx", "\n\n"),  # starts inside a token
        ([Z, AB, Z], ["zab"], "", "zab"),  # spans 2 tokens, ends at a boundary
        ([Z, AA, AB, Z], ["aab"], "za", "aab"),  # "aab" inside "aaab": repeated prefix
        ([Z, A, A, A, B, Z], ["aab"], "za", "aab"),  # the same, one byte per token
        ([Z, E1, E2, Z, Z], ["éz"], "z", "éz"),  # non-ASCII split across two tokens
        ([Z, LT, ANS, Z, AB], ["ansz", "zab"], "z</", "ansz"),  # overlapping: earliest wins
        ([Z, AB, Z, Z], ["b", "zab"], "", "zab"),  # same token completes both: earliest start
        ([Z, Z, Z], ["q"], "zzz", None),  # never matches
    ],
)
def test_stop_string_cases(seq, stops, want_text, want_stop):
    res, _, _ = run(PIECES, [seq], stops)
    assert res.text[0] == want_text
    assert res.stop_reason[0] == want_stop
    want_index = reference_stop_index(PIECES, seq, stops)
    expected_tokens = len(seq) if want_index is None else want_index + 1
    assert res.num_tokens[0] == expected_tokens
    assert res.finish_reason[0] == ("length" if want_stop is None else "stop")


def test_include_stop_str_in_output():
    res, _, _ = run(PIECES, [[Z, LT, ANS, WER, Z]], ["</answer>"], include=True)
    assert res.text == ["z</answer>"]


def test_rows_with_different_stops_finish_at_different_steps():
    outputs = [[Z, Z, XN, NL, Z, Z], [A, A, A, B, Z, Z], [Z] * 6, [LT, ANS, WER, Z, Z, Z]]
    stops = [["\n\n"], ["aab", "q"], [], ["wer", "</"]]
    res, _, _ = run(PIECES, outputs, stops)
    assert res.num_tokens == [4, 4, 6, 1]
    assert res.text == ["zzx", "a", "zzzzzz", ""]
    assert res.finish_reason == ["stop", "stop", "length", "stop"]


def test_stop_string_inside_prompt_does_not_count():
    model = forced_model(PIECES, [[Z, Z, Z, Z]])
    params = ll.SamplingParams.create(batch_size=1, temperature=0.0, max_tokens=4, stop=["a"])
    res = ll.generate(model, [[A]], params)  # the prompt "a" holds the stop string
    assert res.finish_reason == ["length"] and res.text == ["zzzz"]


def test_min_tokens_delays_stop_strings():
    model = forced_model(PIECES, [[Z, NL, NL, Z, NL, NL, Z]])
    params = ll.SamplingParams.create(
        batch_size=1, temperature=0.0, max_tokens=7, stop=["\n\n"], min_tokens=4
    )
    res = ll.generate(model, [[0]], params)
    assert res.num_tokens == [6]


@st.composite
def vocab_and_case(draw):
    alphabet = [b"a", b"b", b"c", "é".encode(), "€".encode()]
    raw = draw(
        st.lists(
            st.lists(st.sampled_from(alphabet), min_size=1, max_size=3), min_size=3, max_size=10
        )
    )
    pieces = list(dict.fromkeys(b"".join(p) for p in raw))
    # Also split a multi-byte character across tokens.
    pieces += [b"\xe2", b"\x82\xac"]
    seq = draw(st.lists(st.integers(0, len(pieces) - 1), min_size=1, max_size=24))
    text = b"".join(pieces[t] for t in seq).decode("utf-8", errors="ignore")
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):
            i = draw(st.integers(0, len(text) - 1))
            j = draw(st.integers(i + 1, min(len(text), i + 5)))
            stops.append(text[i:j])
        else:
            stops.append(draw(st.text(alphabet="abcé€", min_size=1, max_size=4)))
    return pieces, seq, stops


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vocab_and_case())
def test_device_detection_matches_host_reference(case):
    pieces, seq, stops = case
    # A fixed vocabulary size and longest token keep every example on one compiled program.
    pieces = pieces + [b"z" * 8] + [b"z"] * (31 - len(pieces))
    model = forced_model(pieces, [seq])
    params = ll.SamplingParams.create(
        batch_size=1, temperature=0.0, max_tokens=len(seq), stop=[stops], vocab_size=32
    )
    res = ll.generate(model, [[0]], params)
    want = reference_stop_index(pieces, seq, stops)
    assert res.num_tokens[0] == (len(seq) if want is None else want + 1)
    # The expected text from the pieces alone: plain bytes.decode, a plain str.find cut.
    full = b"".join(pieces[t] for t in seq[: res.num_tokens[0]]).decode("utf-8", "replace")
    if want is None:
        assert res.text[0] == full
        assert res.stop_reason[0] is None and res.finish_reason[0] == "length"
    else:
        start, _, stop = min((full.find(s), -len(s), s) for s in stops if s in full)
        assert res.text[0] == full[:start]
        assert res.stop_reason[0] == stop and res.finish_reason[0] == "stop"


def _stream_rows(model, prompts, params, chunk):
    rows: dict[int, list[ll.StreamEvent]] = {}
    for ev in ll.stream(model, prompts, params, chunk_steps=chunk):
        rows.setdefault(ev.row, []).append(ev)
    return rows


@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_never_shows_a_partial_stop_and_concatenates_to_text(chunk):
    outputs = [
        [Z, LT, ANS, Z, LT, ANS, WER, Z],  # "</ans" appears, is released, then the real stop
        [Z, E1, E2, Z, E1, E2, Z, Z],  # multi-byte characters split across tokens
        [A, A, A, B, Z, Z, Z, Z],
    ]
    stops = [["</answer>"], ["zz"], ["aab"]]
    res, params, model = run(PIECES, outputs, stops, max_tokens=8)
    rows = _stream_rows(model, forced_prompts(outputs), params, chunk)
    for r in range(3):
        events = rows[r]
        assert "".join(e.text for e in events) == res.text[r]
        assert events[-1].finish_reason == res.finish_reason[r]
        assert all(e.finish_reason is None for e in events[:-1])
        shown = ""
        for e in events:
            shown += e.text
            assert "\ufffd" not in e.text  # never half a UTF-8 sequence
            assert shown == res.text[r][: len(shown)]  # never something later trimmed
            for s in stops[r]:
                assert s not in shown
