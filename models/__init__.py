"""Reference flax models, each with a `setup()` that returns a `Workload`."""

from typing import Any

from models import gpt, mlp
from models.workload import Workload

_REGISTRY = {"mlp": mlp.setup, "gpt": gpt.setup}


def get(name: str, **kwargs: Any) -> Workload:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)


__all__ = ["Workload", "get", "gpt", "mlp"]
