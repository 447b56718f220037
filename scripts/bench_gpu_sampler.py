"""The Pallas sampling kernel on a GPU: correctness against the XLA path, then timings.

    python scripts/bench_gpu_sampler.py --out bench_out/gpu_sampler.json
    python scripts/bench_gpu_sampler.py --check-only        # correctness only
    python scripts/bench_gpu_sampler.py --skip-check --batches 64 --repeats 100

Check: for several shapes (V = 128256 and others that are not a multiple of the kernel's
block) and three kinds of logits (normal, exact ties, mostly -inf), with a different
setting in every row (greedy, temperature only, top-k inside and beyond the XLA path's
candidates, top-p narrow and wide, min-p, all three), the kernel must draw the XLA path's
token in every row, keep the same set under each filter, and give log-probabilities
within 1e-5. Exits 1 otherwise.

Timings, batch 1/8/64/256 at V = 128256 float32, the same mixed rows, median of `--repeats`
calls after a warm-up, each call waited on with `block_until_ready`:

- `kernel`: `filter_and_sample_pallas` (one program per row, reductions only);
- `xla`: `logitloop.ops.sampling.xla.filter_and_sample` (top-k candidates, bisection);
- `floor`: the time to read the logits once, B * V * 4 bytes at the device-to-device copy
  bandwidth measured here (a copy of `--copy-mib` MiB reads and writes each byte once).

`--sweep` also times the kernel's static knobs (block, pivots per search pass) at batch 64.
Ratios from one run are what to quote; absolute times only from a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import timing  # scripts/ is on the path when run as a script

from logitloop.ops.sampling import pallas, xla

VOCAB = 128256
BATCHES = (1, 8, 64, 256)
CHECK_SHAPES = ((1, 128256), (8, 128256), (64, 128256), (256, 128256), (7, 32000), (5, 1000))
CHECK_KINDS = ("normal", "ties", "masked")
SWEEP = ((512, 16), (1024, 4), (1024, 8), (1024, 16), (2048, 8), (2048, 16))
# One setting per row, cycled over the batch: every filter alone, combined, and off.
ROWS = (
    dict(top_k=50, top_p=0.9, min_p=0.05),
    dict(top_p=0.95),
    dict(top_k=1000),  # beyond the XLA path's candidates
    dict(min_p=0.1),
    dict(top_k=200, top_p=0.8, min_p=0.02),
    dict(greedy=True),
    dict(top_p=0.995),  # a nucleus of thousands of tokens
    dict(),  # temperature only
)

xla_path = jax.jit(xla.filter_and_sample)


def inputs(batch: int, vocab: int, kind: str = "normal", seed: int = 0):
    """Logits peaked like a language model's (normal * 4) and the mixed per-row settings."""
    rng = np.random.default_rng(seed + 7919 * batch + vocab)
    x = rng.standard_normal((batch, vocab)) * 4.0
    if kind == "ties":
        x = np.round(x) + 0.25  # off 0.0, where the XLA path mishandles many ties
    elif kind == "masked":
        x[rng.random(x.shape) < 0.9] = -np.inf
        x[:, 0] = 0.0
    rows = [ROWS[r % len(ROWS)] for r in range(batch)]
    args = (
        x.astype(np.float32),
        np.array([r.get("top_k", 0) for r in rows], np.int32),
        np.array([r.get("top_p", 1.0) for r in rows], np.float32),
        np.array([r.get("min_p", 0.0) for r in rows], np.float32),
        np.array([r.get("greedy", False) for r in rows]),
        rng.integers(0, 2**32, (batch, 2), dtype=np.uint32),
    )
    return tuple(jnp.asarray(a) for a in args)


def compare(args, interpret: bool = False) -> dict:
    """Mismatches between the kernel and the XLA path on one batch."""
    kernel = pallas.filter_and_sample_pallas(*args, interpret=interpret)
    (got, got_thr), (want, want_thr) = jax.tree.map(np.asarray, (kernel, xla_path(*args)))
    x, sampled = np.asarray(args[0]), ~np.asarray(args[4])
    kept_rows = 0
    for name in ("top_k", "top_p", "min_p"):
        diff = (x >= getattr(got_thr, name)[:, None]) != (x >= getattr(want_thr, name)[:, None])
        kept_rows += int(np.sum(diff.any(axis=1) & sampled))
    return dict(
        token_mismatches=int(np.sum(got.tokens != want.tokens)),
        kept_set_mismatches=kept_rows,
        max_logprob_error=float(np.max(np.abs(got.logprobs - want.logprobs))),
    )


