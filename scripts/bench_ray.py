"""Batch jobs on Ray Data (issue 58): rows per second with 2 actors against 1 on this
machine, and the Ray path's overhead against the plain CLI on one actor, one run each.

    python scripts/bench_ray.py [--prompts 64] [--max-tokens 16] [--batch-size 16] [--json F]

Every job is `logitloop generate --input F --output O` (deterministic, seed 0) on the
shipped model: plain (in this process), `--ray --workers 1` and `--ray --workers 2`, on a
local Ray instance of 2 CPUs. Every process shares one compile cache, warmed first by each
kind of job, so the times are generation plus, for Ray, what a job costs beyond it: actor
processes started, JAX imported, the model loaded, rows shipped. Wall times of the whole
job, quoted as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_ray_"))
    cache = work / "cache"
    cache.mkdir(mode=0o700)
    os.environ["LOGITLOOP_COMPILE_CACHE"] = str(cache)  # this process and the actors
    import ray

    from logitloop.cli import main as cli

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"LOGITLOOP_COMPILE_CACHE": str(cache)}})  # fmt: skip
    source = work / "in.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": i, "prompt": f"Line {i}: the for"}) + "\n"
            for i in range(args.prompts)
        )  # fmt: skip
    )
    common = ["--input", str(source), "--max-tokens", str(args.max_tokens), "--seed", "0",
              "--batch-size", str(args.batch_size), "-q"]  # fmt: skip
    runs = {"plain": [], "ray 1 worker": ["--ray", "--workers", "1"],
            "ray 2 workers": ["--ray", "--workers", "2"]}  # fmt: skip

    def job(extra: list[str], name: str) -> float:
        out = work / f"{name}.jsonl"
        started = time.perf_counter()
        assert cli(["generate", *common, "--output", str(out), "--overwrite", *extra]) == 0
        seconds = time.perf_counter() - started
        assert len(out.read_text().splitlines()) == args.prompts
        return seconds

    for name, extra in runs.items():  # warm-up: the compile cache holds every program
        job(extra, "warm_" + name.replace(" ", "_"))
    seconds = {name: job(extra, name.replace(" ", "_")) for name, extra in runs.items()}
    ray.shutdown()

    rate = {name: args.prompts / s for name, s in seconds.items()}
    table = {
        "seconds": seconds,
        "rows_per_s": rate,
        "ray 2 workers / ray 1 worker (rows/s)": rate["ray 2 workers"] / rate["ray 1 worker"],
        "ray 1 worker / plain (time)": seconds["ray 1 worker"] / seconds["plain"],
        "args": vars(args),
    }
    for name in runs:
        print(f"{name:14s} {seconds[name]:7.1f} s  {rate[name]:6.2f} rows/s")
    print(f"rows/s, 2 workers / 1 worker: {table['ray 2 workers / ray 1 worker (rows/s)']:.2f}x")
    print(f"time, Ray on 1 worker / plain CLI: {table['ray 1 worker / plain (time)']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
