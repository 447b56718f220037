"""JAX work for the sharding tests, run in subprocesses with 8 (or 2) fake CPU devices.

`python -m tests.sharding.workers NAME [ARGS...]` from the repository root; the parent test
sets XLA_FLAGS / JAX_PLATFORMS in the environment before this module imports jax. Each
worker prints one JSON line prefixed with RESULT: that the test parses.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx, struct  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import logitloop as ll  # noqa: E402
from logitloop.decoding.loop import sharding  # noqa: E402
from logitloop.models import (  # noqa: E402
    LlamaConfig,
    LlamaModel,
    restore_converted,
    save_converted,
)

VOCAB = 256


def tiny_model(seed: int = 0) -> LlamaModel:
    """2 layers, 8 query heads over 4 kv heads: with a model axis of 8 the kv heads fall
    back to replication, with 4 everything divides."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        max_position_embeddings=128,
        eos_token_id=(1,),
    )
    model = LlamaModel(config, rngs=nnx.Rngs(seed))
    # Sharper logits than the 0.02 init gives, so sampled rows are far from uniform.
    model.lm_head[...] = model.lm_head[...] * 40.0
    return model


PROMPTS = [[5, 9, 13], [7, 3, 200, 41, 17, 99, 8], [250], [11] * 12, [4, 8, 15, 16, 23]]


def mixed_params() -> ll.SamplingParams:
    """A ragged batch with mixed rows: greedy (row 0), top-p, top-k, top-p with min-p and
    top-k over more than the 64 candidates; penalties, bias, bans, min_tokens, logprobs."""
    return ll.SamplingParams.create(
        batch_size=5,
        temperature=[0.0, 0.8, 1.0, 1.3, 0.7],
        top_k=[0, 0, 20, 0, 100],
        top_p=[1.0, 0.9, 1.0, 0.6, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.05, 0.0],
        repetition_penalty=[1.0, 1.2, 1.0, 1.0, 1.1],
        presence_penalty=[0.0, 0.0, 0.5, 0.0, 0.0],
        frequency_penalty=[0.0, 0.0, 0.0, 0.3, 0.0],
        logit_bias=[{3: 2.0}, None, {17: -5.0, 200: 3.0}, None, None],
        banned_token_ids=[[], [0, 2], [], [5], []],
        seed=[0, 1, 2, 3, 4],
        max_tokens=[8, 12, 5, 10, 16],
        min_tokens=[0, 2, 0, 0, 3],
        logprobs=[0, 3, 0, 0, 5],
    )


@struct.dataclass
class ForceAt:
    """At generated index `at`, only `token` may be drawn (the processors issue's example)."""

    at: jax.Array
    token: jax.Array

    def init(self, batch_size, vocab_size):
        return jnp.zeros((batch_size, 0))

    def apply(self, state, logits, step):
        forced = jnp.where(jnp.arange(logits.shape[1]) == self.token[:, None], 0.0, -jnp.inf)
        return jnp.where((step.positions == self.at)[:, None], forced, logits)

    def update(self, state, tokens, step):
        return state


@struct.dataclass
class BanPrevious:
    """Stateful: lowers the row's previous token by `strength` (the state remembers it)."""

    strength: jax.Array

    def init(self, batch_size, vocab_size):
        return jnp.full((batch_size,), -1, jnp.int32)

    def apply(self, state, logits, step):
        hit = jnp.arange(logits.shape[1])[None, :] == state[:, None]
        return logits - jnp.where(hit, self.strength[:, None], 0.0)

    def update(self, state, tokens, step):
        return tokens


def summarize(result: ll.GenerationResult) -> dict:
    return {
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "logprobs": result.logprobs,
        "raw_logprobs": result.raw_logprobs,
        "top_ids": None
        if result.top_logprobs is None
        else [[sorted(d) for d in row] for row in result.top_logprobs],
    }


def emit(obj) -> None:
    print("RESULT:" + json.dumps(obj), flush=True)


def make_mesh(shape, devices=None):
    return jax.make_mesh(tuple(shape), ("data", "model"), devices=devices)


