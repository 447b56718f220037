"""Capture and steering against a plain decode, side by side in one run (issue 72).

    python scripts/bench_inside.py
    python scripts/bench_inside.py --model path/to/hf --rows 8 --new-tokens 64
    python scripts/bench_inside.py --layers 16   # the shipped model's shape, 16 random layers

Greedy `generate` of `--rows` rows, `--new-tokens` new tokens each, in turns after a
warm-up each: plain; capturing the residual stream after 2 layers (`ll.Capture(layers=(1,
L - 1))`, generated tokens only); steering every row with one vector after layer 1 (a new
random vector before each timed call, which must compile nothing); plain again (the
control: the noise the ratios are read against); and `generate_many` of twice as many
prompts through `--rows` slots (refills; `--prefix-cache off`: the contiguous slots), plain,
capturing the same 2 layers (each row's states scattered to its own column) and plain
again. `--only many,many_capture,many_control`: those turns alone (ratios to the first).
Prints decode tokens per second (new tokens over the whole call, prefill included), the
ratios to plain (the issue's goal: at least 0.9) and the programs the timed calls
compiled. `--layers N`: a Llama of the shipped model's shape and dtype with N layers of
random weights instead. `--out` writes the JSON.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from timing import (  # scripts/ is on the path when run as a script
    decode_parser,
    print_rates,
    rate_report,
    timed_turns,
)

import logitloop as ll
from logitloop.models import LlamaModel


def main(argv=None) -> dict:
    parser = decode_parser(__doc__)
    parser.add_argument("--layers", type=int, default=None, help="random layers (see above)")
    parser.add_argument("--prefix-cache", choices=("on", "off"), default="on")
    parser.add_argument("--only", default=None, help="comma-separated turns (see above)")
    args = parser.parse_args(argv)

    model = ll.load_pretrained(args.model) if args.model else ll.load_pretrained()
    if args.layers is not None:
        windows = (model.config.sliding_windows[0],) * args.layers
        config = dataclasses.replace(model.config, num_layers=args.layers, sliding_windows=windows)
        model = LlamaModel(config, dtype=model.dtype, rngs=nnx.Rngs(0))
    layers, width = model.config.num_layers, model.config.hidden_size
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, args.prompt).tolist() for _ in range(args.rows)]
    keywords = dict(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    capture = ll.Capture(layers=(1, layers - 1))

    def plain():
        return ll.generate(model, prompts, **keywords)

    def captured():
        return ll.generate(model, prompts, capture=capture, **keywords)

    def steered():
        vector = rng.normal(0, 1, width).astype(np.float32)
        return ll.generate(model, prompts, steer=ll.Steer(vector, 1, 2.0), **keywords)

    job = dict(slots=args.rows, max_tokens_bound=args.new_tokens, **keywords)
    job["prefix_cache"] = args.prefix_cache == "on"

    def many(**extra):
        return ll.generate_many(model, prompts + prompts[::-1], **job, **extra)

    fns = dict(plain=plain, capture=captured, steer=steered, control=plain, many=many,
               many_capture=lambda: many(capture=capture), many_control=many)  # fmt: skip
    if args.only:
        fns = {name: fns[name] for name in args.only.split(",")}
    results = timed_turns(fns, args.repeats)
    setup = vars(args) | {
        "dtype": str(model.dtype),
        "device": jax.devices()[0].platform,
        "layers": layers,
        "captured_layers": list(capture.layers),
    }
    tokens = {name: args.rows * args.new_tokens * (2 if "many" in name else 1) for name in fns}
    report = rate_report(results, tokens, next(iter(fns)), setup)
    print_rates(report, fns, args.out)
    return report


if __name__ == "__main__":
    main()
