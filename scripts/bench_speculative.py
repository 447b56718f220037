"""Speculative decoding against plain `generate`: tokens/s and mean accepted length.

    python scripts/bench_speculative.py                        # shipped model, copy-heavy task
    python scripts/bench_speculative.py --task tutorial        # a passage it never saw
    python scripts/bench_speculative.py --model llama-40m      # a random 42M Llama (see below)
    python scripts/bench_speculative.py --draft shipped        # also the packaged draft model
    python scripts/bench_speculative.py --draft PATH           # ... or a draft checkpoint
    python scripts/bench_speculative.py --out bench_out/speculative.json \
        --plot bench_out/speculative.png
    python scripts/bench_speculative.py --cycle-cost --draft shipped   # what a cycle costs

For each batch size (1 and 8) and temperature (0, 0.5, 1.0, 1.5), in one process: plain
`generate`, prompt lookup (`ll.PromptLookup(max_ngram=3, num_draft=4)`) with strict and
rejection acceptance, and with `--draft` a draft model in both modes. Every variant is
compiled once first (untimed); then the repeats alternate the variants, and each cell is
the median. Every row generates exactly `--tokens` tokens (EOS ignored). The task is
copy-heavy: the prompt holds a passage, then asks for it again and starts it, cut at a word
boundary. `--task doc` (default): the opening of the "for" topic of `pydoc_data.topics`,
text the shipped model was trained on; `--task tutorial`: a passage of the Python tutorial,
which it never saw (and which it does not copy: a 4-layer model trained on 107k tokens
continues from memory, not from its context). `--draft shipped`: the draft packaged beside
the shipped model (`logitloop/models/tiny_draft`, scripts/train_tiny.py --tokenizer-from).

`mean accepted` is tokens per row per cycle (1 = nothing accepted; at most num_draft + 1;
the plain steps of rows that switched speculation off count as cycles), `accepted` the
share of the drafts verified that were taken;
`speedup` is plain's median time over the variant's, by wall clock and by the process's
CPU time (`time.process_time`, every thread): on a shared, overloaded machine the CPU time
is what stays comparable (other processes' load inflates the wall time of whichever
variant they overlap).

`--cycle-cost`: what one propose-verify cycle costs in plain steps (the speculation's
`cycle_cost`, whose CPU defaults `speculative.CPU_CYCLE_COST` come from here): every
variant runs never switched off (`min_acceptance=0`, `cycle_cost=1`); its L loop iterations
are S cycles (the rows' most `proposed`) and L - S plain steps (no row found a draft), so a
cycle's cost is 1 + (CPU time / plain's CPU time per step - L) / S, at each temperature
(more accepted drafts mean more sampling steps per cycle). Exact at batch 1 and for the
identical rows of T = 0; at batch 8 and T > 0 rows propose in different cycles, S is a
lower bound and the cost an upper one.

`--model llama-40m`: a randomly initialised Llama of 42M parameters (scripts/bench_generate.py
`MODELS`), with a byte-level stand-in for a tokenizer (prompts are token ids). Random models
at low temperature fall into loops that prompt lookup then copies, so this shows what the
mechanism gives at high acceptance on a model whose forward dominates the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import logitloop as ll

PASSAGE = (
    "The for statement in Python differs a bit from what you may be used to in C or Pascal. "
    "Rather than always iterating over an arithmetic progression of numbers, or giving the "
    "user the ability to define both the iteration step and halting condition, Python's for "
    "statement iterates over the items of any sequence, in the order that they appear in the "
    "sequence."
)
COPY_PROMPT = PASSAGE + "\n\nThe same passage once more, word for word:\n\n" + PASSAGE[:40]
DRAFT_DIR = Path(ll.__file__).parent / "models" / "tiny_draft"


def copy_prompt(task: str) -> str:
    """A passage, a request to repeat it, and its first words (cut before a space, so that
    the next token, a space and a word, is the one the passage has there)."""
    if task == "tutorial":
        passage = PASSAGE
    else:
        import pydoc_data.topics  # noqa: PLC0415

        passage = pydoc_data.topics.topics["for"].split("\n\n", 1)[1][:300]
    start = passage[: passage.rfind(" ", 0, 40)]
    return passage + "\n\nThe same passage once more, word for word:\n\n" + start


def load(name: str, task: str = "doc"):
    if name == "shipped":
        model = ll.load_pretrained(dtype=jnp.float32)
        return model, model.tokenizer.encode(copy_prompt(task))
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_generate import config  # noqa: PLC0415 - a sibling script
    from flax import nnx

    from logitloop.models import LlamaModel

    model = LlamaModel(config(name), rngs=nnx.Rngs(0))
    return model, repeating_prompt(model.config.vocab_size)


def repeating_prompt(vocab: int) -> list[int]:
    """48 random token ids, then their first 8 again: a random model's copy-heavy task."""
    prompt = [int(t) for t in jax.random.randint(jax.random.key(1), (48,), 0, vocab)]
    return prompt + prompt[:8]


def cycle_cost(seconds: float, plain_seconds: float, tokens: int, loop: tuple[int, int]) -> float:
    """What one propose-verify cycle costs in plain steps: plain takes `tokens` - 1 steps
    in `plain_seconds`; the speculative run took `seconds` for L loop iterations, S of them
    cycles (`loop` = (L, S), from `run`), so seconds = step * (L - S + S * cost)."""
    step = plain_seconds / (tokens - 1)
    iterations, wide = loop
    return 1 + (seconds / step - iterations) / max(wide, 1)


