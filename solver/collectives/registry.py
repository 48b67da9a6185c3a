"""The one list of collective algorithms, and the prices every part of hetpar and
the solver reads from it: `best` (the fastest algorithm for one size), `costs`
(every algorithm's time) and `fastest_times` (the fastest for many sizes at once, as
the planner prices thousands of layer ranges). An algorithm registered here is
priced everywhere: the planner's stage tables and ZeRO, the sharding ILP, the
predictor and hand-made plans."""

from __future__ import annotations

import math
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Iterator

import numpy as np

from solver.collectives.base import COLLECTIVES, Algorithm, Line, Topology

_ALGORITHMS: dict[str, Algorithm] = {}


class CurvedError(ValueError):
    """A collective some algorithm prices along a curve, not a straight line in the size."""


def register(algorithm: Algorithm) -> Algorithm:
    """Adds an algorithm under its name (once: a second algorithm of one name is a bug)."""
    if algorithm.name in _ALGORITHMS or algorithm.name == "none":
        raise ValueError(f"a collective algorithm needs a unique name; {algorithm.name!r} is taken")
    _ALGORITHMS[algorithm.name] = algorithm
    _forget()
    return algorithm


def unregister(name: str) -> Algorithm:
    """Removes the algorithm called `name` (what `registered` does on the way out)."""
    algorithm = get(name)
    del _ALGORITHMS[name]
    _forget()
    return algorithm


@contextmanager
def registered(algorithm: Algorithm) -> Iterator[Algorithm]:
    """The algorithm priced everywhere inside the block, and gone after it."""
    register(algorithm)
    try:
        yield algorithm
    finally:
        unregister(algorithm.name)


def names() -> tuple[str, ...]:
    """Every registered algorithm's name, in registration order."""
    return tuple(_ALGORITHMS)


def get(name: str) -> Algorithm:
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown collective algorithm {name!r}; known: {', '.join(_ALGORITHMS)}") from None


def _implementing(kind: str) -> list[Algorithm]:
    return list(_implementing_cached(kind))


@lru_cache(maxsize=None)
def _implementing_cached(kind: str) -> tuple[Algorithm, ...]:
    """Remembered (`_forget` clears it): every array of sizes the planner prices asks again."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
    found = [a for a in _ALGORITHMS.values() if kind in a.times]
    if not found:
        raise ValueError(f"no registered algorithm implements {kind!r}")
    return tuple(found)


def costs(kind: str, topo: Topology, nbytes: float) -> dict[str, float]:
    """Time of every algorithm that can run collective `kind` of `nbytes` on `topo`."""
    out = {a.name: a.time(kind, topo, nbytes) for a in _implementing(kind)}
    return {name: t for name, t in out.items() if t < math.inf}


def best(kind: str, topo: Topology, nbytes: float) -> tuple[str, float]:
    """(algorithm, seconds) of the fastest algorithm for this size and topology.
    Remembered: the sharding pass asks the same few sizes millions of times."""
    if topo.size <= 1 or nbytes <= 0:
        return "none", 0.0
    return _best(kind, topo, float(nbytes))


@lru_cache(maxsize=1 << 16)
def _best(kind: str, topo: Topology, nbytes: float) -> tuple[str, float]:
    options = costs(kind, topo, nbytes)
    name = min(options, key=options.get)
    return name, options[name]


@lru_cache(maxsize=None)
def affine_costs(kind: str, topo: Topology) -> tuple[Line, ...]:
    """Every algorithm's time for collective `kind` as (latency term, seconds per
    byte), so a search can price thousands of message sizes with one numpy expression:
    the fastest is the least of these lines. An algorithm gives its own lines (the
    hierarchical one: one per combination of its levels' picks) or, affine in the
    size, the line through two sizes. A CurvedError where some algorithm's time for
    `kind` is curved (`fastest_times` then prices size by size)."""
    if topo.size <= 1:
        return ()
    unit = 2.0**30
    out: list[Line] = []
    for a in _implementing(kind):
        if kind in a.curved:
            raise CurvedError(f"{a.name}'s {kind} is not a straight line in the size; price it with `best`")
        if a.lines is not None:
            out += a.lines(kind, topo)
        else:
            zero = a.time(kind, topo, 0.0)
            if zero < math.inf:
                out.append((zero, (a.time(kind, topo, unit) - zero) / unit))
    return tuple(out)


@lru_cache(maxsize=None)
def _least_lines(kind: str, topo: Topology) -> tuple[Line, ...]:
    """`affine_costs`' lines less each that another is nowhere below at a positive size
    (its latency and its time per byte no less; of equal lines, all but the first):
    at such a size a + s x rounds no lower for the greater a and s, so the least of
    the rest is the least of all, bit for bit. The hierarchical algorithms' products
    of picks give tens of lines of which a few stay."""
    lines = affine_costs(kind, topo)
    return tuple(line for i, line in enumerate(lines)
                 if not any(o[0] <= line[0] and o[1] <= line[1] and (o != line or j < i) for j, o in enumerate(lines)))


def fastest_times(kind: str, topo: Topology, nbytes: Any) -> Any:
    """`best`'s time for every size in `nbytes` (a number or a numpy array) at once:
    the least of `affine_costs`' lines (those some size can make least,
    `_least_lines`), 0 for nothing to move."""
    nbytes = np.asarray(nbytes, dtype=float)
    _implementing(kind)  # an unknown collective is named, not priced size by size
    try:
        lines = _least_lines(kind, topo)
    except CurvedError:
        return np.vectorize(lambda m: best(kind, topo, m)[1], otypes=[float])(nbytes)
    if not lines:
        return np.zeros_like(nbytes)
    times = lines[0][0] + lines[0][1] * nbytes
    for a, slope in lines[1:]:  # pairwise, not np.min over a list (which copies every line into one array first)
        times = np.minimum(times, a + slope * nbytes)
    return np.where(nbytes > 0, times, 0.0)


def _forget() -> None:
    """Prices remembered under the old list are stale once it changes."""
    _best.cache_clear()
    affine_costs.cache_clear()
    _least_lines.cache_clear()
    _implementing_cached.cache_clear()
