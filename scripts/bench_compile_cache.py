"""The first `ll.generate` call of a fresh Python process, with the persistent compilation
cache (`ll.enable_compile_cache`) warm against without it.

    python scripts/bench_compile_cache.py                      # 3 fresh processes per mode
    python scripts/bench_compile_cache.py --repeats 5 --out bench_out/compile_cache.json

Each measurement is its own process: import logitloop, `ll.load_pretrained()` (the shipped
model), then one timed `ll.generate` of one prompt, greedy, `--tokens` new tokens. Modes:

- `none`: no persistent cache (everything traced, lowered and compiled);
- `warm`: `ll.enable_compile_cache(folder)` on a folder an earlier process filled (traced
  and lowered, not compiled).

Reported: the best and the median first-call time of each mode (wall time, and the
process's CPU time over all its threads, which a loaded machine inflates less), and the
ratio of the best wall times.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import sys, time
import logitloop as ll
if sys.argv[1] != "none":
    assert ll.enable_compile_cache(sys.argv[2]) is not None
model = ll.load_pretrained()
params = ll.SamplingParams.create(1, temperature=0.0, max_tokens=int(sys.argv[3]))
start, cpu = time.perf_counter(), time.process_time()
ll.generate(model, ["The for statement"], params)
print(time.perf_counter() - start, time.process_time() - cpu)
"""


def _first_call(mode: str, folder: str, tokens: int) -> tuple[float, float]:
    """(wall s, CPU s) of the first call in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, folder, str(tokens)],
        check=True,
        capture_output=True,
        text=True,
    )
    wall, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(Path(tmp) / "cache")
        _first_call("warm", folder, args.tokens)  # fills the cache
        times = {"none": [], "warm": []}
        for _ in range(args.repeats):  # alternating, so load on the machine hits both
            for mode in times:
                times[mode].append(_first_call(mode, folder, args.tokens))
    print(f"first ll.generate call, fresh process, {args.tokens} tokens, {platform.processor()}")
    print(f"{'mode':<6} {'best s':>8} {'median s':>9} {'best CPU s':>11} {'median CPU s':>13}")
    for mode, ts in times.items():
        wall, cpu = [w for w, _ in ts], [c for _, c in ts]
        print(
            f"{mode:<6} {min(wall):>8.2f} {statistics.median(wall):>9.2f} "
            f"{min(cpu):>11.2f} {statistics.median(cpu):>13.2f}"
        )
    best = {mode: min(w for w, _ in ts) for mode, ts in times.items()}
    print(f"warm / none (best wall): {best['warm'] / best['none']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"tokens": args.tokens, "seconds [wall, cpu]": times}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
