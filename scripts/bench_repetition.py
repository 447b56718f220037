"""The repetition guard (issue 56): decode steps and wall time saved on a loop-prone job.

    python scripts/bench_repetition.py                  # 64 prompts, 256 tokens, guard 8,3
    python scripts/bench_repetition.py --guard 16,3 --repeats 5 --json out.json

The shipped model, greedy, on `--prompts` prompts (the first five words of sentences of
Python's own help topics, `pydoc_data.topics`), `max_tokens=--max-tokens`:

- `generate` of the whole batch, and `generate_many` with `--slots` slots (where a row that
  ends early frees its slot for the next request), each without the guard, with
  `repetition_guard=--guard`, and with a guard that never fires (`(1, 65536)`: the cost
  of the check itself);
- the tokens generated (one decode step of one row each) and the median wall time of
  `--repeats` runs after a warm-up, the variants in turns (timed runs checked to compile
  nothing);
- rows the guard did not cut are equal bit for bit (tokens and logprobs) to the run
  without it; rows it cut are a prefix of theirs, ending where a NumPy scan of the
  unguarded tokens says the loop is.
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import re

from timing import timed_turns  # scripts/ is on the path when run as a script

import logitloop as ll

NEVER = (1, 65536)  # a guard whose check runs at every step and never fires here


def prompts(count: int) -> list[str]:
    text = " ".join(pydoc_data.topics.topics.values())
    sentences = [
        s.strip()
        for s in re.split(r"(?<=[.!?])\s+", text)
        if len(s.split()) >= 6 and s[0].isupper() and s.isascii() and "*" not in s
        and "::=" not in s
    ]  # fmt: skip
    return [" ".join(s.split()[:5]) for s in sentences[:: len(sentences) // count][:count]]


def first_loop(ids: list[int], max_period: int, min_repeats: int) -> int | None:
    """How many tokens the row has when its last ones first repeat (a plain scan)."""
    for n in range(1, len(ids) + 1):
        for p in range(1, max_period + 1):
            tail = ids[max(n - p * min_repeats, 0) : n]
            if len(tail) == p * min_repeats and all(
                tail[i] == tail[i % p] for i in range(len(tail))
            ):
                return n
    return None


def rows_of(result) -> tuple[list[list[int]], list[list[float]], list[str]]:
    if isinstance(result, list):  # generate_many: one result per request
        return (
            [r.token_ids[0] for r in result],
            [r.logprobs[0] for r in result],
            [r.finish_reason[0] for r in result],
        )
    return result.token_ids, result.logprobs, result.finish_reason


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--guard", default="8,3", help="MAX_PERIOD,MIN_REPEATS")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    guard = tuple(int(x) for x in args.guard.split(","))
    model = ll.load_pretrained()
    texts = prompts(args.prompts)
    knobs = dict(temperature=0.0, max_tokens=args.max_tokens, logprobs=0)

    def run(entry: str, setting):
        if entry == "generate":
            return lambda: ll.generate(model, texts, repetition_guard=setting, **knobs)
        requests = [ll.Request(t, dict(knobs, repetition_guard=setting)) for t in texts]
        return lambda: ll.generate_many(
            model, requests, slots=args.slots, max_tokens_bound=args.max_tokens
        )

    report = {"prompts": len(texts), "max_tokens": args.max_tokens, "guard": guard}
    print(f"{len(texts)} prompts, greedy, max_tokens {args.max_tokens}, guard {guard}, "
          f"median of {args.repeats} (jax {_backend()})")  # fmt: skip
    for entry in ("generate", "generate_many"):
        runs = timed_turns(
            {"plain": run(entry, None), "guard": run(entry, guard), "never": run(entry, NEVER)},
            args.repeats,
        )
        for name, (_, _, compiled) in runs.items():
            assert compiled == 0, f"a timed run of {name} compiled"
        (plain_s, plain, _), (guard_s, guarded, _), (never_s, never, _) = runs.values()
        ids0, lp0, _ = rows_of(plain)
        ids1, lp1, reasons = rows_of(guarded)
        idsn, lpn, _ = rows_of(never)
        assert idsn == ids0 and lpn == lp0, "a guard that never fires changed a row"
        cut = [r for r, why in enumerate(reasons) if why == "repetition"]
        for r in range(len(texts)):
            if r in cut:
                assert ids1[r] == ids0[r][: len(ids1[r])], f"row {r}: not a prefix"
                assert len(ids1[r]) == first_loop(ids0[r], *guard), f"row {r}: cut elsewhere"
            else:
                assert ids1[r] == ids0[r] and lp1[r] == lp0[r], f"row {r} changed"
        steps0, steps1 = sum(map(len, ids0)), sum(map(len, ids1))
        row = {
            "rows_cut": len(cut),
            "tokens_without": steps0,
            "tokens_with": steps1,
            "tokens_saved": steps0 - steps1,
            "seconds_without": plain_s,
            "seconds_with": guard_s,
            "seconds_never_firing": never_s,
            "time_ratio_with": guard_s / plain_s,
            "time_ratio_check_only": never_s / plain_s,
            "uncut_rows_bit_identical": True,
        }
        report[entry] = row
        print(
            f"{entry:14s} rows cut {len(cut):3d}/{len(texts)}  tokens {steps0} -> {steps1} "
            f"({1 - steps1 / steps0:.1%} fewer)  time with guard {guard_s / plain_s:.2f}x, "
            f"check only {never_s / plain_s:.2f}x of without ({plain_s:.2f} s); "
            "uncut rows bit-identical"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def _backend() -> str:
    import jax

    return f"{jax.__version__}, {jax.default_backend()}"


if __name__ == "__main__":
    main()
