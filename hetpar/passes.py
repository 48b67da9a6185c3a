"""Passes: the pipeline from a train step to a running one is a line of named
functions, `pass(input, options) -> output` (trace, layers, stage assignment,
sharding, placement, compile, run). Each is wrapped here so its time is logged under
its name, as Alpa times its passes, and announced as it starts (`announcing`: what a
command line shows as its progress); nothing else is shared between them."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Callable, Iterator, TypeVar

log = logging.getLogger("hetpar.passes")
F = TypeVar("F", bound=Callable[..., Any])
_listeners: list[Callable[[str], None]] = []


@contextlib.contextmanager
def announcing(listener: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, `listener` gets a short line as each pass, or a long part
    of one (a stage's sharding solve), starts: planning a large model takes tens of
    seconds, and a spinner with one line for all of it says nothing of where it is."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


def announce(what: str) -> None:
    """Tells the listeners (`announcing`) that `what` starts."""
    for listener in list(_listeners):
        listener(what)


def timed_pass(name: str) -> Callable[[F], F]:
    """Logs (at INFO, logger `hetpar.passes`) how long each call of the pass took, and
    announces each call as it starts."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            announce(f"the {name} pass")
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                log.info("pass %s: %.3f s", name, time.perf_counter() - start)

        run.pass_name = name  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return wrap
