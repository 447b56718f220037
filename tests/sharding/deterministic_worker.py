"""Run in a subprocess with 8 CPU devices (`tests/sharding/_run.worker_env`): the shipped
model, `deterministic=True`, on one device and on meshes; prints one RESULT: line."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

import logitloop as ll


def main(shapes: list[str]) -> None:
    model = ll.load_pretrained()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 4096, int(rng.integers(3, 30))).tolist() for _ in range(8)]
    params = ll.SamplingParams.create(
        batch_size=8,
        temperature=rng.uniform(0.0, 1.2, 8).tolist(),
        seed=list(range(8)),
        max_tokens=12,
        top_p=0.95,
    )

    def run(mesh):
        r = ll.generate(model, prompts, params, ignore_eos=True, mesh=mesh, deterministic=True)
        return {"token_ids": r.token_ids, "raw_logprobs": r.raw_logprobs, "logprobs": r.logprobs}

    out = {"one": run(None)}
    for shape in shapes:
        dims = tuple(int(x) for x in shape.split("x"))
        out[shape] = run(jax.make_mesh(dims, ("data", "model")))
    print("RESULT:" + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
