"""Run in a subprocess with 8 CPU devices (`tests/sharding/_run.worker_env`): with
deterministic decoding, the shipped model (bfloat16, as shipped) and a random float32 Llama
with grouped-query attention, each on one device and on the meshes named on the command
line (data-parallel and model-parallel), by `generate` and, on the first mesh and the
first model-parallel one, by `generate_many`; and the last-column logits of one prefill
pass on each mesh (the model alone, without the sampler). Data-parallel meshes run with
`deterministic=True`, model-parallel ones with `deterministic="model-parallel"`, each
against the one-device run in the same mode. Prints one RESULT: line."""

from __future__ import annotations

import functools
import json
import sys

import jax
import numpy as np

import logitloop as ll
from logitloop.decoding.engine import host
from logitloop.decoding.loop import decode_loop as loop
from logitloop.decoding.loop import sharding
from logitloop.decoding.loop.runner import model_info, runner_jit
from tests.decoding.random_llama import small_llama


def _rows(result) -> dict:
    return {
        "token_ids": result.token_ids,
        "raw_logprobs": result.raw_logprobs,
        "logprobs": result.logprobs,
        "finish_reason": result.finish_reason,
    }


def _mode(shape: str) -> bool | str:
    """The mode a mesh `DATAxMODEL` is run in: `deterministic=True` on a data-parallel
    mesh, "model-parallel" where the model axis has more than one device."""
    return True if shape.endswith("x1") else "model-parallel"


def _prefill_logits(model, prompts, mesh, mode) -> list:
    """Float32 logits of one deterministic (`mode`) prompt pass (`loop.forward_prompt`, laid
    out as `generate` lays it out), as lists of floats (their bits survive JSON: `repr` of
    a float round-trips). Rows are padded with copies of the first to 8, a multiple of
    every mesh's data axis."""
    prompts = prompts + prompts[:1] * (-len(prompts) % 8)
    layout = sharding.layout_for(mesh, whole_vocab=mode == "model-parallel")
    info = layout.place(model_info(model, deterministic=mode))
    batch = host.prompt_batch(prompts, 16)

    @functools.partial(runner_jit, static_argnames="runner")
    def forward(runner, weights, prompt, positions):
        prompt, positions = layout.rows((prompt, positions))
        return loop.forward_prompt(runner, weights, prompt, positions, batch.cache_len, layout)[0]

    return np.asarray(forward(info.runner, info.weights, batch.prompt, batch.positions)).tolist()


def main(shapes: list[str]) -> None:
    models = {"shipped": ll.load_pretrained(), "gqa_llama": small_llama(512, 512, 5)}
    rng = np.random.default_rng(0)
    out = {}
    for name, model in models.items():
        vocab = model.config.vocab_size
        batch = 8 if name == "shipped" else 6  # 6 rows: padded to 8 on the (8, 1) mesh
        prompts = [
            rng.integers(1, vocab - 2, int(rng.integers(3, 30))).tolist() for _ in range(batch)
        ]
        params = ll.SamplingParams.create(
            batch_size=batch,
            temperature=rng.uniform(0.0, 1.2, batch).tolist(),
            seed=list(range(batch)),
            max_tokens=rng.integers(4, 13, batch).tolist(),
            top_p=0.95,
        )

        for mode, key in ((True, "one"), ("model-parallel", "one_mp")):
            run = dict(ignore_eos=True, deterministic=mode)
            out[f"{name}/{key}"] = _rows(ll.generate(model, prompts, params, **run))
            out[f"{name}/logits_{key}"] = _prefill_logits(model, prompts, None, mode)
        for shape in shapes:
            mesh = jax.make_mesh(tuple(int(x) for x in shape.split("x")), ("data", "model"))
            run = dict(ignore_eos=True, deterministic=_mode(shape), mesh=mesh)
            out[f"{name}/{shape}"] = _rows(ll.generate(model, prompts, params, **run))
            out[f"{name}/logits_{shape}"] = _prefill_logits(model, prompts, mesh, _mode(shape))
        # generate_many on the first mesh and on the first model-parallel one, with as many
        # slots as the data axis has devices: fewer than the requests, so slots are reused.
        requests = [(p, params.take([r])) for r, p in enumerate(prompts)]
        many_on = [shapes[0], *[m for m in shapes if not m.endswith("x1")][:1]]
        for shape in many_on:
            dims = tuple(int(x) for x in shape.split("x"))
            many = ll.generate_many(
                model,
                requests,
                slots=dims[0],
                ignore_eos=True,
                deterministic=_mode(shape),
                mesh=jax.make_mesh(dims, ("data", "model")),
            )
            rows = [_rows(res) for res in many]
            out[f"{name}/many_{shape}"] = {k: [r[k][0] for r in rows] for k in rows[0]}
        if "2x1" in shapes:  # a pool per data shard that holds the longest row alone
            most = np.asarray(params.max_tokens).tolist()
            lengths = [len(p) + m - 1 for p, m in zip(prompts, most, strict=True)]
            many = ll.generate_many(
                model, requests, slots=8, kv_cache_tokens=2 * -(-max(lengths) // 4) * 4,
                page_size=4, prefix_cache=False, ignore_eos=True,
                deterministic=True, mesh=jax.make_mesh((2, 1), ("data", "model")),
            )  # fmt: skip
            rows = [_rows(res) for res in many]
            out[f"{name}/paged_2x1"] = {k: [r[k][0] for r in rows] for k in rows[0]}
    print("RESULT:" + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