def check() -> bool:
    ok = True
    print(f"{'batch':>6} {'vocab':>7} {'kind':>7} {'tokens':>7} {'kept':>5} {'logprob err':>12}")
    for batch, vocab in CHECK_SHAPES:
        for kind in CHECK_KINDS:
            r = compare(inputs(batch, vocab, kind, seed=1))
            bad = r["token_mismatches"] or r["kept_set_mismatches"]
            bad = bad or not r["max_logprob_error"] <= 1e-5
            ok = ok and not bad
            print(
                f"{batch:>6} {vocab:>7} {kind:>7} {r['token_mismatches']:>7} "
                f"{r['kept_set_mismatches']:>5} {r['max_logprob_error']:>12.2e}"
                + ("  MISMATCH" if bad else "")
            )
    print("check:", "ok" if ok else "FAILED")
    return ok


def median_time(fn, repeats: int) -> float:
    """Median seconds per call after two warm-up calls (the first compiles)."""
    return timing.median_time(fn, repeats, warmup=2)


def copy_bandwidth(mib: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (each byte read once and written once)."""
    a = jnp.ones((mib * 2**18,), jnp.float32)
    copy = jax.jit(jnp.copy)
    return 2 * a.nbytes / median_time(lambda: copy(a), repeats)


def time_batch(
    batch: int,
    vocab: int,
    repeats: int,
    bandwidth: float,
    *,
    kernel: bool = True,
    interpret: bool = False,
) -> dict:
    """Median seconds of the kernel (None when `kernel` is False: no GPU) and of the XLA
    path on the mixed rows of one [batch, vocab] float32 batch, and the floor: one read of
    the logits, batch * vocab * 4 bytes / `bandwidth` (bytes/s)."""
    args = inputs(batch, vocab)
    run = lambda: pallas.filter_and_sample_pallas(*args, interpret=interpret)  # noqa: E731
    return dict(
        batch=batch,
        vocab=vocab,
        kernel_s=median_time(run, repeats) if kernel else None,
        xla_s=median_time(lambda: xla_path(*args), repeats),
        floor_s=batch * vocab * 4 / bandwidth,
    )


def bench(batches, repeats: int, bandwidth: float, sweep: bool) -> list[dict]:
    rows = []
    print(
        f"{'batch':>6} {'kernel us':>10} {'xla us':>9} {'floor us':>9} {'xla/kernel':>11} "
        f"{'kernel/floor':>13}"
    )
    for batch in batches:
        row = time_batch(batch, VOCAB, repeats, bandwidth)
        rows.append(row)
        kernel, ref, floor = row["kernel_s"], row["xla_s"], row["floor_s"]
        print(
            f"{batch:>6} {kernel * 1e6:>10.1f} {ref * 1e6:>9.1f} {floor * 1e6:>9.1f} "
            f"{ref / kernel:>11.2f} {kernel / floor:>13.1f}"
        )
    if sweep:
        args = inputs(64, VOCAB)
        print(f"\nkernel knobs at batch 64, V {VOCAB}")
        print(f"{'block':>6} {'pivots':>7} {'kernel us':>10}")
        for block, pivots in SWEEP:
            run = lambda a=args, b=block, p=pivots: pallas.filter_and_sample_pallas(
                *a, block=b, num_pivots=p
            )
            t = median_time(run, repeats)
            rows.append(dict(batch=64, vocab=VOCAB, block=block, num_pivots=pivots, kernel_s=t))
            print(f"{block:>6} {pivots:>7} {t * 1e6:>10.1f}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time block/pivot choices")
    a = ap.parse_args()

    devices = jax.devices()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {devices}")
    if jax.default_backend() != "gpu":
        print("no GPU: the compiled Pallas kernel cannot run here", file=sys.stderr)
        return 2
    ok = True if a.skip_check else check()
    if a.check_only:
        return 0 if ok else 1
    bandwidth = copy_bandwidth(a.copy_mib, a.repeats)
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; floor = B * V * 4 bytes / bandwidth\n")
    rows = bench(a.batches, a.repeats, bandwidth, a.sweep)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        result = dict(
            device=str(devices[0]),
            jax=jax.__version__,
            python=platform.python_version(),
            vocab=VOCAB,
            row_settings=[dict(r) for r in ROWS],
            copy_bandwidth_bytes_per_s=bandwidth,
            repeats=a.repeats,
            check_ok=None if a.skip_check else ok,
            rows=rows,
        )
        a.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
