"""The least runs of consecutive layers and the searches over them, on many rows at
once: one array pass over every layout of a kind (or of a group) instead of a numpy
call per layout. The bounds price each layout at a dozen microbatch sizes and meet it
in hundreds of groups, so the calls' own cost, not their arithmetic, was what a bound
paid. Pure functions of arrays; `runs.py`'s one-row forms are these on one row, and
each row's figures are the same whatever the other rows (a minimum or a count: no
sum is reordered)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def nondecreasing_rows(rows: np.ndarray) -> np.ndarray:
    """Each row of `rows` (layouts x run lengths) made nondecreasing from above: entry
    n - 1 is the least run of n or more layers."""
    return np.minimum.accumulate(rows[:, ::-1], axis=1)[:, ::-1]


def counts_within(rows: np.ndarray, limits: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """[row, t]: how many entries of the row are at most `limits[t]`, which is
    `np.searchsorted(row, limits, side="right")`; every row nondecreasing, `limits`
    ascending, no NaN anywhere. One search of every entry into the limits gives, per
    row, where its count steps up (the first limit each entry is within). On a short
    grid the steps are counted per position and summed along it; on a long one (the
    product tables' thousands of times) the counts are laid out run by run instead
    (a row's k-th run, k entries within, as long as the gap between its k-th and
    k+1-th steps), one pass however long the grid. With `scale` (one factor per row),
    each row's counts times its factor, as floats: on a long grid the scaled counts
    are what is laid out, not a second array of the grid's size multiplied after (the
    same products: small whole numbers times whole-valued factors are exact)."""
    size, (count, n) = len(limits), rows.shape
    at = np.searchsorted(limits, rows, side="left")
    if size <= _SHORT:
        flat = (at + (size + 1) * np.arange(count)[:, None]).ravel()
        counts = np.cumsum(np.bincount(flat, minlength=count * (size + 1)).reshape(count, size + 1)[:, :size], axis=1)
        return counts if scale is None else scale[:, None] * counts
    edges = np.empty((count, n + 2), dtype=np.intp)
    edges[:, 0], edges[:, -1], edges[:, 1:-1] = 0, size, at
    values = np.tile(np.arange(n + 1), count) if scale is None else (scale[:, None] * np.arange(n + 1)).ravel()
    return np.repeat(values, np.diff(edges, axis=1).ravel()).reshape(count, size)


_SHORT = 512  # grid positions up to which counting per position is the cheaper (a group's grid; a product's is longer)


def sorted_unique(values: np.ndarray, kind: str = "quicksort") -> np.ndarray:
    """`np.unique` of a 1-D float array, sorted in place (`values` is the caller's
    scratch) and without `np.unique`'s own layers of calls, which cost a group of
    layouts more than its sort: the same sort and the same first of each run of equal
    entries, so the same array bit for bit (NaN, which `np.unique` merges, goes to it).
    `kind` "stable" where `values` are sorted runs laid end to end (it merges them)."""
    values.sort(kind=kind)
    if not values.size or np.isnan(values[-1]):
        return np.unique(values)
    keep = np.empty(len(values), dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def most_within(runs: np.ndarray, limits: np.ndarray, tol: float) -> np.ndarray:
    """[row, t]: the most layers n whose least run `runs[row, n - 1]` stays within
    `limits[t]` (ascending) times `tol`."""
    return counts_within(nondecreasing_rows(runs), limits * tol)


def least_for_counts(counts: np.ndarray, least: np.ndarray, layers: int) -> np.ndarray:
    """Per count r of layers (1..layers), the least over rows of row[ceil(r / s) - 1],
    `s` = the row's `counts` (stages): the least time at which some layout's stages
    have room for r layers, when `least[row, q - 1]` is the least at which one of its
    stages has room for q."""
    s = counts.astype(int)[:, None]
    r = np.arange(1, layers + 1)[None, :]
    return np.take_along_axis(least, (r + s - 1) // s - 1, axis=1).min(axis=0)


def layers_fitting(capacity: np.ndarray, state: np.ndarray, saved: np.ndarray, inputs: np.ndarray, recomputed: np.ndarray,
                   shard: np.ndarray, held: np.ndarray, plain: bool, remat: bool) -> np.ndarray:
    """[stage, h, 2]: per stage (a row of `state`, the bytes each layer's state takes
    on one of its devices; `capacity` its bytes per device; `shard` its examples per
    device over its model axis) and count `held[h]` of microbatches in flight, the
    most layers it holds keeping every activation (where `plain`, else 0) and
    recomputing (where `remat`, else 0): capacity over the least bytes any one layer
    needs (`state + saved * held`; recomputing, its input per microbatch held beside
    `state + recomputed`), `saved`, `inputs` and `recomputed` scaled by the shard as
    `StageCosts.per_layer` scales them (`fitting.LayoutFits.one`; numpy's floor
    division is Python's, so each count is the scalar one's)."""
    shard, held, capacity = shard[:, None], np.asarray(held)[None, :], np.asarray(capacity, dtype=float)[:, None]
    layers = state.shape[1]

    def most(room: np.ndarray, per_layer: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(room, 0.0) // np.maximum(per_layer, 1.0), layers).astype(int)

    kept = (state[:, None, :] + (saved * shard)[:, None, :] * held[:, :, None]).min(axis=2)
    least_input, rerun = (inputs * shard).min(axis=1)[:, None], (state + recomputed * shard).min(axis=1)[:, None]
    out = np.zeros((len(state), held.shape[1], 2), dtype=int)
    if plain:
        out[..., 0] = most(capacity, kept)
    if remat:
        out[..., 1] = most(capacity - least_input * held, rerun)
    return out


def spans(values: np.ndarray) -> np.ndarray:
    """`ranges.span(ranges.cumsum(row))` of each row: [row, i, j] the sum of entries i..j-1."""
    prefix = np.concatenate([np.zeros((len(values), 1)), np.cumsum(values, axis=1)], axis=1)
    return prefix[:, None, :] - prefix[:, :, None]


def run_spans(forward: np.ndarray, backward: np.ndarray, fused: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    """Per stage (a row of `forward` and `backward`, each layer's seconds), per range
    of layers: its forward and backward summed, or as one program where that is less
    (`fused`: the row's one-program seconds, None where it has none), and its forward,
    backward and the forward rerun, as `LowerBounds._stage_runs` sums them."""
    f, bw = spans(forward), spans(backward)
    both = f + bw
    has = [i for i, row in enumerate(fused) if row is not None]
    if has:
        both[has] = np.minimum(both[has], spans(np.array([fused[i] for i in has])))
    return both, f + (bw + f)


def least_runs_rows(values: np.ndarray) -> np.ndarray:
    """[row, n - 1]: the least sum of any n consecutive entries, of each span matrix of
    `values` (rows x (n + 1) x (n + 1)): the least of its n-th diagonal above the main
    one, all diagonals at once: read in place (a strided view: entry [n - 1, i] is
    [i, i + n], one row and one column further per i), not gathered into a copy; the
    view's entries past a diagonal's end (i + n > n: the next rows' entries, still
    inside the contiguous block) are masked out."""
    values = np.ascontiguousarray(values)
    rows, n = values.shape[0], values.shape[1] - 1
    along, down, across = values.strides
    diagonals = np.lib.stride_tricks.as_strided(values[:, 0, 1:], shape=(rows, n, n), strides=(along, across, down + across),
                                                writeable=False)
    within = np.arange(n)[None, :] + np.arange(1, n + 1)[:, None] <= n
    return np.where(within, diagonals, np.inf).min(axis=2)


def least_steps(runs: np.ndarray) -> list[float]:
    """Per row of `runs`: the most d >= 0 with runs[n - 1] >= runs[0] + (n - 1) d for every n."""
    if runs.shape[1] < 2:
        return [0.0] * len(runs)
    return [float(max(d, 0.0)) for d in ((runs[:, 1:] - runs[:, :1]) / np.arange(1, runs.shape[1])).min(axis=1)]


class EndRuns(NamedTuple):
    """A stage's least runs where its place in the pipeline fixes which layers it can
    hold, whatever the split: the first stage's runs start at the model's first layer,
    the last's end at its last, and a middle stage's lie between the two."""

    one: float  # the least forward + backward of one layer (inf: no such stage)
    one_remat: float  # the same, the backward rerunning the forward
    step: float  # the least increment per layer beyond the first (`least_steps`)
    step_remat: float
    # The most a such that every run of q layers here costs at least a + (q - 1) times the
    # stage's least increment anywhere (`StageRuns.step`, `step_remat`): at least `StageRuns.time[0]`,
    # a figure to sum beside those increments where the place is not known (`bottleneck.least_steps`).
    base: float
    base_remat: float


class StageRuns(NamedTuple):
    """One stage's least times over runs of consecutive layers, per microbatch
    (`LowerBounds._stage_runs`)."""

    time: np.ndarray  # [n - 1]: the least forward + backward of any n consecutive layers
    remat: np.ndarray  # the same, the backward rerunning the forward
    step: float  # the least increment per layer beyond the first, without recomputation
    step_remat: float
    last: np.ndarray  # [n - 1]: the last n layers' forward + backward (a pipeline's last stage holds them)
    last_remat: np.ndarray
    floor: np.ndarray  # `time` made nondecreasing (`nondecreasing_rows`): what the searches for rooms read
    floor_remat: np.ndarray
    last_floor: np.ndarray  # `last` made nondecreasing
    last_floor_remat: np.ndarray
    first: EndRuns  # as the pipeline's first stage (its runs start at layer 0)
    inner: EndRuns  # as a stage between the first and the last (its runs within layers 1..n - 2)
    final: EndRuns  # as the last stage (`last`'s runs; its increments are `last`'s least steps)


def stage_runs(forward: np.ndarray, backward: np.ndarray, fused: list[np.ndarray | None]) -> list[StageRuns]:
    """`StageRuns` of each stage (a row of `forward`, `backward`, `fused`: `run_spans`'),
    every field priced for all the stages at once."""
    both, rerun = run_spans(forward, backward, fused)
    count, n = len(both), both.shape[1] - 1
    plain, remat = np.split(least_runs_rows(np.concatenate([both, rerun])), 2)
    ends = np.arange(n - 1, -1, -1)  # where the last stage starts, holding 1, 2, ... layers
    last, last_remat = both[:, ends, n], rerun[:, ends, n]
    # the kinds of runs as rows of one array: each row's figures are its own (a least or a running least)
    steps = least_steps(np.concatenate([plain, remat]))
    floors = nondecreasing_rows(np.concatenate([plain, remat, last, last_remat]))
    step, floor = [steps[i * count : (i + 1) * count] for i in range(2)], [floors[i * count : (i + 1) * count] for i in range(4)]
    anywhere = (np.array(step[0]), np.array(step[1]))
    fields = (plain, remat, step[0], step[1], last, last_remat, floor[0], floor[1], floor[2], floor[3],
              _end_runs(both[:, 0, 1:], rerun[:, 0, 1:], n, anywhere), _end_runs(_inner(both), _inner(rerun), n - 2, anywhere),
              _end_runs(last, last_remat, n, anywhere))
    return [StageRuns(*row) for row in zip(*fields)]


def _inner(values: np.ndarray) -> np.ndarray:
    """[row, q - 1]: the least run of q layers within layers 1..n - 2 (a middle stage's),
    of each span matrix, q up to n - 2 (none for a model of fewer than 3 layers)."""
    n = values.shape[1] - 1
    return least_runs_rows(values[:, 1:n, 1:n]) if n >= 3 else np.zeros((len(values), 0))


def _end_runs(plain: np.ndarray, remat: np.ndarray, finite: int, anywhere: tuple[np.ndarray, np.ndarray]) -> list[EndRuns]:
    """`EndRuns` of each row of `plain` and `remat` ([row, q - 1]: its runs of q layers,
    the first `finite` of them possible; `anywhere`: each row's least increments over
    runs anywhere, plain and recomputing)."""
    count = len(plain)
    if finite < 1:
        return [EndRuns(np.inf, np.inf, 0.0, 0.0, np.inf, np.inf)] * count
    plain, remat = plain[:, :finite], remat[:, :finite]
    steps = least_steps(np.concatenate([plain, remat]))
    q = np.arange(finite)
    base = (plain - anywhere[0][:, None] * q).min(axis=1)
    base_remat = (remat - anywhere[1][:, None] * q).min(axis=1)
    return [EndRuns(float(plain[i, 0]), float(remat[i, 0]), steps[i], steps[count + i], float(base[i]), float(base_remat[i]))
            for i in range(count)]