def param_layouts(original, restored) -> dict:
    """Per parameter of `restored`: its spec, global shape, each shard's (device id, index
    as [start, stop] per dimension) and whether its values equal `original`'s bit for bit."""
    want = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(original, nnx.Param)))
    got = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(restored, nnx.Param)))
    out = {}
    for (path, a), (path_b, b) in zip(want[0], got[0], strict=True):
        assert path == path_b
        shards = [
            [
                shard.device.id,
                [list(sl.indices(dim)[:2]) for sl, dim in zip(shard.index, b.shape, strict=True)],
            ]
            for shard in b.addressable_shards
        ]
        out[jax.tree_util.keystr(path)] = {
            "spec": str(b.sharding.spec),
            "shape": list(b.shape),
            "shards": shards,
            "equal": bool(
                np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
            ),
        }
    return out


def worker_meshes(shapes: list[str]) -> None:
    """generate on one device and on each of `shapes` ("8x1", "2x4", "1x8"; (2, 4) always);
    stream and an Orbax restore on (2,4) (these two reuse the compiled (2,4) programs)."""
    t0 = time.time()
    model = tiny_model()
    params = mixed_params()
    out: dict = {"single": summarize(ll.generate(model, PROMPTS, params)), "meshes": {}}
    for shape in sorted({(2, 4), *(tuple(map(int, x.split("x"))) for x in shapes)}):
        mesh = make_mesh(shape)
        out["meshes"][f"{shape[0]}x{shape[1]}"] = summarize(
            ll.generate(model, PROMPTS, params, mesh=mesh)
        )
    mesh = make_mesh((2, 4))
    # stream on the mesh: deltas concatenate to generate's tokens
    streamed = [[] for _ in PROMPTS]
    finish = [None] * len(PROMPTS)
    for ev in ll.stream(model, PROMPTS, params, mesh=mesh, chunk_steps=3):
        assert 0 <= ev.row < len(PROMPTS), ev.row
        streamed[ev.row] += ev.token_ids
        if ev.finish_reason is not None:
            finish[ev.row] = ev.finish_reason
    out["stream_2x4"] = {"token_ids": streamed, "finish_reason": finish}
    # Processors on the mesh: the sampling step keeps whole vocabulary rows per device.
    procs = [
        BanPrevious(strength=jnp.asarray([50.0, 0.0, 2.0, 50.0, 1.0])),
        ForceAt(at=jnp.asarray([1, 0, 3, 99, 2]), token=jnp.asarray([7, 9, 11, 0, 200])),
    ]
    out["procs_single"] = summarize(ll.generate(model, PROMPTS, params, processors=procs))
    out["procs_2x4"] = summarize(ll.generate(model, PROMPTS, params, mesh=mesh, processors=procs))
    # generate_many on the mesh: 4 slots over the 2-way data axis, each request under its
    # own row of the batch's params; each result holds one row.
    requests = [(p, params.take([r])) for r, p in enumerate(PROMPTS)]
    many = [summarize(res) for res in ll.generate_many(model, requests, slots=4, mesh=mesh)]
    out["many_2x4"] = {k: [m[k] and m[k][0] for m in many] for k in many[0]}
    # ... and with a paged pool of 48 tokens, 24 per data shard (pages of 4: rows preempted
    # and resumed), its heads over the model axis and its pages over the data axis.
    stats: dict = {}
    with _first_decode(compile=False) as first:
        out["paged_2x4"] = _paged_job(model, requests, mesh, stats)
    out["paged_stats"] = stats
    out["paged_pool"] = first
    # Orbax: restore a converted checkpoint straight onto the (2, 4) mesh's shardings.
    with tempfile.TemporaryDirectory() as tmp:
        save_converted(model, os.path.join(tmp, "conv"))
        restored = sharding.restore_sharded(os.path.join(tmp, "conv"), mesh)
        wq = restored.layers[0].wq[...]
        wk = restored.layers[0].wk[...]
        head = restored.lm_head[...]
        norm = restored.final_norm[...]
        out["restored_layout"] = {
            "wq": [str(wq.sharding.spec), list(wq.addressable_shards[0].data.shape)],
            "wk": [str(wk.sharding.spec), list(wk.addressable_shards[0].data.shape)],
            "lm_head": [str(head.sharding.spec), list(head.addressable_shards[0].data.shape)],
            "final_norm": [str(norm.sharding.spec), list(norm.addressable_shards[0].data.shape)],
        }
        out["restored_2x4"] = summarize(ll.generate(restored, PROMPTS, params, mesh=mesh))
        out["restored_params"] = param_layouts(model, restored)
        # The same checkpoint onto shardings mapped from the logical axis names by hand,
        # partitioning over both mesh axes.
        rules = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
        rules["embed"] = "data"
        logical = nnx.get_partition_spec(nnx.state(model, nnx.Param))
        shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, P(*(rules.get(n) for n in spec))),
            nnx.to_pure_dict(logical),
            is_leaf=lambda x: isinstance(x, P),
        )
        by_names = restore_converted(os.path.join(tmp, "conv"), sharding=shardings)
        out["restored_by_names"] = param_layouts(model, by_names)
    out["seconds"] = time.time() - t0
    emit(out)