def variants(draft, **switch):
    """plain and the speculation variants; `switch`: e.g. min_acceptance=0.0."""
    out = {
        "plain": None,
        "ngram strict": ll.PromptLookup(max_ngram=3, num_draft=4, **switch),
        "ngram rejection": ll.PromptLookup(
            max_ngram=3, num_draft=4, acceptance="rejection", **switch
        ),
    }
    if draft is not None:
        out["draft strict"] = ll.DraftModel(model=draft, num_draft=4, **switch)
        out["draft rejection"] = ll.DraftModel(
            model=draft, num_draft=4, acceptance="rejection", **switch
        )
    return out


def run(model, prompt, batch, temperature, spec, tokens):
    params = ll.SamplingParams.create(
        batch_size=batch,
        temperature=temperature,
        max_tokens=tokens,
        seed=list(range(batch)),
    )
    t0, c0 = time.perf_counter(), time.process_time()
    result = ll.generate(model, [prompt] * batch, params, ignore_eos=True, speculative=spec)
    seconds = (time.perf_counter() - t0, time.process_time() - c0)
    spec = result.speculation
    cycles = sum(r["cycles"] for r in spec) if spec else None
    # the loop's iterations, and those that were cycles (exact when the rows propose
    # together: batch 1, or identical rows at T = 0; otherwise a lower bound)
    loop = (max(r["cycles"] for r in spec), max(r["proposed"] for r in spec)) if spec else None
    drafts = (sum(r["drafted"] for r in spec), sum(r["accepted"] for r in spec)) if spec else None
    made = sum(len(ids) for ids in result.token_ids)
    return seconds, made, cycles, drafts, loop


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="shipped", choices=["shipped", "llama-40m"])
    ap.add_argument("--task", default="doc", choices=["doc", "tutorial"])
    ap.add_argument("--draft", default=None, help="a draft model checkpoint folder, or 'shipped'")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--plot", default=None, help="PNG: mean accepted length and speedup vs T")
    ap.add_argument(
        "--cycle-cost", action="store_true", help="measure a cycle's cost in plain steps"
    )
    args = ap.parse_args(argv)

    model, prompt = load(args.model, args.task)
    folder = DRAFT_DIR if args.draft == "shipped" else args.draft
    draft = None if folder is None else ll.load_pretrained(folder, dtype=jnp.float32)
    rows = []
    for batch in args.batches:
        switch = dict(min_acceptance=0.0, cycle_cost=1.0) if args.cycle_cost else {}
        specs = variants(draft, **switch)
        for spec in specs.values():  # compile every variant once, untimed
            run(model, prompt, batch, 0.0, spec, args.tokens)
        for temp in args.temperatures:
            times = {name: [] for name in specs}
            cycles = {}
            for _ in range(args.repeats):
                for name, spec in specs.items():
                    seconds, made, cyc, drafts, loop = run(
                        model, prompt, batch, temp, spec, args.tokens
                    )
                    times[name].append(seconds)
                    cycles[name] = (made, cyc, drafts, loop)
            plain = statistics.median(t for t, _ in times["plain"])
            plain_cpu = statistics.median(c for _, c in times["plain"])
            for name in specs:
                made, cyc, drafts, loop = cycles[name]
                med = statistics.median(t for t, _ in times[name])
                cpu = statistics.median(c for _, c in times[name])
                row = dict(
                    model=args.model,
                    task=args.task,
                    batch=batch,
                    temperature=temp,
                    variant=name,
                    seconds=med,
                    cpu_seconds=cpu,
                    tokens_per_s=made / med,
                    tokens_per_cpu_s=made / cpu,
                    speedup=plain / med,
                    cpu_speedup=plain_cpu / cpu,
                    # the prefill's token is not a cycle's
                    mean_accepted=None if cyc is None else (made - batch) / cyc,
                    drafted=None if drafts is None else drafts[0],
                    accepted=None if drafts is None else drafts[1],
                )
                rows.append(row)
                if args.cycle_cost and cyc is not None:
                    row["cycle_cost"] = cycle_cost(cpu, plain_cpu, args.tokens, loop)
                    print(
                        f"batch {batch} T={temp:<4} {name:<16} cycle cost "
                        f"{row['cycle_cost']:.2f} plain steps (CPU time), "
                        f"{row['mean_accepted']:.2f} tokens per cycle",
                        flush=True,
                    )
                    continue
                acc = ""
                if cyc is not None:
                    share = drafts[1] / max(drafts[0], 1)
                    acc = f"{row['mean_accepted']:.2f} ({drafts[1]}/{drafts[0]} = {share:.2f})"
                print(
                    f"batch {batch} T={temp:<4} {name:<16} {row['tokens_per_s']:8.1f} tok/s "
                    f"(wall, speedup {row['speedup']:.2f}x)  "
                    f"{row['tokens_per_cpu_s']:8.1f} tok/CPU-s (speedup {row['cpu_speedup']:.2f}x)"
                    f"  mean accepted {acc}",
                    flush=True,
                )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)


def plot(rows, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    keys = sorted({(r["batch"], r["variant"]) for r in rows if r["variant"] != "plain"})
    for batch, variant in keys:
        sel = [r for r in rows if r["batch"] == batch and r["variant"] == variant]
        temps = [r["temperature"] for r in sel]
        label = f"{variant}, batch {batch}"
        left.plot(temps, [r["mean_accepted"] for r in sel], marker="o", label=label)
        right.plot(temps, [r["cpu_speedup"] for r in sel], marker="o", label=label)
    left.set(xlabel="temperature", ylabel="tokens per cycle (mean accepted length)")
    right.set(xlabel="temperature", ylabel="speedup over plain generate (CPU time)")
    right.axhline(1.0, color="gray", lw=0.5)
    left.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
