"""Timing helpers shared by the benchmark scripts (run them as `python scripts/NAME.py`)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from logitloop.decoding.runtime.compiles import CompileWatch


def first_call(fn) -> float:
    """Seconds of one call, results ready (the first call of a jitted function compiles)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def median_time(fn, repeats: int, warmup: int = 0) -> float:
    """Median seconds per call over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    return statistics.median(first_call(fn) for _ in range(repeats))


def timed_turns(fns: dict, repeats: int, warm_ups: dict | None = None) -> dict:
    """For each of `fns` (name -> call), `(median seconds, last result, programs the timed
    calls compiled)` of `repeats` calls after one warm-up call (of `warm_ups[name]`, a
    cheaper call of the same shapes, when given); the calls run in turns, so that load on
    the machine falls on each alike."""
    for name, fn in fns.items():
        (warm_ups or {}).get(name, fn)()
    counter = CompileWatch()
    times, outs, compiled = {name: [] for name in fns}, {}, dict.fromkeys(fns, 0)
    for _ in range(repeats):
        for name, fn in fns.items():
            with counter:
                t0 = time.perf_counter()
                outs[name] = fn()
                times[name].append(time.perf_counter() - t0)
            compiled[name] += counter.count
    return {name: (statistics.median(times[name]), outs[name], compiled[name]) for name in fns}


def rate_report(results: dict, tokens: int | dict, base: str, setup: dict) -> dict:
    """`timed_turns`' results as name -> `tokens_per_s`, `seconds`, `compiled` and `ratio`
    (tokens/s over `base`'s); `tokens`: the tokens each call makes (or name -> tokens).
    `setup` goes in under "setup"."""
    report = {}
    for name, (seconds, _, compiled) in results.items():
        count = tokens[name] if isinstance(tokens, dict) else tokens
        report[name] = dict(tokens_per_s=count / seconds, seconds=seconds, compiled=compiled)
    for name in results:
        report[name]["ratio"] = report[name]["tokens_per_s"] / report[base]["tokens_per_s"]
    report["setup"] = setup
    return report


def print_rates(report: dict, names, out: str | None = None) -> None:
    """The turns `names` of a `rate_report` as a table (tokens/s, the ratio, programs the
    timed calls compiled); `out`: also the whole report as JSON."""
    print(f"{'turn':16s} {'tokens/s':>10s} {'ratio':>8s} {'compiled':>9s}")
    for name in names:
        r = report[name]
        print(f"{name:16s} {r['tokens_per_s']:10.1f} {r['ratio']:8.3f} {r['compiled']:9d}")
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)


def decode_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments the decode benchmarks share: `--model` (an HF checkpoint, default the
    shipped model), `--rows`, `--prompt` (tokens), `--new-tokens`, `--repeats`, `--out`
    (the JSON report); a script adds its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an HF checkpoint (default: shipped)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    return parser