def _random_logits(rng, batch, vocab):
    x = rng.normal(size=(batch, vocab)).astype(np.float32) * rng.uniform(0.5, 4.0, (batch, 1))
    x[0, :] = 0.0  # all tied
    x[1, 7::11] = x[1].max() + 1.0  # ties at the top
    x[2, 100:] = -np.inf  # masked tail
    return jnp.asarray(x)


_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (.+?) "
    r"(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter|collective-broadcast)"
    r"(?:-start)?\("
)


def _paged_job(model, requests, mesh, stats, **options) -> dict:
    """`generate_many` of `requests` on 4 slots sharing a pool of 48 tokens in pages of 4
    (on a mesh: 24 per data shard), each request's one row."""
    results = ll.generate_many(
        model, requests, slots=4, mesh=mesh, kv_cache_tokens=48, page_size=4, stats=stats,
        **options,
    )  # fmt: skip
    rows = [summarize(res) for res in results]
    return {k: [m[k] and m[k][0] for m in rows] for k in rows[0]}


def worker_paged_mesh() -> None:
    """The paged pool on the (2, 4) mesh: the collectives of its compiled decode step, the
    prefix cache on the mesh against prefix_cache=False (requests behind a shared 8-token
    prefix, two pages of 4), a deterministic job with preemptions on a (2, 1) mesh and
    `generate` with n = 2, each against one device."""
    model, params, mesh = tiny_model(), mixed_params(), make_mesh((2, 4))
    requests = [(p, params.take([r])) for r, p in enumerate(PROMPTS)]
    out: dict = {}
    with _first_decode(compile=True) as first:
        out["paged_2x4"] = _paged_job(model, requests, mesh, {})
    out["paged_pool"] = first
    # A user's model (the same module as an `ll.FunctionModel` through `ll.attention`,
    # docs/own_model.md) on the same mesh and pool as the family: its weights replicated,
    # its rows and pages over the data axis.
    graphdef, state = nnx.split(model)
    user = ll.FunctionModel(
        lambda w, t, p, kv: nnx.merge(graphdef, w)(t, p, kv), state,
        kv_spec=model.kv_spec, vocab_size=model.config.vocab_size, max_length=256,
    )  # fmt: skip
    out["user_paged_2x4"] = _paged_job(user, requests, mesh, {})
    shared = [[30 + i for i in range(8)] + p for p in PROMPTS]
    for cache in (True, False):
        stats: dict = {}
        many = ll.generate_many(
            model, [(p, params.take([r])) for r, p in enumerate(shared)], slots=4, mesh=mesh,
            page_size=4, prefix_cache=cache, stats=stats,
        )  # fmt: skip
        many = [summarize(res) for res in many]
        out[f"prefix_{cache}"] = {k: [m[k] and m[k][0] for m in many] for k in many[0]}
        out[f"prefix_{cache}_stats"] = stats
    # deterministic=True on a (2, 1) mesh with rows preempted: one device's bits.
    stats = {}
    det = make_mesh((2, 1), jax.devices()[:2])
    out["det_paged_2x1"] = _paged_job(model, requests, det, stats, deterministic=True)
    out["det_paged_stats"] = stats
    out["det_single"] = summarize(ll.generate(model, PROMPTS, params, deterministic=True))
    # generate with n = 2: 4 prompts, two per data shard, each prefilled once.
    forked = params.take([0, 1, 2, 3])
    out["forked_single"] = summarize(ll.generate(model, PROMPTS[:4], forked, n=2))
    out["forked_2x4"] = summarize(ll.generate(model, PROMPTS[:4], forked, n=2, mesh=mesh))
    emit(out)


