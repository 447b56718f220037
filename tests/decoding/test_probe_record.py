"""The fixed-order probes (`fixed_order.measure`) and their record on disk
(`logitloop.models.probe_record`): a process's first deterministic `generate` compiles a
handful of programs; the record lives beside the compiled programs, per machine key, and is
neither read nor written without a compile cache. Damaged records in fresh processes:
tests/decoding/test_compile_cache.py."""

from __future__ import annotations

import contextlib
import json
import warnings

import jax
import pytest

import logitloop as ll
from logitloop.models import fixed_order

from .random_llama import small_llama


@contextlib.contextmanager
def _jax_cache(folder: str | None):
    """JAX's persistent cache in `folder` (None: none) while active, whatever an earlier
    test left (an in-process `cli.main` turns it off), restored afterwards."""
    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache")
    before = [getattr(jax.config, name) for name in names]
    jax.config.update(names[0], folder)
    jax.config.update(names[1], True)
    try:
        yield
    finally:
        for name, value in zip(names, before, strict=True):
            jax.config.update(name, value)


@pytest.fixture
def no_probes_yet(monkeypatch):
    """This process as if it had measured no product shape and calibrated no policy (the
    probes' memo emptied, their record on disk off), restored afterwards."""
    monkeypatch.setenv("LOGITLOOP_COMPILE_CACHE", "off")
    monkeypatch.setattr(fixed_order, "_measured", {})
    fixed_order._calibrated.cache_clear()
    yield
    fixed_order._calibrated.cache_clear()


def test_the_first_deterministic_generate_compiles_a_handful_of_programs(
    no_probes_yet, compile_counter
):
    """A process's first deterministic `generate` (a model of new shapes, no probe known,
    none on disk) compiles its prefill, its decode loop and two probe programs: the
    policy's probes of both kinds of product in one, then the model's own decode products
    (`fixed_order.product_shapes`) in one more, so that tracing the decode pass finds every
    shape measured. (The probes compiled a program per shape and row count, plus eager
    helpers: 234 programs for this model.)"""
    model = small_llama(333, 96, 3)
    with compile_counter as c:
        ll.generate(model, [[5, 6, 7], [9]], max_tokens=4, ignore_eos=True, deterministic=True)
    assert c.count <= 4, f"{c.count} programs (prefill, decode and two probes expected)"
    # ... and the model's products were measured, and may run their decode rows unpadded.
    assert (("float32", False, 32, 64) in fixed_order._measured) and (
        ("float32", True, 32, 333) in fixed_order._measured
    )


def test_probe_results_are_kept_on_disk_per_machine(
    no_probes_yet, monkeypatch, tmp_path, compile_counter
):
    """`fixed_order.measure` records what it measured in the folder of the compile cache
    in use, and a process that finds a shape there compiles nothing for it;
    an entry recorded under another machine key (another CPU, jax release, flag set) is not
    used; a corrupt file is ignored with a warning and replaced; a folder other users can
    write to is not used. (Damaged files in fresh processes: tests/decoding/
    test_compile_cache.py.)"""
    from logitloop.models import probe_record

    monkeypatch.setenv("LOGITLOOP_COMPILE_CACHE", str(tmp_path))
    cache = ll.enable_compile_cache()
    try:
        _probe_record_in(tmp_path, monkeypatch, compile_counter)
    finally:
        cache.disable()
    shared = tmp_path / "shared"  # a folder other users can write to: neither read nor written
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with _jax_cache(str(shared)):  # JAX's own cache, set there
        with pytest.warns(UserWarning, match="other users can write"):
            assert probe_record.folder() is None


def _probe_record_in(tmp_path, monkeypatch, compile_counter):
    from logitloop.models import probe_record

    entry = ("float32", False, 32, 48)
    with compile_counter as c, warnings.catch_warnings():
        warnings.simplefilter("error")  # the probe's program holds the dots it asks for
        first = fixed_order.measure([entry])
    assert c.count == 1
    path = tmp_path / probe_record.FILE_NAME
    data = json.loads(path.read_text())
    assert list(data["machines"].values()) == [{"float32/dot/32x48": first[entry]}]

    monkeypatch.setattr(fixed_order, "_measured", {})
    with compile_counter as c:
        assert fixed_order.measure([entry]) == first
    assert c.count == 0

    (key,) = data["machines"]
    data["machines"] = {key.replace('"jaxlib"', '"jaxlib-other"'): {"float32/dot/32x48": True}}
    path.write_text(json.dumps(data))
    monkeypatch.setattr(fixed_order, "_measured", {})
    with compile_counter as c:
        fixed_order.measure([entry])
    assert c.count == 1

    path.write_text("{not json")
    probe_record._warned.clear()
    monkeypatch.setattr(fixed_order, "_measured", {})
    with compile_counter as c, pytest.warns(UserWarning, match="probe record .* ignored"):
        assert fixed_order.measure([entry]) == first
    assert c.count == 1
    assert json.loads(path.read_text())["format"] == probe_record.FORMAT


def test_no_probe_record_is_read_or_kept_without_a_compile_cache(
    no_probes_yet, monkeypatch, tmp_path
):
    """The record follows the compile cache: with none on, a probes.json in the default
    folder is not read (a file that is not UTF-8 once crashed every deterministic run, the
    cache on or off) and none is written."""
    from logitloop.models import probe_record

    monkeypatch.setenv("LOGITLOOP_COMPILE_CACHE", str(tmp_path))  # the default folder
    path = tmp_path / probe_record.FILE_NAME
    path.write_bytes(b'{"format": "\xff"}')
    with _jax_cache(None), warnings.catch_warnings():  # not the tests' own (conftest.py)
        warnings.simplefilter("error")
        fixed_order.measure([("float32", False, 16, 24)])
    assert path.read_bytes() == b'{"format": "\xff"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == [probe_record.FILE_NAME]
