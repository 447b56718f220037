"""Accuracy of int8 / int4 weights against the float model, for the shipped model and a
small random checkpoint of each registered family.

Teacher-forced over 64 windows (`quantization_accuracy.compare`): greedy-token agreement
(the fraction of positions whose argmax is the float model's), mean KL(float || quant) of
the next-token distribution, perplexity float vs quant. For the shipped model the windows
are its held-out text (the validation topics of scripts/train_tiny.py, never trained on),
and a free-run row is added: 64 prompts (each window's first 16 tokens), 16 greedy tokens
each from the float and the quantized model, the fraction of positions with the same token
(a row diverges for good after its first difference, so this is lower than teacher-forced).

The random checkpoints (tests/models/tiny_checkpoints.py) run on 64 random token windows:
their distributions are near uniform (`entropy` near 1 of log V), so argmax agreement there
mostly measures ties broken by noise; the shipped (trained) model is the meaningful row.
Both models run in float32, so the numbers are the quantization's error alone.

Run: PYTHONPATH=$PWD python scripts/bench_quant_accuracy.py [--families llama,gpt2] [--no-free-run]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import logitloop as ll
from logitloop.models.quantization_accuracy import compare

ROOT = Path(__file__).resolve().parents[1]
WINDOWS, LENGTH = 64, 48  # windows of LENGTH + 1 tokens
FORMATS = (("int8", 128), ("int4", 32))
FREE_RUN_PROMPT, FREE_RUN_TOKENS = 16, 16


def held_out_windows(tokenizer, count: int = WINDOWS, length: int = LENGTH) -> np.ndarray:
    """`[count, length + 1]` token windows of the shipped model's held-out text: the help
    topics scripts/train_tiny.py kept for validation, tokenized together and cut into
    consecutive windows."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_tiny import corpus

    _, validation = corpus(seed=0, val_fraction=0.05)  # train_tiny's defaults
    ids = tokenizer.encode("\n\n".join(validation))
    if len(ids) < count * (length + 1):
        raise ValueError(f"held-out text has {len(ids)} tokens, need {count * (length + 1)}")
    return np.asarray(ids[: count * (length + 1)], np.int32).reshape(count, length + 1)


def free_run_agreement(float_model, quantized, windows: np.ndarray) -> float:
    """The fraction of greedy positions where the quantized model's free-run token equals
    the float model's, from each window's first `FREE_RUN_PROMPT` tokens."""
    prompts = [w[:FREE_RUN_PROMPT].tolist() for w in windows]
    knobs = dict(temperature=0.0, max_new_tokens=FREE_RUN_TOKENS, ignore_eos=True)
    a = ll.generate(float_model, prompts, **knobs).token_ids
    b = ll.generate(quantized, prompts, **knobs).token_ids
    # ignore_eos: every row has FREE_RUN_TOKENS tokens
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return float(np.mean([x == y for x, y in pairs]))


def row(name: str, fmt: str, group: int, m: dict, free: float | None = None) -> str:
    free_text = "-" if free is None else f"{free:.3f}"
    return (
        f"| {name} | {fmt} g{group} | {m['agreement']:.3f} | {free_text} | {m['kl']:.2e} | "
        f"{m['ppl_reference']:.2f} | {m['ppl_candidate']:.2f} | {m['ppl_ratio']:.4f} | "
        f"{m['entropy_fraction']:.2f} |"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="all", help="comma list of tiny_checkpoints cases")
    parser.add_argument("--no-free-run", action="store_true")
    args = parser.parse_args()
    print(
        "| model | format | agree (teacher-forced) | agree (free-run) | mean KL | ppl float | "
        "ppl quant | ratio | entropy / log V |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    float_model = ll.load_pretrained(dtype=jnp.float32)
    windows = held_out_windows(float_model.tokenizer)
    for fmt, group in FORMATS:
        quantized = ll.load_pretrained(dtype=jnp.float32, quantize=fmt, group_size=group)
        m = compare(float_model, quantized, windows)
        free = None if args.no_free_run else free_run_agreement(float_model, quantized, windows)
        print(row("shipped (held-out text)", fmt, group, m, free), flush=True)

    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from tiny_checkpoints import CASES, build_hf_model, save_hf_model

    cases = list(CASES) if args.families == "all" else args.families.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            folder = save_hf_model(build_hf_model(case), Path(tmp) / case)
            reference = ll.load_pretrained(folder, dtype=jnp.float32)
            vocab = reference.config.vocab_size
            tokens = np.random.default_rng(0).integers(3, vocab, (WINDOWS, 33), np.int32)
            for fmt, group in FORMATS:
                try:
                    quantized = ll.load_pretrained(
                        folder, dtype=jnp.float32, quantize=fmt, group_size=group
                    )
                except ValueError as e:  # a shape int4's group does not divide
                    print(f"| {case} (random) | {fmt} g{group} | refused: {e} |")
                    continue
                print(row(f"{case} (random)", fmt, group, compare(reference, quantized, tokens)))


if __name__ == "__main__":
    main()