class _first_decode:
    """Within `with _first_decode(compile) as first:`, `generate_many`'s first decode chunk
    fills `first` with its pool's layout (the first layer's `k_pages`: global shape, spec,
    each device's shard shape) and, with `compile`, the collectives of its compiled
    program (compiled once more: a default-suite test skips that)."""

    def __init__(self, compile: bool):
        self.compile = compile

    def __enter__(self) -> dict:
        from logitloop.decoding.engine import batcher

        self.module, self.decode, first = batcher, batcher.decode, {}

        def spy(program, tables, state, steps):
            if not first:
                pages = state.cache[0]["k_pages"]
                first["shape"] = list(pages.shape)
                first["spec"] = str(pages.sharding.spec)
                first["shards"] = sorted({s.data.shape for s in pages.addressable_shards})
            if self.compile and "collectives" not in first:
                compiled = self.decode.trace(program, tables, state, steps).lower().compile()
                first["collectives"] = collective_results(compiled.as_text())
            return self.decode(program, tables, state, steps)

        batcher.decode = spy
        return first

    def __exit__(self, *exc) -> None:
        self.module.decode = self.decode


def collective_results(hlo_text: str) -> list:
    """[op, [shape, ...]] for each cross-device collective in a compiled HLO module's text:
    the shapes of its result (a tuple result lists each element)."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.match(line)
        if m:
            shapes = [
                [int(d) for d in dims.split(",") if d]
                for dims in re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", m.group(1))
            ]
            out.append([m.group(2), shapes])
    return out


def _unambiguous_logits(rng, batch, vocab, top_k, top_p, min_p, greedy):
    """`_random_logits` whose sampled rows' kept sets do not hinge on float32 rounding.

    The sharded top-p sums masses in another order than the unsharded operator, which may
    move a nucleus boundary by a few ulps (`logitloop.ops.sampling.sharded`). A row the
    float64 reference calls ambiguous (a near-tie within `MARGIN` at a boundary, or a
    cumulative mass within `MASS_MARGIN` of p; see `tests/decoding/reference.py`) is
    redrawn. Returns (logits [B, V] f32, per row the reference's kept set, None if greedy).
    """
    from tests.decoding.reference import AmbiguousBoundary, reference_distribution
    from tests.decoding.sampler_cases import MARGIN, MASS_MARGIN

    x = np.array(_random_logits(rng, batch, vocab))
    kept: list = [None] * batch
    for r in range(batch):
        while not bool(greedy[r]):
            try:
                _, kept[r] = reference_distribution(
                    x[r],
                    top_k=int(top_k[r]),
                    top_p=float(top_p[r]),
                    min_p=float(min_p[r]),
                    margin=MARGIN,
                    mass_margin=MASS_MARGIN,
                )
                break
            except AmbiguousBoundary:
                x[r] = rng.normal(size=vocab).astype(np.float32) * rng.uniform(0.5, 4.0)
    return x, kept


def worker_sampler() -> None:
    """The vocabulary-sharded operator and sampling step against the unsharded ones."""
    from logitloop.decoding.sampling import sampler
    from logitloop.ops.sampling import sharded, xla
    from logitloop.ops.sampling.noise import row_keys

    t0 = time.time()
    rng = np.random.default_rng(0)
    batch, vocab = 16, 1024
    settings = {
        "greedy": dict(top_k=1),
        "temperature": dict(),
        "top_k_small": dict(top_k=5),
        "top_k_far": dict(top_k=300),  # > 64 candidates: count bisection
        "top_p_narrow": dict(top_p=0.3),
        "top_p_wide": dict(top_p=0.995),  # nucleus wider than the candidates: mass bisection
        "min_p": dict(min_p=0.05),
        "mixed": dict(
            top_k=rng.choice([0, 1, 3, 40, 200, 2000], batch),
            top_p=rng.choice([1.0, 0.2, 0.9, 0.999], batch),
            min_p=rng.choice([0.0, 0.0, 0.1], batch),
        ),
    }
    meshes = {"1x8": (make_mesh((1, 8)), None), "2x4": (make_mesh((2, 4)), "data")}
    mismatches: list = []
    compared = 0
    checked_rows = 0
    ref = jax.jit(xla.filter_and_sample)
    fns = {
        k: jax.jit(lambda *a, m=m, b=b: sharded.filter_and_sample_sharded(*a, mesh=m, batch_axis=b))
        for k, (m, b) in meshes.items()
    }
    for name, s in settings.items():
        top_k = jnp.asarray(np.broadcast_to(s.get("top_k", 0), batch), jnp.int32)
        top_p = jnp.asarray(np.broadcast_to(s.get("top_p", 1.0), batch), jnp.float32)
        min_p = jnp.asarray(np.broadcast_to(s.get("min_p", 0.0), batch), jnp.float32)
        greedy = top_k == 1
        for trial in range(3):
            x, ref_kept = _unambiguous_logits(rng, batch, vocab, top_k, top_p, min_p, greedy)
            x = jnp.asarray(x)
            key = row_keys(jnp.arange(batch, dtype=jnp.uint32) + 100 * trial, jnp.zeros(batch))
            want, want_thr = ref(x, top_k, top_p, min_p, greedy, key)
            runs = {"unsharded": (want, want_thr)}
            for mname, fn in fns.items():
                runs[mname] = fn(x, top_k, top_p, min_p, greedy, key)
            for mname, (got, got_thr) in runs.items():
                compared += batch
                # Every sampled row's kept set is the float64 reference's, exactly.
                kept = (x >= got_thr.kept[:, None]) & jnp.isfinite(x)
                rows = [r for r in range(batch) if ref_kept[r] is not None]
                checked_rows += len(rows)
                bad = [r for r in rows if not np.array_equal(np.asarray(kept[r]), ref_kept[r])]
                if bad:
                    mismatches.append([name, mname, trial, f"kept set, rows {bad}"])
                if mname == "unsharded":
                    continue
                if not np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens)):
                    mismatches.append([name, mname, trial, "tokens"])
                # A top-p threshold found by bisection may be any value between the last
                # kept and the first dropped token, so only the other thresholds must be
                # bit-equal; the kept sets above are compared for every setting.
                if not all(
                    np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(
                        (got_thr.row_max, got_thr.top_k, got_thr.min_p),
                        (want_thr.row_max, want_thr.top_k, want_thr.min_p),
                        strict=True,
                    )
                ):
                    mismatches.append([name, mname, trial, "thresholds"])
                lp_err = float(np.max(np.abs(np.asarray(got.logprobs) - np.asarray(want.logprobs))))
                if not lp_err < 1e-4:
                    mismatches.append([name, mname, trial, f"logprobs {lp_err}"])
    # The whole sampling step, every knob, against sampler.sample.
    step_mismatch: list = []
    params = ll.SamplingParams.create(
        batch_size=batch,
        temperature=rng.choice([0.0, 0.5, 1.0, 1.5], batch),
        top_k=rng.choice([0, 1, 10, 300], batch),
        top_p=rng.choice([1.0, 0.5, 0.95], batch),
        min_p=rng.choice([0.0, 0.02], batch),
        repetition_penalty=rng.choice([1.0, 1.3], batch),
        presence_penalty=rng.choice([0.0, 0.7], batch),
        frequency_penalty=rng.choice([0.0, -0.4], batch),
        logit_bias=[{int(rng.integers(vocab)): 5.0, 900: -3.0} for _ in range(batch)],
        banned_token_ids=[[int(t) for t in rng.integers(0, vocab, 3)] for _ in range(batch)],
        allowed_token_ids=[None] * (batch - 2) + [[3, 500, 1000], [7]],
        stop_token_ids=[1, 513],
        min_tokens=rng.choice([0, 5], batch),
        max_tokens=8,
        seed=rng.integers(0, 2**32, batch),
        logprobs=rng.choice([0, 4, 20], batch),
    )
    hist = ll.History.create(
        [list(rng.integers(0, vocab, int(n))) for n in rng.integers(1, 9, batch)],
        vocab_size=vocab,
        capacity=8,
    )
    for _ in range(3):
        hist = hist.append(jnp.asarray(rng.integers(0, vocab, batch), jnp.int32))
    want_fn = jax.jit(sampler.sample)
    for mname, (mesh, b) in meshes.items():
        got_fn = jax.jit(
            lambda lg, p, pos, h, m=mesh, b=b: sharding.sample_sharded(
                lg, p, pos, h, mesh=m, batch_axis=b
            )
        )
        for trial in range(2):
            x = np.array(_random_logits(rng, batch, vocab))
            x[3, 10] = np.nan  # a bad row
            x = jnp.asarray(x)
            pos = jnp.asarray(rng.integers(0, 8, batch), jnp.int32)
            want = want_fn(x, params, pos, hist)
            got = got_fn(x, params, pos, hist)
            compared += batch
            for field in ("tokens", "status"):
                if not np.array_equal(
                    np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
                ):
                    step_mismatch.append([mname, trial, field])
            for field in ("logprobs", "raw_logprobs"):
                a, b2 = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
                if not np.allclose(a, b2, atol=1e-4, equal_nan=True):
                    step_mismatch.append([mname, trial, field])
            if not np.array_equal(
                np.asarray(got.top_logprobs.ids), np.asarray(want.top_logprobs.ids)
            ):
                step_mismatch.append([mname, trial, "top_ids"])
    # What crosses the mesh in the compiled sampling step, on a vocabulary large enough
    # that each shard holds more than the candidates it contributes.
    big_vocab = 32768
    big = dict(
        batch_size=batch,
        temperature=rng.choice([0.0, 0.5, 1.0], batch),
        top_k=rng.choice([0, 10, 300], batch),
        top_p=rng.choice([1.0, 0.5, 0.95], batch),
        min_p=rng.choice([0.0, 0.02], batch),
        repetition_penalty=1.2,
        logprobs=5,
    )
    big_hist = ll.History.create([[1, 2, 3]] * batch, vocab_size=big_vocab, capacity=8)
    collectives = {}
    for mname, (mesh, b) in meshes.items():
        fn = jax.jit(
            lambda lg, p, pos, h, m=mesh, b=b: sharding.sample_sharded(
                lg, p, pos, h, mesh=m, batch_axis=b
            )
        )
        hlo = (
            fn.lower(
                jnp.zeros((batch, big_vocab), jnp.float32),
                ll.SamplingParams.create(**big),
                jnp.zeros(batch, jnp.int32),
                big_hist,
            )
            .compile()
            .as_text()
        )
        collectives[mname] = collective_results(hlo)
    # top_k_sharded is lax.top_k
    x = _random_logits(rng, batch, vocab)
    v, i = sharded.top_k_sharded(x, 70, mesh=meshes["1x8"][0])
    wv, wi = jax.lax.top_k(x, 70)
    topk_ok = bool(np.array_equal(np.asarray(i), np.asarray(wi))) and bool(
        np.array_equal(np.asarray(v), np.asarray(wv))
    )
    emit(
        {
            "mismatches": mismatches,
            "step_mismatches": step_mismatch,
            "compared": compared,
            "top_k_ok": topk_ok,
            "collectives": collectives,
            "hlo_vocab": big_vocab,
            "kept_rows_checked": checked_rows,
            "seconds": time.time() - t0,
        }
    )


def worker_multiprocess(process_id: int, port: int) -> None:
    """One of two processes (2 CPU devices each) joined by jax.distributed."""
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    model = tiny_model()
    params = mixed_params()
    # Rows over the processes ("data" spans them), weights over each process's 2 devices.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
    result = {
        "process": process_id,
        "sharded": summarize(ll.generate(model, PROMPTS, params, mesh=mesh)),
        "streamed": [[] for _ in PROMPTS],
    }
    for ev in ll.stream(model, PROMPTS, params, mesh=mesh, chunk_steps=5):
        result["streamed"][ev.row] += ev.token_ids
    if process_id == 0:  # the single-device reference, on this process's first device
        result["single"] = summarize(ll.generate(model, PROMPTS, params))
    emit(result)
    jax.distributed.shutdown()


def worker_structured() -> None:
    """Constrained rows (json_schema, regex, choice) on (1, 2) and (2, 1) meshes and alone."""
    from tests.decoding.noise_model import noise_model
    from tests.decoding.test_constraints import PROMPTS, _mixed

    model, params = noise_model(), _mixed(10)
    out = {"single": summarize(ll.generate(model, PROMPTS, params))}
    out["text"] = ll.generate(model, PROMPTS, params).text
    for shape in ((1, 2), (2, 1)):
        mesh = make_mesh(shape)
        out["x".join(map(str, shape))] = summarize(ll.generate(model, PROMPTS, params, mesh=mesh))
    out["stream_1x2"] = [[] for _ in PROMPTS]
    for ev in ll.stream(model, PROMPTS, params, mesh=make_mesh((1, 2)), chunk_steps=4):
        out["stream_1x2"][ev.row] += ev.token_ids
    emit(out)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    if name == "structured":
        worker_structured()
    elif name == "meshes":
        worker_meshes(args)
    elif name == "paged_mesh":
        worker_paged_mesh()
    elif name == "sampler":
        worker_sampler()
    elif name == "multiprocess":
        worker_multiprocess(int(args[0]), int(args[1]))
    else:
        raise SystemExit(f"unknown worker {name!r}")
