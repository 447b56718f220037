"""Your own model against logitloop's own family, on the same weights (issue 65).

    python scripts/bench_own_model.py
    python scripts/bench_own_model.py --layers 8 --new-tokens 128 --out bench_out/own_model.json

A Llama (`LlamaConfig`, random weights) decodes through logitloop's Llama family and, with
the same weights (`from_llama`), through `examples/own_model.py`'s NNX module, written
without logitloop's model code and wrapped with `ll.from_nnx`: its attention is
`ll.attention`, its products `ll.dense`. Greedy, a batch of `--batch` rows of `--prompt`
tokens, `--new-tokens` new ones, in float32 and bfloat16, on the contiguous cache (`n = 1`)
and on a paged pool (`n = 2`: half the prompts, two rows each on the prompt's pages). The
two models alternate, repeat by repeat, after a warm-up call each; the table gives the
median tokens per second of a whole call (the prompt's prefill included: keep `--prompt`
short next to `--new-tokens`), the ratio (own / family; the goal is within 5%), the
control (the family against itself, a third turn in the same run: the noise the ratio
has to be read against) and whether the two decoded the same tokens.

It also counts the lines the docs' attention-block diff changes (the ```diff blocks of
docs/own_model.md: lines added and removed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import timed_turns  # scripts/ is on the path when run as a script

import logitloop as ll
from logitloop.models import LlamaConfig, LlamaModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import own_model  # noqa: E402 - the example, importable once examples/ is on the path


def diff_lines(path: Path = ROOT / "docs" / "own_model.md") -> dict:
    """Lines added and removed by each ```diff block of the guide."""
    blocks = re.findall(r"```diff\n(.*?)```", path.read_text(), flags=re.S)
    counts = []
    for block in blocks:
        lines = block.splitlines()
        counts.append(dict(added=sum(x.startswith("+") for x in lines),
                           removed=sum(x.startswith("-") for x in lines)))  # fmt: skip
    return dict(blocks=counts, added=sum(c["added"] for c in counts),
                removed=sum(c["removed"] for c in counts))  # fmt: skip


def config(args) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=1024, rms_norm_eps=1e-5,
        tie_word_embeddings=not args.untied,
    )  # fmt: skip


def bench(args, dtype: str) -> list[dict]:
    llama = LlamaModel(config(args), dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    mine = own_model.from_llama(llama)
    own = ll.from_nnx(mine, mine.kv_spec, vocab_size=args.vocab, max_length=1024)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, args.vocab, (args.batch, args.prompt)).tolist()
    knobs = dict(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for cache, n in (("contiguous", 1), ("paged, n = 2", 2)):
        batch = prompts[: args.batch // n]
        models = (("family", llama), ("own", own), ("family again", llama))
        fns = {name: (lambda m=m, b=batch, n=n: ll.generate(m, b, n=n, **knobs))
               for name, m in models}  # fmt: skip
        got = timed_turns(fns, args.repeats)
        tok_s = {name: args.batch * args.new_tokens / got[name][0] for name in fns}
        same = got["family"][1].token_ids == got["own"][1].token_ids
        rows.append(dict(dtype=dtype, cache=cache, family_tok_s=tok_s["family"],
                         own_tok_s=tok_s["own"], ratio=tok_s["own"] / tok_s["family"],
                         control=tok_s["family again"] / tok_s["family"], same_tokens=same,
                         compiles_timed=sum(g[2] for g in got.values())))  # fmt: skip
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--untied", action="store_true", help="a separate LM head")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    rows = [row for dtype in args.dtypes for row in bench(args, dtype)]
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} "
          f"heads, vocab {args.vocab}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, greedy; median of {args.repeats}")  # fmt: skip
    print(f"{'dtype':<9} {'cache':<13} {'family tok/s':>12} {'own tok/s':>10} {'ratio':>6} "
          f"{'control':>7} {'same tokens':>11}")  # fmt: skip
    for r in rows:
        same, control = str(r["same_tokens"]), f"{r['control']:.3f}"
        print(f"{r['dtype']:<9} {r['cache']:<13} {r['family_tok_s']:>12.0f} "
              f"{r['own_tok_s']:>10.0f} {r['ratio']:>6.3f} {control:>7} "
              f"{same:>11}")  # fmt: skip
    diff = diff_lines()
    print(f"docs/own_model.md's attention-block diff: {diff['added']} lines added, "
          f"{diff['removed']} removed")  # fmt: skip
    out = dict(args={k: str(v) for k, v in vars(args).items()}, rows=rows, diff=diff)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
