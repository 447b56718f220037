"""Run in a subprocess with 8 CPU devices (`tests/sharding/_run.worker_env`): with
`deterministic=True`, the shipped model (bfloat16, as shipped) and a random float32 Llama
with grouped-query attention, each on one device and on data-parallel meshes, by `generate`
and by `generate_many`; prints one RESULT: line."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

import logitloop as ll
from tests.decoding.random_llama import small_llama


def _rows(result) -> dict:
    return {
        "token_ids": result.token_ids,
        "raw_logprobs": result.raw_logprobs,
        "logprobs": result.logprobs,
        "finish_reason": result.finish_reason,
    }


def main(shapes: list[str]) -> None:
    models = {"shipped": ll.load_pretrained(), "gqa_llama": small_llama(512, 512, 5)}
    rng = np.random.default_rng(0)
    out = {}
    for name, model in models.items():
        vocab = model.config.vocab_size
        batch = 8 if name == "shipped" else 6  # 6 rows: padded to 8 on the (8, 1) mesh
        prompts = [rng.integers(1, vocab - 2, int(rng.integers(3, 30))).tolist()
                   for _ in range(batch)]
        params = ll.SamplingParams.create(
            batch_size=batch,
            temperature=rng.uniform(0.0, 1.2, batch).tolist(),
            seed=list(range(batch)),
            max_tokens=rng.integers(4, 13, batch).tolist(),
            top_p=0.95,
        )

        run = dict(ignore_eos=True, deterministic=True)
        out[f"{name}/one"] = _rows(ll.generate(model, prompts, params, **run))
        for shape in shapes:
            mesh = jax.make_mesh(tuple(int(x) for x in shape.split("x")), ("data", "model"))
            out[f"{name}/{shape}"] = _rows(ll.generate(model, prompts, params, mesh=mesh, **run))
        # generate_many on the first mesh: 4 slots for `batch` requests, so slots are reused.
        dims = tuple(int(x) for x in shapes[0].split("x"))
        requests = [(p, params.take([r])) for r, p in enumerate(prompts)]
        many = ll.generate_many(
            model, requests, slots=dims[0], ignore_eos=True, deterministic=True,
            mesh=jax.make_mesh(dims, ("data", "model")),
        )
        rows = [_rows(res) for res in many]
        out[f"{name}/many_{shapes[0]}"] = {k: [r[k][0] for r in rows] for k in rows[0]}
    print("RESULT:" + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
