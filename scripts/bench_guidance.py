"""Classifier-free guidance against plain rows, side by side in one run (issue 72).

    python scripts/bench_guidance.py
    python scripts/bench_guidance.py --model path/to/hf --rows 8 --new-tokens 64

Greedy `generate` of `--rows` rows, `--new-tokens` new tokens each, in turns after a
warm-up each: plain rows; the same rows all guided (`guidance_scale`, a negative prompt of
`--prompt` tokens each: the batch runs twice the rows; each timed call takes a new scale,
which must compile nothing); twice the rows plain (what two rows cost: a guided row's
floor); half the rows guided (the other half plain, in one batch); and the plain rows
again (the control: the noise the ratios are read against). Prints the real rows' tokens
per second, the ratio plain / guided (the issue's goal: at most 2.1x) and the programs
the timed calls compiled. `--out` writes the JSON.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
from timing import (  # scripts/ is on the path when run as a script
    decode_parser,
    print_rates,
    rate_report,
    timed_turns,
)

import logitloop as ll


def main(argv=None) -> dict:
    parser = decode_parser(__doc__)
    args = parser.parse_args(argv)

    model = ll.load_pretrained(args.model) if args.model else ll.load_pretrained()
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def prompts(count: int) -> list[list[int]]:
        return [rng.integers(3, vocab, args.prompt).tolist() for _ in range(count)]

    rows, double, negatives = prompts(args.rows), prompts(2 * args.rows), prompts(args.rows)
    keywords = dict(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    scales = itertools.cycle([1.5, 2.0, 3.0, 0.5])  # a new scale per call: data

    def plain():
        return ll.generate(model, rows, **keywords)

    def guided():
        s = next(scales)
        return ll.generate(model, rows, guidance_scale=s, negative_prompt=negatives, **keywords)

    def twice():
        return ll.generate(model, double, **keywords)

    def half():
        s = next(scales)
        some = [s if r % 2 else None for r in range(args.rows)]
        neg = [n if r % 2 else None for r, n in enumerate(negatives)]
        return ll.generate(model, rows, guidance_scale=some, negative_prompt=neg, **keywords)

    turns = dict(plain=plain, guided=guided, twice_the_rows=twice, half_guided=half)
    results = timed_turns(turns | dict(control=plain), args.repeats)
    tokens = {name: args.rows * args.new_tokens for name in results}
    tokens["twice_the_rows"] *= 2  # tokens/s of the real rows: 16 rows make twice the tokens
    setup = vars(args) | {"dtype": str(model.dtype), "device": jax.devices()[0].platform}
    report = rate_report(results, tokens, "plain", setup)
    for name in results:
        report[name]["time_over_plain"] = report[name]["seconds"] / report["plain"]["seconds"]
    print_rates(report, results, args.out)
    ratio = report["plain"]["tokens_per_s"] / report["guided"]["tokens_per_s"]
    print(f"a guided row costs {ratio:.3f}x a plain row (goal: at most 2.1x)")
    return report


if __name__ == "__main__":
    main()
