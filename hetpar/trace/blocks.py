"""Repeated blocks, found by structure at whatever depth they sit.

A transformer is an embedding, a stack of identical blocks and a head; a pipeline
wants a cut between every two blocks so that a faster kind of device can take any
number of them. Where the blocks sit in the module tree differs by library: a
hand-written flax model puts them at `Model/Block_3`, transformers' Llama at
`Module/model/layers/3`, GPT-2 at `Module/transformer/h/3`, an unrolled `nn.scan`
at `Model/ScanBlock_0[3]`. So blocks are found by what makes them blocks, not by
how deep they are: a run of sibling modules (one parent, different names) whose
forward operators are the same operators on the same shapes, parameters included.

nnx names no module scopes, so for a step without them the blocks are found in the
operator sequence itself: the longest stretch that repeats with a fixed period,
anchored on the operators that read parameters, each block starting where the
fewest bytes cross (the residual stream).

The result is a list of pieces (contiguous forward positions): what comes before
the first block (the embedding), each block, what follows the last (the head).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

_MIN_COVERAGE = 0.25  # a run of blocks carries at least this share of the forward work
_MAX_PERIODS = 8  # candidate periods tried when no scopes name the blocks


@dataclass(frozen=True)
class Structure:
    """Pieces of the forward pass: `starts[i]` is the forward position where piece
    i begins (`starts[0] == 0`); `labels[i]` names it for people; `blocks` counts the
    pieces that are repeated blocks; `depth` is the module depth of the deepest run
    found by scope (0 when found by period: no scopes to match a backward by)."""

    starts: tuple[int, ...]
    labels: tuple[str, ...]
    blocks: int
    depth: int

    @property
    def pieces(self) -> int:
        return len(self.starts)


def op_signature(name: str, in_avals: list, out_avals: list) -> tuple:
    """What two operators of two identical blocks share: the primitive and the
    shapes and dtypes it reads (parameters included) and writes."""
    def spec(aval):
        return tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", ""))
    return name, tuple(spec(a) for a in in_avals), tuple(spec(a) for a in out_avals)


def find_blocks(paths: list[tuple[str, ...]], signatures: list[tuple], flops: list[float], crossing: np.ndarray,
                param_readers: list[bool]) -> Structure | None:
    """The step's forward pass cut into embedding, blocks and head (`Structure`), or
    None when nothing repeats. `paths`, `signatures`, `flops` and `param_readers`
    (whether the operator reads a parameter) are per forward position; `crossing[c]`
    is the bytes a cut at c sends."""
    total = float(sum(flops))
    ids = _intern(signatures)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    chosen = _choose(_scoped_runs(paths, ids), prefix, total, len(ids)) \
        or _choose(_periodic_runs(ids, crossing, param_readers), prefix, total, len(ids))
    if not chosen:
        return None
    chosen.sort(key=lambda r: r[0][1])
    depth = max(len(r[0][0]) for r in chosen)
    starts: list[int] = []
    labels: list[str] = []
    kinds: list[bool] = []  # piece is a block

    def gap(lo: int, hi: int) -> None:
        if hi > lo:
            starts.append(lo)
            # With no scopes (blocks found by period) a piece is named by its neighbours.
            near = f"after {labels[-1]}" if labels else f"before block {len(kinds)}"
            labels.append(_describe(paths[lo:hi], depth) if depth else near)
            kinds.append(False)

    position = 0
    for run in chosen:
        gap(position, run[0][1])
        for key, lo, _ in run:
            starts.append(lo)
            labels.append(_name(key) if key else f"block {sum(kinds)}")
            kinds.append(True)
        position = run[-1][2]
    gap(position, len(ids))
    return Structure(tuple(starts), tuple(labels), sum(kinds), depth)


def _choose(runs: list, prefix: np.ndarray, total: float, n: int) -> list:
    """The runs that carry the most work, none overlapping another (the blocks, not
    the three identical projections inside each), each at least `_MIN_COVERAGE` of it."""
    chosen = []
    taken = np.zeros(n, dtype=bool)
    for run in sorted(runs, key=lambda r: -(prefix[r[-1][2]] - prefix[r[0][1]])):
        lo, hi = run[0][1], run[-1][2]
        if (total > 0 and prefix[hi] - prefix[lo] < _MIN_COVERAGE * total) or taken[lo:hi].any():
            continue
        taken[lo:hi] = True
        chosen.append(run)
    return chosen


def _intern(signatures: list[tuple]) -> list[int]:
    table: dict[tuple, int] = {}
    return [table.setdefault(s, len(table)) for s in signatures]


def _scoped_runs(paths: list[tuple[str, ...]], ids: list[int]
                 ) -> list[list[tuple[tuple[str, ...], int, int]]]:
    """Runs of sibling module scopes with identical operators, at every depth: each
    a list of (scope, first position, position after its last operator). Operators of
    an enclosing module between two blocks (a layer collection's own work) are glue:
    the block before them takes them."""
    runs = []
    max_depth = max((len(p) for p in paths), default=0)
    for depth in range(1, max_depth + 1):
        segments: list[tuple[tuple[str, ...], int, int]] = []
        for i, p in enumerate(paths):
            key = p[:depth]
            if segments and segments[-1][0] == key:
                segments[-1] = (key, segments[-1][1], i + 1)
            else:
                segments.append((key, i, i + 1))
        current: list[tuple[tuple[str, ...], int, int]] = []
        body: tuple[int, ...] | None = None

        def close() -> None:
            if len(current) >= 2:
                runs.append(list(current))

        for key, lo, hi in segments:
            if len(key) == depth:
                sig = tuple(ids[lo:hi])
                if current and key[:-1] == current[0][0][:-1] and sig == body \
                        and all(key != k for k, _, _ in current):
                    current.append((key, lo, hi))
                    continue
                close()
                current, body = [(key, lo, hi)], sig
            elif current and key == current[0][0][: len(key)]:
                continue  # glue inside the run's parent
            else:
                close()
                current, body = [], None
        close()
    return runs


def _periodic_runs(ids: list[int], crossing: np.ndarray, param_readers: list[bool]
                   ) -> list[list[tuple[tuple[str, ...], int, int]]]:
    """Runs of blocks in an operator sequence with no scopes to go by: for each
    candidate period (the distance between two operators that read parameters of the
    same shapes), the longest stretch where every operator equals the one a period
    later, cut into blocks where the fewest bytes cross."""
    seq = np.asarray(ids)
    n = len(seq)
    readers: dict[int, list[int]] = {}
    for i, (s, reads) in enumerate(zip(ids, param_readers)):
        if reads:
            readers.setdefault(s, []).append(i)
    periods = Counter(b - a for pos in readers.values() for a, b in zip(pos, pos[1:]))
    runs = []
    for period, _ in periods.most_common(_MAX_PERIODS):
        if period <= 0 or 2 * period > n:
            continue
        same = np.concatenate([seq[:-period] == seq[period:], [False]])
        i = 0
        while i < n - period:
            if not same[i]:
                i += 1
                continue
            j = i
            while same[j]:
                j += 1
            lo, hi = i, j + period  # [lo, hi) repeats with this period
            i = j
            if hi - lo < 2 * period:
                continue
            phase = lo + int(np.argmin(crossing[lo:lo + period])) if lo + period <= len(crossing) else lo
            phase = phase if phase > 0 or lo == 0 else lo
            count = (hi - phase) // period
            if count >= 2:
                runs.append([((), phase + k * period, phase + (k + 1) * period) for k in range(count)])
    return runs


def _name(key: tuple[str, ...]) -> str:
    return "/".join(key[1:] if len(key) > 1 else key)


def _describe(paths: list[tuple[str, ...]], depth: int) -> str:
    """A piece outside the blocks by the modules it spans; the step's own operators
    (outside any module: the loss, the labels' shift) only when it has nothing else."""
    names: list[str] = []
    for p in paths:
        name = _name(p[:depth])
        if name and (not names or names[-1] != name):
            names.append(name)
    if not names:
        return "loss"
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
