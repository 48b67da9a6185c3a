"""Stage programs compiled once, for the argument types the plan gives them.

`jax.jit` compiles again whenever an argument's abstract type changes, and the type
it keys on includes more than shape and dtype: whether a value is weakly typed (a
Python `0` for a step counter becomes a weak int32; the returned counter is not) and
the mesh an array was produced on (an array a stage program returned carries its
mesh's axes, the same values placed with `device_put` do not). So the second call of a
parallelized step, fed the state the first call returned, compiled its programs a
second time, and so did a state restored from a checkpoint.

A stage program's arguments are fixed by the plan (shape, dtype and the sharding its
stage wants), so each is lowered and compiled once, for those types, and the
executable is called directly: an array of the same shape and dtype, laid out as the
program wants, runs it whatever its weak type or the mesh object it came from.
`compile_programs` compiles every program a step will dispatch before the first
microbatch runs, several at once on threads (XLA compiles without holding the GIL),
with one log line per program, so a long first step is not silent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable, Iterable

log = logging.getLogger("hetpar.compile")


class CompiledOnce:
    """A jitted function compiled for `arg_types` on its first call (or by
    `compile()`), then called as that executable. `lower` and `eval_shape` reach the
    jitted function (what processes compare, what a process that does not run the
    program needs)."""

    def __init__(self, jitted: Any, arg_types: tuple, name: str = "program"):
        self.jitted, self.arg_types, self.name = jitted, arg_types, name
        self._executable: Callable | None = None
        self._lock = threading.Lock()

    @property
    def is_compiled(self) -> bool:
        return self._executable is not None

    def compile(self) -> Callable:
        with self._lock:
            if self._executable is None:
                self._executable = self.jitted.lower(*self.arg_types).compile()
            return self._executable

    def __call__(self, *args: Any) -> Any:
        executable = self._executable or self.compile()
        return executable(*args)

    def lower(self, *args: Any) -> Any:
        return self.jitted.lower(*args)

    def eval_shape(self, *args: Any) -> Any:
        return self.jitted.eval_shape(*args)


def compile_programs(programs: Iterable[CompiledOnce], workers: int | None = None) -> int:
    """Compiles each of `programs` not compiled yet, logging a line per program as it
    finishes (logger `hetpar.compile`, INFO); returns how many it compiled.
    `workers` threads compile at once (default: the CPU count, at most 8)."""
    todo = list(dict.fromkeys(p for p in programs if not p.is_compiled))
    if not todo:
        return 0
    workers = workers or min(8, os.cpu_count() or 1)
    start = time.perf_counter()
    done = 0
    count_lock = threading.Lock()

    def one(program: CompiledOnce) -> None:
        nonlocal done
        t = time.perf_counter()
        program.compile()
        with count_lock:
            done += 1
            log.info("hetpar: compiled %d/%d: %s (%.2fs)", done, len(todo), program.name, time.perf_counter() - t)

    log.info("hetpar: compiling %d stage programs", len(todo))
    if workers == 1 or len(todo) == 1:
        for p in todo:
            one(p)
    else:
        pool = ThreadPoolExecutor(max_workers=min(workers, len(todo)), thread_name_prefix="hetpar-compile")
        try:
            for future in as_completed([pool.submit(one, p) for p in todo]):
                future.result()  # re-raises the first compile error
        except BaseException:
            # A compile error or Ctrl-C: raised now, not after the compiles still
            # running (XLA cannot be stopped; their threads finish on their own).
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    log.info("hetpar: compiled %d stage programs in %.2fs", len(todo), time.perf_counter() - start)
    return len(todo)
