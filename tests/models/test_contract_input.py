"""Bad input to the attention contract's calls (`logitloop.models.kv`) is refused by name,
the same way wherever it is given: a window is None or a positive int in `ll.KVSpec` and
in `ll.attention` alike (with `kv=None` a window of 0 or -1 once attended to every column,
future ones included), a softcap None or a positive finite float (0 gave NaN), a layer an
int (True was layer 1), an LM head's table `[V, E]`. Eager calls on tiny arrays: nothing
compiles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import logitloop as ll

Q = jnp.ones((1, 3, 2, 4), jnp.float32)  # [B, T, H, D]
K = jnp.ones((1, 3, 1, 4), jnp.float32)  # [B, T, Hkv, D]


@pytest.mark.parametrize("window", [0, -1, -100, 2.5, "16", True, jnp.int32(8)])
def test_a_window_is_none_or_a_positive_int_everywhere(window):
    words = r"window must be None \(global attention\) or a positive int"
    with pytest.raises(ValueError, match=rf"KVSpec\.{words}"):
        ll.KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, window=window)
    with pytest.raises(ValueError, match=rf"ll\.attention\(layer=0\): {words}"):
        ll.attention(Q, K, K, None, layer=0, window=window)
    with pytest.raises(ValueError, match=r"KVSpec\.window\[1\] must be None"):
        ll.KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, window=(None, window))


def test_numpy_ints_are_windows_and_a_window_keeps_attention_causal():
    spec = ll.KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, window=np.int64(2))
    assert spec.windows == (2, 2)
    assert ll.KVSpec(2, 1, 4, window=np.array([3, 5])).windows == (3, 5)
    v = jnp.arange(3, dtype=jnp.float32)[None, :, None, None] * jnp.ones((1, 3, 1, 4))
    out, _ = ll.attention(Q, K, v, None, layer=0, window=np.int64(1))
    np.testing.assert_array_equal(out[0, :, 0, 0], [0.0, 1.0, 2.0])  # each column itself


@pytest.mark.parametrize("softcap", [0, 0.0, -1.0, float("nan"), float("inf"), "30", True])
def test_a_softcap_is_none_or_a_positive_finite_float(softcap):
    with pytest.raises(ValueError, match=r"softcap must be None or a positive finite float"):
        ll.attention(Q, K, K, None, layer=0, softcap=softcap)
    kv = ll.KV(
        ll.KVSpec(1, 1, 4).init_cache(1, 8), jnp.zeros((1, 3), jnp.int32), ll.KVSpec(1, 1, 4)
    )
    with pytest.raises(ValueError, match=r"softcap must be None or a positive finite float"):
        ll.attention(Q, K, K, kv, layer=0, softcap=softcap)


def test_a_layer_is_an_int_and_a_scale_finite():
    with pytest.raises(TypeError, match=r"layer must be a Python int .* got bool"):
        ll.attention(Q, K, K, None, layer=True)
    with pytest.raises(ValueError, match=r"layer must be >= 0"):
        ll.attention(Q, K, K, None, layer=-1)
    with pytest.raises(ValueError, match=r"scale must be None or a finite float, got nan"):
        ll.attention(Q, K, K, None, layer=0, scale=float("nan"))
    out, _ = ll.attention(Q, K, K, None, layer=np.int64(0), softcap=np.float32(5), scale=0.5)
    assert out.shape == Q.shape


def test_an_lm_head_table_is_vocabulary_by_embedding():
    x = jnp.ones((2, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"table must be \[V, E\] .* E = 4\), got shape \(4, 10\)"):
        ll.lm_head(x, jnp.ones((4, 10), jnp.float32))
    assert ll.lm_head(x, jnp.ones((10, 4), jnp.float32)).shape == (2, 10)


def test_from_linen_errors_name_the_module_not_an_apply_fn():
    """The user wrote a Linen module, not an `apply_fn` nor a `FunctionModel`: errors name
    what they wrote (traced only: nothing compiles)."""
    linen = pytest.importorskip("flax.linen")
    from tests.models import user_model

    class Decoder(linen.Module):
        @linen.compact
        def __call__(self, tokens, positions, kv):
            params = self.param("w", lambda _: user_model.init_params(0))
            return user_model.apply("shape")(params, tokens, positions, kv)  # a logit short

    variables = {"params": {"w": user_model.init_params(0)}}
    model = ll.from_linen(Decoder(), variables, user_model.SPEC, vocab_size=96, max_length=16)
    (finding,) = ll.check_model(model).findings
    assert finding.cause.startswith("the Linen module Decoder.__call__ returned logits of shape")
    with pytest.raises(ValueError, match=r"^from_linen: vocab_size must be a positive int"):
        ll.from_linen(Decoder(), variables, user_model.SPEC, vocab_size=0, max_length=16)
    with pytest.raises(TypeError, match=r"^from_linen: kv_spec must be an ll.KVSpec, got NoneType"):
        ll.from_linen(Decoder(), variables, None, vocab_size=96, max_length=16)
    with pytest.raises(TypeError, match=r"^from_linen takes a flax.linen Module, got dict"):
        ll.from_linen({}, variables, user_model.SPEC, vocab_size=96, max_length=16)


def test_eos_token_ids_take_numpy_ints_and_refuse_other_things():
    from tests.models import user_model

    def model(eos):
        return ll.FunctionModel(
            user_model.apply_fn, user_model.init_params(), kv_spec=user_model.SPEC,
            vocab_size=user_model.V, max_length=16, eos_token_ids=eos,
        )  # fmt: skip

    from logitloop.decoding.loop.runner import model_info

    assert model_info(model(np.int64(2))).eos_token_ids == (2,)  # was "not iterable"
    assert model_info(model([np.int32(1), 3])).eos_token_ids == (1, 3)
    with pytest.raises(ValueError, match=r"eos_token_ids must be a token id or a list"):
        model_info(model("2"))
