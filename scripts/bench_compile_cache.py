"""The first `ll.generate` call of a fresh Python process, with the persistent compilation
cache (`ll.enable_compile_cache`) warm against without it.

    python scripts/bench_compile_cache.py                      # 3 fresh processes per mode
    python scripts/bench_compile_cache.py --repeats 5 --out bench_out/compile_cache.json

Each measurement is its own process: import logitloop, `ll.load_pretrained()` (the shipped
model), then one timed `ll.generate` of one prompt, greedy, `--tokens` new tokens. Modes:

- `none`: no persistent cache (everything traced, lowered and compiled);
- `warm`: `ll.enable_compile_cache(folder)` on a folder an earlier process filled (traced
  and lowered, not compiled).

Reported: the best and the median first-call time of each mode, and their ratio.
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
start = time.perf_counter()
ll.generate(model, ["The for statement"], params)
print(time.perf_counter() - start)
"""


def _first_call(mode: str, folder: str, tokens: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, folder, str(tokens)],
        check=True, capture_output=True, text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


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
    print(f"{'mode':<6} {'best s':>8} {'median s':>9}")
    for mode, ts in times.items():
        print(f"{mode:<6} {min(ts):>8.2f} {statistics.median(ts):>9.2f}")
    print(f"warm / none (best): {min(times['warm']) / min(times['none']):.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"tokens": args.tokens, "seconds": times}, indent=1))


if __name__ == "__main__":
    main()
