"""LoRA adapters per row against the base model, side by side in one run (issue 71).

    python scripts/bench_lora.py
    python scripts/bench_lora.py --model path/to/hf --rows 8 --adapters 4 --rank 16

Greedy `generate` of `--rows` rows, `--new-tokens` new tokens each, three turns in
alternation after a warm-up each: the base model (no adapters), the same rows over
`--adapters` random adapters of rank `--rank` on every attention and MLP projection (rows
assigned round-robin; two tables holding the adapters in other slots, built before the
timing, alternate from call to call, which must compile nothing), and the base again (the
control: the noise the ratio is read against). Prints
tokens per second, the ratio adapters / base (the issue's goal: at least 0.8), the
programs the timed calls compiled, and the bytes: of one adapter (its A and B) and of the
table (`max_adapters` slots of rank `max_rank`, padded). `--out` writes the JSON.

`--many`: the same turns through `generate_many` (`--rows` slots), each request bringing
its adapter as `Request(prompt, adapter=(name, tensors))`, loaded into the running job's
empty table when the request is read (the timed calls must compile nothing).
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

NAME = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"
PARTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
PARTS |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def random_adapter(model, rank: int, seed: int) -> dict:
    """PEFT-named tensors of a rank-`rank` adapter on every projection of the model."""
    rng = np.random.default_rng(seed)
    out = {}
    for (layer, target), (k, n) in model.lora_sites().items():
        part = PARTS[target]
        out[NAME.format(layer, part, target, "A")] = rng.normal(0, 0.05, (rank, k))
        out[NAME.format(layer, part, target, "B")] = rng.normal(0, 0.05, (n, rank))
    return out


def main(argv=None) -> dict:
    parser = decode_parser(__doc__)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--many", action="store_true", help="generate_many (docstring)")
    args = parser.parse_args(argv)

    model = ll.load_pretrained(args.model) if args.model else ll.load_pretrained()
    config = {"peft_type": "LORA", "r": args.rank, "lora_alpha": 2 * args.rank}
    adapters = [random_adapter(model, args.rank, seed) for seed in range(args.adapters)]

    def table(offset: int) -> ll.Adapters:
        t = ll.Adapters.create(model, max_adapters=args.adapters, max_rank=args.rank)
        for i, tensors in enumerate(adapters):
            t = t.load(tensors, name=f"a{(i + offset) % args.adapters}", config=config)
        return t

    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(3, vocab, args.prompt).tolist() for _ in range(args.rows)]
    names = [f"a{r % args.adapters}" for r in range(args.rows)]
    keywords = dict(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    turn = iter(range(10**9))

    tables = [table(0), table(1)]  # built before timing; the timed calls alternate them

    def adapted():
        tab = tables[next(turn) % 2]
        return ll.generate(model, prompts, adapters=tab, adapter=names, **keywords)

    def base():
        return ll.generate(model, prompts, **keywords)

    if args.many:
        job = dict(slots=args.rows, max_prompt_len=args.prompt, max_tokens_bound=args.new_tokens)
        job.update(keywords)

        def adapted():
            brought = [(n, (adapters[int(n[1:])], config)) for n in names]
            requests = [ll.Request(p, adapter=a) for p, a in zip(prompts, brought, strict=True)]
            empty = ll.Adapters.create(model, max_adapters=args.adapters, max_rank=args.rank)
            return ll.generate_many(model, requests, adapters=empty, **job)

        def base():
            return ll.generate_many(model, prompts, **job)

    results = timed_turns(dict(base=base, adapters=adapted, control=base), args.repeats)
    tokens = args.rows * args.new_tokens
    t = tables[0]
    table_bytes = sum(x.nbytes for x in jax.tree.leaves(t.table))
    itemsize = jax.tree.leaves(t.table)[0].dtype.itemsize
    adapter_bytes = sum(args.rank * (k + n) * itemsize for k, n in model.lora_sites().values())
    setup = vars(args) | {"dtype": str(model.dtype), "device": jax.devices()[0].platform}
    report = rate_report(results, tokens, "base", setup)
    report["ratio"] = report["adapters"]["ratio"]
    report["control_ratio"] = report["control"]["ratio"]
    report["adapter_bytes"], report["table_bytes"] = adapter_bytes, table_bytes
    print_rates(report, ("base", "adapters", "control"), args.out)
    print(f"adapters / base: {report['ratio']:.3f} (control {report['control_ratio']:.3f})")
    print(f"one adapter: {adapter_bytes / 2**20:.2f} MiB; the table: {table_bytes / 2**20:.2f} MiB")
    return report


if __name__ == "__main__":
    main()
