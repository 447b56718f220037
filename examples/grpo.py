"""GRPO on the shipped model, on a CPU, with the trainer's log-probs exactly the rollout's.

    python examples/grpo.py --steps 30 --out grpo_run          # deterministic (default)
    python examples/grpo.py --steps 30 --deterministic false   # the mismatch it would have

Each step samples `--samples` completions for each of `--prompts` prompts with
`ll.generate(..., n=G, deterministic=...)` (the G rows of a prompt on its shared prefix
pages), scores them with a verifiable reward (the completion holds a number: the regex
`REWARD`), normalizes the rewards within each prompt's group (GRPO's advantage), and takes
one optax step on the clipped importance-ratio loss, whose trainer log-probs come from
`ll.token_logprobs` on the same weights. Before the step it logs the mismatch between the
rollout's log-probs and the trainer's: the largest |difference| and the sampled KL
estimate (k3, Schulman 2020) over every completion token. With `deterministic=True` both
are 0.0 every step (the trainer runs the rollout's numerics; docs/rl.md), so the importance
ratio of the first update is exactly 1; with `--deterministic false` they show the noise a
trainer on other kernels would put into the ratio.

The model stays bfloat16 (the shipped dtype, the one RL runs in); the optimizer keeps a
float32 master copy of the weights and writes them back with `nnx.update`, which compiles
nothing (the log's `compiles` column counts the programs each step compiled). Writes
`log.jsonl` and `grpo.png` (reward and mismatch per step) into `--out`.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import logitloop as ll
from logitloop.decoding.runtime.compiles import CompileWatch

PROMPTS = [
    "The for statement",
    "A dictionary",
    "x = ",
    "def f(x):",
    "import",
    "class A:",
    "The while loop",
    "A list",
]
REWARD = re.compile(r"\d")  # verifiable: the completion holds a digit


def reward(text: str) -> float:
    return 1.0 if REWARD.search(text) else 0.0


def group_advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """GRPO's advantage: each reward against its prompt's group, in group standard
    deviations (0 for a group whose rewards are all equal)."""
    r = rewards.reshape(-1, group)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
    return adv.reshape(-1).astype(np.float32)


def mismatch(trainer: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """max |trainer - rollout| and the k3 estimate of KL(rollout || trainer) over the
    completion tokens (`mask`)."""
    d = (trainer - rollout)[mask].astype(np.float64)
    return float(np.abs(d).max()), float(np.mean(np.expm1(d) - d))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=4, help=f"1..{len(PROMPTS)}")
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=0.2, help="PPO's ratio clip epsilon")
    ap.add_argument("--deterministic", default="true", choices=["true", "false"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("grpo_run"))
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be 1..{len(PROMPTS)}, got {args.prompts}")
    det = args.deterministic == "true"
    prompts, group = PROMPTS[: args.prompts], args.samples

    model = ll.load_pretrained()  # bfloat16
    graph, weights = nnx.split(model, nnx.Param)
    master = jax.tree.map(lambda w: w.astype(jnp.float32), weights)  # the optimizer's copy
    opt = optax.adam(args.lr)
    opt_state = opt.init(master)
    width = max(len(model.tokenizer.encode(p)) for p in prompts) + args.max_tokens

    def loss_fn(m, ids, plen, lens, params, old, adv, mask):
        lp = ll.token_logprobs(m, ids, plen, params, lengths=lens, deterministic=det).logprobs
        ratio = jnp.exp(jnp.where(mask, lp - old, 0.0))
        a = adv[:, None]
        clipped = jnp.clip(ratio, 1 - args.clip, 1 + args.clip)
        per_token = -jnp.minimum(ratio * a, clipped * a)
        return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.maximum(mask.sum(), 1), lp

    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    log, out = [], args.out
    out.mkdir(parents=True, exist_ok=True)
    for step in range(args.steps):
        start, watch = time.perf_counter(), CompileWatch()
        with watch:
            params = ll.SamplingParams.create(
                len(prompts), temperature=1.0, max_tokens=args.max_tokens,
                seed=[args.seed * 100_003 + step * len(prompts) + i for i in range(len(prompts))],
            )  # fmt: skip
            gen = ll.generate(model, prompts, params, n=group, deterministic=det)
            rows = params.samples(group)  # row r of the result: its own seed
            rewards = np.array([reward(t) for t in gen.texts], np.float32)
            batch = ll.rollout_batch(gen, width)  # one width: one trainer program
            ids, plen, lens = batch.token_ids, batch.prompt_lengths, batch.lengths
            old, mask = batch.logprobs, batch.completion_mask
            adv = group_advantages(rewards, group)
            (loss, lp), grads = grad_fn(model, ids, plen, lens, rows, old, adv, mask)
            max_delta, kl = mismatch(np.asarray(lp), old, mask)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), nnx.state(grads, nnx.Param))
            updates, opt_state = opt.update(grads, opt_state, master)
            master = optax.apply_updates(master, updates)
            nnx.update(model, jax.tree.map(lambda w, m: m.astype(w.dtype), weights, master))
        entry = dict(
            step=step, reward=float(rewards.mean()), max_abs_delta=max_delta, kl=kl,
            loss=float(loss), tokens=int(mask.sum()), compiles=watch.count,
            seconds=round(time.perf_counter() - start, 2),
        )  # fmt: skip
        log.append(entry)
        print(json.dumps(entry), flush=True)
    (out / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    plot(log, out / "grpo.png", det)
    return log


def plot(log: list[dict], path: Path, det: bool) -> None:
    import matplotlib  # noqa: PLC0415 - the `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    steps = [e["step"] for e in log]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    top.plot(steps, [e["reward"] for e in log], marker=".")
    top.set_ylabel("mean reward")
    top.set_title(f"GRPO on the shipped model (deterministic={det})")
    bottom.plot(steps, [e["max_abs_delta"] for e in log], marker=".", label="max |delta|")
    bottom.plot(steps, [e["kl"] for e in log], marker=".", label="KL (k3)")
    bottom.set_ylabel("rollout vs trainer")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
