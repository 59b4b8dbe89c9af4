"""Models: the registry, GGUF loading, hand-written forward passes, the reference loader."""

from labkit.models.registry import DEFAULT_MODEL, REGISTRY, ModelFetchError, fetch, get_spec


def load_model(name: str = DEFAULT_MODEL, **kwargs):
    from labkit.models.loader import load_model as _load

    return _load(name, **kwargs)


__all__ = ["DEFAULT_MODEL", "REGISTRY", "ModelFetchError", "fetch", "get_spec", "load_model"]
