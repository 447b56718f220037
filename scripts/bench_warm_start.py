"""What a warm `logitloop generate` spends before decoding: programs compiled (traced,
lowered, then loaded from JAX's cache) or loaded whole from logitloop's executable store.

    PYTHONPATH=$PWD python scripts/bench_warm_start.py --before /path/to/older/checkout

For each checkout (this one, and `--before` if given) in a fresh cache folder: one cold run
of the command, then `--repeats` warm runs; then one run of 3 prompts after those of 1.
Prints the CLI's summary figures (median of the warm runs) and where a warm run's time
goes (this checkout, cProfile of `cli.main` in a child process); writes JSON to `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The for statement"
SUMMARY = re.compile(
    r"compile (?P<compile>[\d.]+) s .*?; (?P<programs>\d+ programs? compiled(, \d+ loaded)?)"
    r".*?model load (?P<load>[\d.]+) s; total (?P<total>[\d.]+) s"
)
PHASES = (
    "load_model",
    "prepare_tokens",
    "_run_requests",
    "load",
    "_compile_stored",
    "enable_default_compile_cache",
)


def cli(code: Path, folder: Path, prompts: list[str]) -> dict:
    """One `logitloop generate` process: its summary figures and its wall time."""
    env = dict(os.environ, PYTHONPATH=str(code), LOGITLOOP_COMPILE_CACHE=str(folder))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "logitloop", "generate", *prompts, "--seed", "1"],
        env=env, cwd=code, capture_output=True, text=True, check=True,
    )  # fmt: skip
    wall = time.perf_counter() - start
    found = SUMMARY.search(done.stderr)
    if found is None:
        raise RuntimeError(f"no summary line in:\n{done.stderr[-2000:]}")
    out = {k: float(v) for k, v in found.groupdict().items() if k != "programs"}
    return dict(out, programs=found["programs"], process=wall)


def measure(code: Path, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cold = cli(code, Path(tmp) / "one", [PROMPT])
        warm = [cli(code, Path(tmp) / "one", [PROMPT]) for _ in range(repeats)]
        three = [PROMPT, "A dictionary", "The while loop"]
        after_one = cli(code, Path(tmp) / "one", three)
        again = cli(code, Path(tmp) / "one", three)
    median = {k: statistics.median(r[k] for r in warm) for k in warm[0] if k != "programs"}
    return {
        "cold": cold,
        "warm_median": dict(median, programs=warm[0]["programs"]),
        "three_after_one": after_one,
        "three_again": again,
    }


def profile(folder: str) -> None:
    """In this process: import times, then `cli.main` under cProfile (a warm run)."""
    import cProfile
    import pstats

    t0 = time.perf_counter()
    import jax  # noqa: F401

    t1 = time.perf_counter()
    from logitloop import cli as cli_module

    t2 = time.perf_counter()
    os.environ["LOGITLOOP_COMPILE_CACHE"] = folder
    prof = cProfile.Profile()
    prof.enable()
    cli_module.main(["generate", PROMPT, "--seed", "1", "-q"])
    prof.disable()
    t3 = time.perf_counter()
    phases: dict[str, float] = {}
    for (file, _, name), (_, _, _, cumulative, _) in pstats.Stats(prof).stats.items():
        if name in PHASES and "logitloop" in file:
            phases[name] = phases.get(name, 0.0) + cumulative
    print(
        json.dumps(
            {"import jax": t1 - t0, "import logitloop.cli": t2 - t1, "cli.main": t3 - t2, **phases}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="an older checkout to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench_warm_start.json"))
    parser.add_argument("--profile", help=argparse.SUPPRESS)  # internal: the child process
    args = parser.parse_args()
    if args.profile:
        profile(args.profile)
        return
    results = {"after": measure(ROOT, args.repeats)}
    if args.before is not None:
        results["before"] = measure(args.before, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        cli(ROOT, Path(tmp), [PROMPT])  # fill
        child = subprocess.run(
            [sys.executable, __file__, "--profile", tmp],
            env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        results["warm_profile"] = json.loads(child.stdout.strip().splitlines()[-1])
    for name in ("before", "after"):
        if name not in results:
            continue
        r = results[name]
        w, t = r["warm_median"], r["three_after_one"]
        print(
            f"{name:6s} warm: programs {w['compile']:.2f} s ({w['programs']}), model load "
            f"{w['load']:.2f} s, total {w['total']:.2f} s, process {w['process']:.2f} s | "
            f"3 prompts after 1: programs {t['compile']:.2f} s ({t['programs']}), then "
            f"{r['three_again']['compile']:.2f} s ({r['three_again']['programs']})"
        )
    print("a warm run (after), seconds:", json.dumps(results["warm_profile"]))
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
