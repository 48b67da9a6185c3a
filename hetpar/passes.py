"""Passes: the pipeline from a train step to a running one is a line of named
functions, `pass(input, options) -> output` (trace, layers, stage assignment,
sharding, placement, compile, run). Each is wrapped here so its time is logged under
its name, as Alpa times its passes; nothing else is shared between them."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, TypeVar

log = logging.getLogger("hetpar.passes")
F = TypeVar("F", bound=Callable[..., Any])


def timed_pass(name: str) -> Callable[[F], F]:
    """Logs (at INFO, logger `hetpar.passes`) how long each call of the pass took."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                log.info("pass %s: %.3f s", name, time.perf_counter() - start)

        run.pass_name = name  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return wrap
