"""Reference flax models, each with a `setup()` that returns a `Workload`."""

from typing import Any

from models import gpt, mlp
from models.workload import Workload

_REGISTRY = {"mlp": mlp.setup, "gpt": gpt.setup}


def names() -> list[str]:
    return sorted(_REGISTRY)


def factory(name: str):  # noqa: ANN201
    """The setup function of a reference model (it takes `batch_size=`)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(names())}")
    return _REGISTRY[name]


def get(name: str, **kwargs: Any) -> Workload:
    return factory(name)(**kwargs)


__all__ = ["Workload", "factory", "get", "gpt", "mlp", "names"]
