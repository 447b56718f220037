"""Decode speed with a watermark against plain decoding, side by side in one run (issue 72).

    python scripts/bench_watermark.py
    python scripts/bench_watermark.py --model path/to/hf --rows 8 --new-tokens 128

Sampled `generate` (temperature 1, no filters) of `--rows` rows, `--new-tokens` tokens
each (stops ignored), in turns after a warm-up each: plain, the green list "lefthash",
"selfhash", SynthID (`--depth` keys, n-gram 5), and plain again (the control: the noise
the ratios are read against). Each timed watermarked call uses new keys, which must
compile nothing. Prints tokens per second, each turn over plain, and the programs the
timed calls compiled; `--out` writes the JSON.
"""

from __future__ import annotations

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
    parser.add_argument("--depth", type=int, default=30)
    args = parser.parse_args(argv)

    model = ll.load_pretrained(args.model) if args.model else ll.load_pretrained()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt).tolist() for _ in range(args.rows)]
    keywords = dict(
        max_new_tokens=args.new_tokens, ignore_eos=True, temperature=1.0, top_k=0,
        seed=list(range(args.rows)),
    )  # fmt: skip
    turn = iter(range(1, 10**9))

    def green(seeding):
        keys = [next(turn) * 7919 + r for r in range(args.rows)]
        return [ll.GreenListWatermark.create(args.rows, vocab, key=keys, seeding=seeding)]

    def synthid():
        k = next(turn)
        keys = [[k * 1000 + r * 100 + d for d in range(args.depth)] for r in range(args.rows)]
        return [ll.SynthIDWatermark.create(args.rows, keys=keys, ngram_len=5)]

    def run(processors=None):
        return lambda: ll.generate(
            model, prompts, processors=processors and processors(), **keywords
        )

    fns = dict(
        plain=run(),
        lefthash=run(lambda: green("lefthash")),
        selfhash=run(lambda: green("selfhash")),
        synthid=run(synthid),
        control=run(),
    )
    results = timed_turns(fns, args.repeats)
    setup = vars(args) | {"dtype": str(model.dtype), "device": jax.devices()[0].platform}
    report = rate_report(results, args.rows * args.new_tokens, "plain", setup)
    print_rates(report, fns, args.out)
    return report


if __name__ == "__main__":
    main()
