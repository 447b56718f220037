"""A Ray actor (`logitloop.integrations.ray.Generator`) keeps JAX's persistent compilation
cache by default, in the folder `LOGITLOOP_COMPILE_CACHE` names, and none when it is "off"
or `compile_cache=False`. The actor is built in this process (Ray is not needed) from a
missing checkpoint: the cache is chosen before the model is loaded, so nothing compiles."""

from __future__ import annotations

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from logitloop.compile_cache import _SETTINGS, COMPILE_CACHE_ENV
from logitloop.integrations.ray import Generator


@pytest.fixture
def fresh_jax_cache_settings():
    """JAX's cache settings as a fresh process has them, restored afterwards (another test
    in this process may have enabled a cache)."""
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", True)
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def _start_actor(tmp_path, **kwargs) -> None:
    with pytest.raises(ValueError, match="cannot load the model"):
        Generator(str(tmp_path / "no-such-checkpoint"), **kwargs)


def test_an_actor_keeps_the_compile_cache_by_default(
    fresh_jax_cache_settings, tmp_path, monkeypatch
):
    folder = tmp_path / "cache"
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(folder))
    _start_actor(tmp_path)
    assert jax.config.jax_compilation_cache_dir == str(folder)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # small programs too


@pytest.mark.parametrize("how", ["environment off", "compile_cache=False"])
def test_an_actor_told_off_keeps_none(fresh_jax_cache_settings, tmp_path, monkeypatch, how):
    if how == "environment off":
        monkeypatch.setenv(COMPILE_CACHE_ENV, "off")
        _start_actor(tmp_path)
    else:
        monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "cache"))
        _start_actor(tmp_path, compile_cache=False)
    assert jax.config.jax_compilation_cache_dir is None
    assert not (tmp_path / "cache").exists()


def test_an_actor_leaves_a_jax_cache_the_user_configured(
    fresh_jax_cache_settings, tmp_path, monkeypatch
):
    """JAX_COMPILATION_CACHE_DIR in the actor's environment: the user's, left as it is."""
    mine = str(tmp_path / "users")
    jax.config.update("jax_compilation_cache_dir", mine)
    monkeypatch.setenv(COMPILE_CACHE_ENV, str(tmp_path / "cache"))
    _start_actor(tmp_path)
    assert jax.config.jax_compilation_cache_dir == mine
    assert not (tmp_path / "cache").exists()


def test_an_actor_given_the_job_bounds_compiles_at_start_and_never_after(
    fresh_jax_cache_settings, compile_counter, monkeypatch
):
    """`bounds=`: the actor precompiles its job's programs (`ll.precompile(slots=...)`);
    batches of any prompts and settings inside the bounds compile nothing."""
    from logitloop.decoding.runtime import compiles

    monkeypatch.setenv(COMPILE_CACHE_ENV, "off")
    monkeypatch.setattr(compiles, "_prepared", set())
    with compile_counter as c:
        actor = Generator(slots=2, bounds={"max_prompt_len": 12, "max_tokens_bound": 6})
    assert c.count > 0
    batch = {
        "id": [0, 1, 2],
        "prompt": ["The for", "A dict", "The with statement"],
        "max_tokens": [3, 6, 5],
        "seed": [1, 2, 3],
    }
    with compile_counter as c:
        records = actor.records(batch)
    assert c.count == 0
    assert all(r["num_tokens"] <= m for r, m in zip(records, [3, 6, 5], strict=True))
