"""Run in a subprocess with 8 CPU devices (`tests/sharding/_run.worker_env`): LoRA adapters
and steering vectors per row on meshes against one device, the worker's tiny Llama
(`workers.tiny_model`) with two random adapters on every attention and MLP projection.
`python -m tests.sharding.lora_worker CASE...`; prints one `RESULT:` JSON line
(`tests/sharding/test_lora_mesh.py` checks it). The cases:

- generate: a greedy batch mixing "a", "b" and the base (one prompt under all three) on
  (2, 4) and on one device, and where the table and the rows' slots are placed;
- more: `n=2` sampled rows and `stream` on (2, 4); steering vectors (`steer=`) beside
  the adapters; `generate_many` on the paged pool with the prefix cache, each request's
  adapter and `Request.steer`, one request bringing adapter "c" into the running job
  (and a second job bringing "d", counting its compiles); `score`; all against one
  device;
- deterministic: the mixed batch under `deterministic=True` on (2, 1) and under
  "model-parallel" on (1, 2), each against one device in its mode.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

import logitloop as ll
from logitloop.decoding.engine.plan import Options, plan
from logitloop.decoding.runtime.compiles import CompileWatch
from tests.sharding.workers import PROMPTS, emit, make_mesh, summarize, tiny_model

TOKENS = 5
GREEDY = dict(temperature=0.0, max_new_tokens=TOKENS, ignore_eos=True, logprobs=0)
# The batch: PROMPTS[0] under each adapter and the base, then two more prompts.
BATCH = [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[3]]
ROWS = ["a", None, "b", "b", "a"]
WIDTH = 64  # the model's residual stream


def adapter(model, rank: int, seed: int) -> tuple[dict, dict]:
    """Random PEFT-named tensors of `rank` on every projection of `model`, and the config."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for (layer, target), (k, n) in model.lora_sites().items():
        part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"base_model.model.model.layers.{layer}.{part}.{target}"
        tensors[name + ".lora_A.weight"] = rng.normal(0, 0.3, (rank, k)).astype(np.float32)
        tensors[name + ".lora_B.weight"] = rng.normal(0, 0.3, (n, rank)).astype(np.float32)
    return tensors, {"r": rank, "lora_alpha": 2 * rank}


def load(table, model, name: str, rank: int, seed: int):
    """`table` with a random adapter (`adapter`) loaded as `name`."""
    tensors, config = adapter(model, rank, seed)
    return table.load(tensors, name=name, config=config)


def spec(x) -> list:
    """An array's partition spec as a list, and whether every device holds all of it."""
    whole = all(s.data.shape == x.shape for s in x.addressable_shards)
    return [[None if a is None else str(a) for a in x.sharding.spec], whole]


def rows_of(results) -> dict:
    """`generate_many`'s one-row results as one batch's fields."""
    rows = [summarize(r) for r in results]
    return {k: [r[k] and r[k][0] for r in rows] for k in ("token_ids", "raw_logprobs")}


def case_generate(model, table, out: dict) -> None:
    mesh = make_mesh((2, 4))
    kw = dict(GREEDY, adapters=table, adapter=ROWS)
    out["single"] = summarize(ll.generate(model, BATCH, **kw))
    out["mesh_2x4"] = summarize(ll.generate(model, BATCH, **kw, mesh=mesh))
    job = plan(model, Options(mesh=mesh, adapters=table, adapter="a"), adapters=True)
    placed = job.options.adapters
    rows = job.layout.place_rows(job.adapter_rows(4, 4))
    out["layout"] = {"table": spec(placed.table.sites["0.q_proj"][1]), "slots": spec(rows.adapter)}
    # a table placed on the mesh stays there when an adapter is loaded (a running job's)
    loaded = load(placed, model, "c", 2, 3)
    out["layout"]["loaded"] = spec(loaded.table.sites["1.down_proj"][0])


def case_more(model, table, out: dict) -> None:
    mesh = make_mesh((2, 4))
    sampled = dict(GREEDY, adapters=table, adapter=ROWS[1:], n=2, temperature=0.9, seed=7)
    for where, m in (("single", None), ("mesh", mesh)):
        out[f"n2_{where}"] = summarize(ll.generate(model, BATCH[1:], **sampled, mesh=m))
    streamed = [[] for _ in range(8)]
    for event in ll.stream(model, BATCH[1:], **sampled, mesh=mesh, chunk_steps=2):
        streamed[event.row] += event.token_ids
    out["stream_mesh"] = streamed
    vector = np.random.default_rng(5).normal(0, 1.0, WIDTH).astype(np.float32)
    steer = [ll.Steer(vector, 0, 4.0), None, ll.Steer(vector, 1, -3.0, "generated"), None, None]
    steered = dict(GREEDY, adapters=table, adapter=ROWS, steer=steer)
    for where, m in (("single", None), ("mesh", mesh)):
        out[f"steer_{where}"] = summarize(ll.generate(model, BATCH, **steered, mesh=m))
    # generate_many: a shared two-page prefix, each request's adapter and vectors, and
    # "c" brought by the fourth request (loaded into the running job's table)
    prefix = [3, 4, 5, 6, 7, 8, 9, 10]
    names = [*ROWS[:3], ("c", adapter(model, 2, 3)), "c"]
    requests = [
        ll.Request(prefix + p, adapter=name, steer=s)
        for p, name, s in zip(BATCH, names, steer, strict=True)
    ]
    job = dict(GREEDY, slots=4, kv_cache_tokens=96, page_size=4, adapters=table)
    for where, m in (("single", None), ("mesh", mesh)):
        stats: dict = {}
        results = ll.generate_many(model, requests, **job, mesh=m, stats=stats)
        out[f"many_{where}"] = rows_of(results)
        out[f"many_{where}_cached"] = stats["cached_tokens"]
    # the same job on the mesh again, bringing another adapter as "d": it compiles nothing
    requests[3:] = [
        dataclasses.replace(requests[3], adapter=("d", adapter(model, 4, 9))),
        dataclasses.replace(requests[4], adapter="d"),
    ]
    with CompileWatch() as watch:
        ll.generate_many(model, requests, **job, mesh=mesh)
    out["many_mesh_again_compiles"] = watch.count
    conts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12]]
    for where, m in (("single", None), ("mesh", mesh)):
        scores = ll.score(model, BATCH, conts, adapters=table, adapter=ROWS, mesh=m)
        out[f"score_{where}"] = [s.raw_logprobs for s in scores]


def case_deterministic(model, table, out: dict) -> None:
    for mode, shape in ((True, (2, 1)), ("model-parallel", (1, 2))):
        kw = dict(GREEDY, adapters=table, adapter=ROWS, deterministic=mode)
        name = f"{shape[0]}x{shape[1]}"
        out[f"det_{name}_single"] = summarize(ll.generate(model, BATCH, **kw))
        out[f"det_{name}"] = summarize(ll.generate(model, BATCH, **kw, mesh=make_mesh(shape)))


def main(cases: list[str]) -> None:
    model = tiny_model()
    table = ll.Adapters.create(model, max_adapters=3, max_rank=8)
    table = load(load(table, model, "a", 4, 1), model, "b", 8, 2)
    out: dict = {}
    for case in cases:
        globals()[f"case_{case}"](model, table, out)
    emit(out)


if __name__ == "__main__":
    main(sys.argv[1:])
