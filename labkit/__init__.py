"""labkit: the inference engine behind *Inference From First Principles*."""

__version__ = "0.1.0"


def load_model(name: str = "smollm2-135m", **kwargs):
    """Load a registry model with our hand-written forward pass (see labkit.models)."""
    from labkit.models import load_model as _load

    return _load(name, **kwargs)


__all__ = ["load_model", "__version__"]
