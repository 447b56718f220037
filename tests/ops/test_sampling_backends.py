"""Every backend of the sampling operator against the sort-based reference.

One suite (`BackendSuite`), one subclass per backend: the XLA path on scaled logits, the XLA
path on unscaled logits with `temperature`, the Pallas kernel in interpret mode, and the
vocabulary-sharded path (a one-device mesh here; `tests/sharding` runs it on 8 devices).
Each test draws fresh logits (exact ties, -inf entries, large magnitudes) and per-row
settings, and requires the reference's tokens, the same kept set under each filter on
sampled rows, and its log-probabilities.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from logitloop.ops.sampling import dispatch, reference, xla

from .test_sampling_kernel import KINDS, SETTINGS, _inputs

_reference = jax.jit(reference.filter_and_sample_reference)

# The settings that reach every path (mixed rows, the interval searches, ties and masked
# tails) stand for the grid where a backend is slow to run or only a variant of another.
FEW_SETTINGS = ("mixed", "combined", "top_k_large", "top_p_wide")
FEW_KINDS = ("ties", "masked")


class BackendSuite:
    SHAPES = ((2, 3001), (5, 3001), (8, 1000))

    def run(self, x, top_k, top_p, min_p, greedy, key):
        raise NotImplementedError

    def check(self, case: str, kind: str, setting: str, shape=None):
        batch, vocab = shape or self.SHAPES[zlib.crc32(case.encode()) % len(self.SHAPES)]
        args = _inputs(case, batch, vocab, kind, setting)
        want, want_thr = jax.tree.map(np.asarray, _reference(*args))
        got, thr = jax.tree.map(np.asarray, self.run(*args))
        x, greedy = np.asarray(args[0]), np.asarray(args[4])
        sampled = ~greedy
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(thr.row_max, want_thr.row_max)
        for name in ("top_k", "top_p", "min_p"):
            kept = x >= getattr(thr, name)[:, None]
            want_kept = x >= getattr(want_thr, name)[:, None]
            np.testing.assert_array_equal(kept[sampled], want_kept[sampled], err_msg=name)
        np.testing.assert_array_equal(got.logprobs[greedy], 0.0)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-4)

    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("setting", SETTINGS)
    def test_matches_the_sort_reference(self, setting, kind):
        self.check(f"backends-{setting}-{kind}", kind, setting)

    def test_a_small_vocabulary(self):
        self.check("backends-tiny", "ties", "mixed", shape=(4, 37))


class TestXla(BackendSuite):
    def run(self, *args):
        return _xla(*args)


class TestXlaUnscaledWithTemperature(BackendSuite):
    """Unscaled logits with `temperature`: the operator scales only what it reads."""

    @pytest.mark.parametrize("kind", FEW_KINDS)
    @pytest.mark.parametrize("setting", FEW_SETTINGS)
    def test_matches_the_sort_reference(self, setting, kind):
        super().test_matches_the_sort_reference(setting, kind)

    def run(self, x, top_k, top_p, min_p, greedy, key):
        t = jnp.asarray(np.random.default_rng(x.shape[0]).uniform(0.3, 2.0, x.shape[0]))
        t = jnp.where(greedy, 0.0, t).astype(jnp.float32)
        # Scaled by 1 / t inside (greedy rows: t = 0, unscaled): compare with the reference
        # on exactly that.
        z = jnp.where(greedy[:, None], x, x * t[:, None])
        self.scaled = xla.scale_logits(z, t)
        return _xla_t(z, top_k, top_p, min_p, greedy, key, t)

    def check(self, case, kind, setting, shape=None):
        batch, vocab = shape or self.SHAPES[zlib.crc32(case.encode()) % len(self.SHAPES)]
        args = _inputs(case, batch, vocab, kind, setting)
        got, _ = jax.tree.map(np.asarray, self.run(*args))
        want, _ = jax.tree.map(np.asarray, _reference(self.scaled, *args[1:]))
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-4)


# The interpreted kernel and the one-device mesh run with `-m slow`: in the default suite
# `TestSamplingKernelInterpret` and `tests/sharding` hold them to the XLA path, which this
# suite holds to the reference.
@pytest.mark.slow
class TestPallasInterpret(BackendSuite):
    SHAPES = ((2, 3001), (8, 1000))

    def run(self, *args):
        return dispatch.filter_and_sample(*args, backend="pallas", interpret=True)

    @pytest.mark.parametrize("kind", FEW_KINDS)
    @pytest.mark.parametrize("setting", FEW_SETTINGS)
    def test_matches_the_sort_reference(self, setting, kind):
        super().test_matches_the_sort_reference(setting, kind)


@pytest.mark.slow
class TestShardedOneDevice(BackendSuite):
    @pytest.mark.parametrize("kind", FEW_KINDS)
    @pytest.mark.parametrize("setting", FEW_SETTINGS)
    def test_matches_the_sort_reference(self, setting, kind):
        super().test_matches_the_sort_reference(setting, kind)

    def run(self, *args):
        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        return _sharded(mesh)(*args)


_xla = jax.jit(xla.filter_and_sample)
_xla_t = jax.jit(
    lambda z, k, p, m, g, key, t: xla.filter_and_sample(z, k, p, m, g, key, temperature=t)
)


def _sharded(mesh, _cache={}):  # noqa: B006 - one compiled function per mesh
    if mesh not in _cache:
        _cache[mesh] = jax.jit(
            lambda *a: dispatch.filter_and_sample(*a, backend="sharded", mesh=mesh)
        )
    return _cache[mesh]


def test_sharded_backend_needs_a_mesh():
    args = _inputs("no-mesh", 2, 64, "normal", "mixed")
    with pytest.raises(ValueError, match="mesh"):
        dispatch.filter_and_sample(*args, backend="sharded")
