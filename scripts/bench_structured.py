"""Structured-output benchmark: constrained against unconstrained decoding, automaton builds.

    python scripts/bench_structured.py                     # both parts
    python scripts/bench_structured.py --out bench_out/structured.json --repeats 5

Part 1, on the shipped model, at batch 1 and 8, alternating repeat by repeat (median):
- `free`: 64 tokens per row, no constraint (`ignore_eos`, so every row runs 64 tokens);
- `regex`: the same rows under `[a-z ,.]{400,}`, which cannot end within 64 tokens: every
  step gathers the row's bitmask, masks the logits and advances the automaton;
- `json`: the rows under the tests' nested-object schema; its documents end early, so its
  rate is per decode step (the loop runs until its longest row ends).
Compile time is excluded (one untimed call each first).

Part 2: the time to build each test schema's and regex's automaton (outlines-core `Index` +
packing) from scratch, with the shipped 4096-token vocabulary and with a 32k-token byte-level
BPE trained the same way (`scripts/train_tiny.py`'s `train_tokenizer` on the same corpus,
cached under --workdir), and the time of a cached lookup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
from timing import first_call  # scripts/ is on the path when run as a script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' schemas

import logitloop as ll  # noqa: E402
from logitloop.decoding.loop.runner import model_info  # noqa: E402
from logitloop.decoding.sampling import constraints  # noqa: E402
from logitloop.models.tokenizer import Tokenizer  # noqa: E402
from tests.decoding.test_constraints import REGEXES, SCHEMAS  # noqa: E402

LONG_REGEX = r"[a-z ,.]{400,}"
TOKENS = 64


def decode_rates(model, batch: int, repeats: int) -> dict:
    prompts = ["The answer is"] * batch
    seeds = list(range(batch))
    base = dict(temperature=1.0, seed=seeds, max_tokens=TOKENS)
    cases = {
        "free": ll.SamplingParams.create(batch, **base),
        "regex": ll.SamplingParams.create(batch, **base, regex=LONG_REGEX),
        "json": ll.SamplingParams.create(batch, **base, json_schema=SCHEMAS["nested"]),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    steps: dict[str, int] = {}

    def run(name):
        return ll.generate(model, prompts, cases[name], ignore_eos=(name != "json"))

    for name in cases:  # compile
        result = run(name)
        steps[name] = max(result.num_tokens)
    for _ in range(repeats):
        for name in cases:
            times[name].append(first_call(lambda name=name: run(name).token_ids))
    out = {}
    for name in cases:
        t = statistics.median(times[name])
        out[name] = {
            "seconds": t,
            "steps": steps[name],
            "steps_per_s": steps[name] / t,
            "tokens_per_s": batch * steps[name] / t,
        }
    for name in ("regex", "json"):
        out[name]["vs_free"] = out[name]["steps_per_s"] / out["free"]["steps_per_s"]
    return out


def build_times(tokenizer, vocab_size: int) -> dict:
    items = {f"schema {k}": constraints.parse(v, None, None, 1)[0] for k, v in SCHEMAS.items()}
    items.update({f"regex {k}": constraints.parse(None, v, None, 1)[0] for k, v in REGEXES.items()})
    t0 = time.perf_counter()
    vocab = constraints.TokenVocabulary(
        tokenizer.all_token_bytes(), tokenizer.eos_token_ids, vocab_size
    )
    out = {"vocabulary_s": time.perf_counter() - t0, "vocab_size": vocab_size}
    for name, c in items.items():
        t0 = time.perf_counter()
        automaton = constraints.compile_automaton(c.regex, vocab)
        tables, _ = constraints.pack([automaton])
        jax.block_until_ready(tables)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        constraints.compile_automaton(c.regex, vocab)
        cached = time.perf_counter() - t0
        out[name] = {
            "build_s": built,
            "cached_s": cached,
            "states": automaton.num_states,
            "edges": automaton.num_edges,
            "table_mb": (tables.bits.nbytes + tables.targets.nbytes + tables.start.nbytes) / 2**20,
        }
    return out


def bpe_32k(workdir: Path) -> Tokenizer:
    """A 32k byte-level BPE trained like the shipped one (`train_tiny.train_tokenizer`) on
    text that ships with Python: the help topics alone yield only ~9k merges, so the
    standard library's sources join them."""
    import sysconfig

    from train_tiny import EOS, corpus, train_tokenizer

    train, val = corpus(0, 0.05)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = train + val + [p.read_text(encoding="utf-8", errors="replace") for p in sources]
    path = workdir / "tokenizer-32k.json"
    tok = train_tokenizer(texts, 32000, path)
    return Tokenizer.from_file(path, eos_token_ids=[tok.token_to_id(EOS)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--workdir", type=Path, default=Path("bench_out"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    model = ll.load_pretrained()
    info = model_info(model)
    result: dict = {"decode": {}, "build": {}}
    if not args.skip_decode:
        print(f"{'batch':>5} {'case':>6} {'steps':>6} {'tok/s':>9} {'vs free':>8}")
        for batch in args.batches:
            rates = decode_rates(model, batch, args.repeats)
            result["decode"][batch] = rates
            for name, r in rates.items():
                ratio = f"{r['vs_free']:8.3f}" if "vs_free" in r else " " * 8
                print(f"{batch:>5} {name:>6} {r['steps']:>6} {r['tokens_per_s']:9.1f} {ratio}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    vocabularies = {"shipped": (info.tokenizer, info.vocab_size)}
    big = bpe_32k(args.workdir)
    vocabularies["bpe32k"] = (big, big.vocab_size)
    print(
        f"\n{'automaton':<24} {'vocab':>6} {'states':>7} {'edges':>8} {'MB':>6} "
        f"{'build s':>8} {'cached s':>9}"
    )
    for label, (tok, size) in vocabularies.items():
        times = build_times(tok, size)
        result["build"][label] = times
        print(
            f"{'(vocabulary) ' + label:<24} {size:>6} {'':>7} {'':>8} {'':>6} "
            f"{times['vocabulary_s']:8.3f}"
        )
        for name, t in times.items():
            if isinstance(t, dict):
                print(
                    f"{name:<24} {size:>6} {t['states']:>7} {t['edges']:>8} "
                    f"{t['table_mb']:6.2f} {t['build_s']:8.3f} {t['cached_s']:9.6f}"
                )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=float))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
