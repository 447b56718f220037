"""Run in a subprocess with 2 CPU devices (`tests/sharding/_run.worker_env`): a quantized
model (int4 projections and both vocabulary tables, `quantize_embedding=True`) on (1, 2)
and (2, 1) meshes against one device (plain, `deterministic=True` and "model-parallel"),
its weights' and scales' layouts, and an Orbax checkpoint of it restored straight onto
the (1, 2) mesh (`restore_sharded`). Prints one `RESULT:` JSON line
(`tests/sharding/test_quantized_mesh.py` checks it)."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import logitloop as ll  # noqa: E402
from logitloop.models import orbax_io, partitioning, quantization  # noqa: E402
from tests.sharding.workers import PROMPTS, emit, make_mesh, summarize, tiny_model  # noqa: E402

STEPS = 4


def layouts(model) -> dict:
    """Per parameter path (a quantized weight's values and scales apart): its spec as a
    list, its first shard's shape and its global shape."""
    state = quantization.to_storable(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        spec = [None if a is None else str(a) for a in x.sharding.spec]
        out[jax.tree_util.keystr(path)] = [spec, list(x.addressable_shards[0].data.shape),
                                           list(x.shape)]  # fmt: skip
    return out


def leaves_equal(a, b) -> bool:
    def leaves(m):
        return jax.tree.leaves(nnx.to_pure_dict(nnx.state(m, nnx.Param)))

    return all(
        x.dtype == y.dtype
        and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(leaves(a), leaves(b), strict=True)
    )


def main() -> None:
    model = tiny_model()
    spec = quantization.check_quantize("int4", 16, quantize_embedding=True)
    quantization.quantize_model(model, spec)
    greedy = dict(max_new_tokens=STEPS, temperature=0.0)
    out: dict = {"describe": model.quantization.describe()}
    out["single"] = summarize(ll.generate(model, PROMPTS, **greedy))
    out["mesh_1x2"] = summarize(ll.generate(model, PROMPTS, **greedy, mesh=make_mesh((1, 2))))
    det = dict(greedy, deterministic=True)
    out["det_single"] = summarize(ll.generate(model, PROMPTS, **det))
    out["det_2x1"] = summarize(ll.generate(model, PROMPTS, **det, mesh=make_mesh((2, 1))))
    # the model axis: deterministic="model-parallel" (weights dequantized at each product)
    mp = dict(greedy, deterministic="model-parallel")
    out["mp_single"] = summarize(ll.generate(model, PROMPTS, **mp))
    out["mp_1x2"] = summarize(ll.generate(model, PROMPTS, **mp, mesh=make_mesh((1, 2))))
    mesh = make_mesh((1, 2))
    with tempfile.TemporaryDirectory() as tmp:
        orbax_io.save_converted(model, os.path.join(tmp, "q"))
        restored = orbax_io.restore_sharded(os.path.join(tmp, "q"), mesh)
        out["restored_quantization_equal"] = restored.quantization == model.quantization
        out["restored_equal"] = leaves_equal(model, restored)
        out["restored_layouts"] = layouts(restored)
        out["restored_1x2"] = summarize(ll.generate(restored, PROMPTS, **greedy, mesh=mesh))
    partitioning.shard_model(model, mesh)
    out["sharded_layouts"] = layouts(model)
    out["devices"] = jax.device_count()
    emit(out)


if __name__ == "__main__":
    main()
