"""Find a train step and its example arguments from a name on the command line:
a reference model (`gpt`, `mlp`) or `module.path:function` (or `file.py:function`).

The function returns either an object with `.step`, `.state` and `.batch` (what the
`models/` helpers return) or a pair `(step, args)`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hetpar.errors import HetparError


@dataclass(frozen=True)
class StepAndArgs:
    name: str
    step: Callable
    args: tuple

    def abstract(self) -> "StepAndArgs":
        """The same step with its arguments' shapes and dtypes alone: what tracing and
        a profile (which runs on zeros) need. Holding a large model's values beside the
        profile's own arrays is a whole state more of device memory (15 GB for a
        1.26B Llama with AdamW)."""
        import jax

        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, self.args)
        return StepAndArgs(self.name, self.step, shapes)


def load_workload(spec: str, batch_size: int | None = None) -> StepAndArgs:
    factory = _factory(spec)
    kwargs = {}
    if batch_size is not None:
        if "batch_size" not in inspect.signature(factory).parameters:
            raise HetparError(f"{spec} takes no batch_size argument, so the batch size cannot be chosen for it")
        kwargs["batch_size"] = batch_size
    result = factory(**kwargs)
    if all(hasattr(result, a) for a in ("step", "state", "batch")):
        return StepAndArgs(spec, result.step, (result.state, result.batch))
    if isinstance(result, tuple) and len(result) == 2 and callable(result[0]):
        return StepAndArgs(spec, result[0], tuple(result[1]))
    raise HetparError(
        f"{spec} returned {type(result).__name__}; it must return (step, args) or an object with .step, .state and .batch"
    )


def _factory(spec: str) -> Callable[..., Any]:
    if ":" not in spec:
        import models

        if spec not in models.names():
            raise HetparError(f"unknown model {spec!r}: name a reference model ({', '.join(models.names())}) or MODULE:FUNCTION")
        return models.factory(spec)
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise HetparError(f"{spec!r} names no function: write MODULE:FUNCTION or path/to/file.py:FUNCTION")
    module = _import(module_name)
    if not hasattr(module, attr):
        raise HetparError(f"{module_name} has no function {attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise HetparError(f"{spec} is a {type(factory).__name__}, not a function returning (step, args) or a workload")
    return factory


def _import(name: str) -> Any:
    """A module by name, or a file as `python file.py` would run it: its folder first
    on the import path, so it can import the modules beside it."""
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise HetparError(f"no such file: {name}")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        module_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise HetparError(f"cannot import {name}: {e}") from None
