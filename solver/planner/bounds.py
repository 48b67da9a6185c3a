"""Lower bounds on the step time of a stage layout, before any split is tried.

The planner scores layouts in the order of these bounds and stops when the next
bound cannot beat the plans it has, so the tighter they are, the fewer exact splits
it computes. Each is valid for every split and every order it covers (1F1B's step:
summed stage times and sends, plus m - 1 times the slowest, or the first stage's
round trip shared by the microbatches it keeps in flight where slower, plus the
slowest tail; the round trip is priced only under 1F1B, `Schedule.round_trip_limited`):

- the slowest stage: no stage holds more consecutive layers than fit its memory
  beside the activations in flight, or whose least time (over every run of that
  many consecutive layers) exceeds the bottleneck;
- the summed stage times: each stage holds at least one layer, at no less than the
  least time of one layer, and every further layer costs at least the least
  increment per layer over runs of consecutive layers;
- the tail: some stage holds a run of layers whose gradient sync and optimizer,
  plus any per-microbatch ZeRO collectives the tail saves, cost at least as much as
  the least such run that lets all the stages hold every layer; and the first stage
  holds the first layer, the last the last (`_ends_tails`);
- the sends: each cut between two stages sends at least the least activation
  across that pair (per order; a set pays its orders' least, a product its
  layouts' own stages' cuts);
- the places: every stage but the first and the last holds a run between the
  model's first and last layers (on a language model neither the embedding nor the
  head), so the bottleneck is at least each middle stage's least such layer, and its
  one-layer time is at least that, not the embedding's; where the order is not known
  (a product of layouts, a set), at most two stages are ends, so the bottleneck is at
  least the third slowest stage's (`bottleneck._unplaced`, `bottleneck.third_slowest`).
  Without it, on Llama-2-7B over 768 GPUs of three kinds, sets of dozens of V100
  stages each "holding" the embedding at its cost were bounded at 1.4 s against 48 s
  for their best split, and the search took 48.5 s; with it 5.6 s, to the same plan.
  Where the order is known, the last stage's rooms are also its last runs', and those
  runs' times are among its candidate bottlenecks (`bottleneck.least_steps`' `last`):
  without them a split whose last stage sets the pace was counted at the middle runs
  below it (64 GPUs of three kinds: such orders were bounded 10-14% below their best
  split). (A set's bound could ask that one of its stages be last; on Llama-2-13B over
  768 GPUs its added candidates cost the sets' bounds more than the check pruned, the
  search 30-50% longer.)
"""

from __future__ import annotations

import itertools
from typing import Iterable, NamedTuple

import numpy as np

from solver import schedules as registry
from solver.planner.problem import Problem
from solver.cost.stage_costs import INF, StageConfig, StageCosts, in_flight
from solver.planner.layouts import KindLayout, kind_layouts
from solver.planner.bottleneck import LayoutRows, least_steps, middle_one, order_rows, row_sends, third_slowest, with_layouts
from solver.planner.fitting import LayoutFits
from solver.planner.row_passes import Rows, by_stages, merged
from solver.planner.rows import StageRuns, counts_within, least_for_counts, least_runs_rows, most_within, sorted_unique, stage_runs
from solver.planner.runs import FITS_TOL, balanced_pace, first_enough, least_runs, longest

_BELOW = 1 - 1e-9  # a floor kept below what it bounds despite rounding (and `FITS_TOL`)


class _KindArrays(NamedTuple):
    """Per layout of one kind (a row each), what `product_table` sums over a product."""

    counts: np.ndarray  # stages
    rooms: np.ndarray  # [layout, t]: layers all its stages have room for within the t-th candidate time
    held: np.ndarray  # [layout, u]: layers its stages hold within the u-th candidate tail
    firsts: np.ndarray  # its stages' least time, one layer each
    rates: np.ndarray  # the least increment per further layer
    extra: np.ndarray  # further layers its stages have memory for (beyond one each)
    inner: np.ndarray  # its stages' least one-layer time as a middle stage (`bottleneck.third_slowest`)
    sends: np.ndarray  # the least sends both ways between its own stages


class LowerBounds:
    def __init__(self, problem: Problem, costs: StageCosts):
        self.problem = problem
        self.costs = costs
        self.fits = LayoutFits(problem, costs)
        self._runs: dict[tuple, StageRuns] = {}
        self._layout_runs: dict[tuple[KindLayout, int], StageRuns] = {}
        self._tail_held: dict[KindLayout, np.ndarray] = {}
        self._tails: dict[StageConfig, np.ndarray] = {}
        self._layout_tables: dict[int, LayoutRows] = {}  # per microbatch size, every layout a bound has met
        self._bases: dict[tuple[tuple[KindLayout, ...], int], tuple[np.ndarray, ...]] = {}
        self._held: dict[tuple[str, int, int], tuple[int, ...]] = {}
        self._kinds: dict[tuple[tuple[KindLayout, ...], int, tuple[str, ...]], _KindArrays] = {}
        self._grids: dict[tuple[int, tuple[str, ...]], np.ndarray] = {}
        self._kind_layouts: dict[str, list[KindLayout]] = {}
        self._tail_values: np.ndarray | None = None
        self._held_tails: dict[StageConfig, np.ndarray] = {}
        self._end_tails: dict[StageConfig, tuple[float, float]] = {}  # `_ends_tails`' parts
        self._orders: dict[int, np.ndarray] = {}  # `_permutations`'
        self._envelopes: dict[tuple[tuple[KindLayout, ...], int], tuple] = {}  # `_envelope`'s
        self._held_most: dict[tuple[tuple[KindLayout, ...], int], float] = {}  # `_most_held`'s
        self._least_tails: dict[tuple[KindLayout, ...], float] = {}
        self._paces: dict[tuple[StageConfig, int], tuple[float, float, float]] = {}
        self._layout_paces: dict[tuple[KindLayout, int], tuple[float, float, float]] = {}
        self._interleaved: dict[tuple[tuple[KindLayout, ...], int, int], tuple[float, float]] = {}

    def bound(self, layouts: tuple[KindLayout, ...], m: int, b: int, schedule: str) -> float:
        """No split of any order of these stages is faster than this under `schedule`
        (inf: none fits): the bounds of `order_bound` at the best case of every
        position (one microbatch in flight), with the least sends of any order."""
        return float(self.set_bounds([layouts], m, b, schedule)[0])

    def set_bounds(self, sets: list[tuple[KindLayout, ...]], m: int, b: int, schedule: str) -> np.ndarray:
        """`bound` of each set, the same figures (each row's candidates are its own:
        `bottleneck.least_steps`), in one array pass per stage count among them (the
        search tightens a stream's next sets together). Each set pays the least sends
        of any of its orders (`_least_sends`; without them, 187 sets on 64 GPUs of three
        kinds were bounded below the fifth best plan, not 113)."""
        out = np.full(len(sets), INF)
        if registry.get(schedule).interleaved:
            for i, layouts in enumerate(sets):
                fits = sum(lay.stages * max(self.fits.one(lay, b, 1)) for lay in layouts) >= self.costs.n
                out[i] = self._work_floor(layouts, m * b) if fits else INF
            return out
        table = self._layout_rows([lay for layouts in sets for lay in layouts], b)
        groups = []
        for count, chosen in by_stages(sets).items():
            rows = [sets[i] for i in chosen]
            at = np.array([np.repeat([table.index[lay] for lay in row], [lay.stages for lay in row]) for row in rows])
            tails = np.maximum([self._least_tail(tuple(sorted(row))) for row in rows], self._ends_tails(table, at, False))
            sends = self._least_sends(table, rows, count)
            groups.append(Rows(np.array(chosen), table.fits[at, 0], at, tails + sends, sends))
        trips = registry.get(schedule).round_trip_limited
        for rows in merged(groups):
            out[rows.positions] = self._bounds(rows.fitting, m, b, rows.offsets, INF, False, table, rows.at,
                                               rows.sends if trips else None, placed=False, counts=rows.counts)
        return out

    def _least_sends(self, table: LayoutRows, sets: list[tuple[KindLayout, ...]], count: int) -> np.ndarray:
        """Per set (`count` stages each), the least sends both ways of any of its orders,
        each order's as its own bound sums them (`bottleneck.row_sends`)."""
        out = np.empty(len(sets))
        by_size: dict[int, list[int]] = {}
        for i, layouts in enumerate(sets):
            by_size.setdefault(len(layouts), []).append(i)
        for size, chosen in by_size.items():
            rows = order_rows([sets[i] for i in chosen], self._permutations(size), count, table)
            out[chosen] = row_sends(rows, table).reshape(len(chosen), -1).min(axis=1)
        return out * _BELOW  # (kept below each order's own, however they round)

    def _permutations(self, count: int) -> np.ndarray:
        """Every order of `count` positions (a row each)."""
        if count not in self._orders:
            self._orders[count] = np.array(list(itertools.permutations(range(count))))
        return self._orders[count]

    def product_bounds(self, per_kind: list[list[KindLayout]], m: int, b: int, schedule: str) -> list[tuple[float, tuple[KindLayout, ...]]]:
        """`product_table`'s bounds with their layouts, for every combination that can fit."""
        lower, index = self.product_table(per_kind, m, b, schedule)
        return [(float(lower[j]), tuple(lays[i] for lays, i in zip(per_kind, index[:, j]))) for j in range(len(lower))]

    def product_table(self, per_kind: list[list[KindLayout]], m: int, b: int, schedule: str) -> tuple[np.ndarray, np.ndarray]:
        """A first bound, looser than `bound`, for every combination of one layout per
        kind at once (numpy over the product; the search has tens of thousands): the
        least bottleneck at which the stages have room for every layer, times m - 1,
        plus the summed stage times' floor where memory alone limits each stage, plus
        the tail's bound, plus the sends between each layout's own stages. Returns the
        finite bounds and, per kind (a row), the index of each combination's layout in
        that kind's list: combinations with more stages than layers, or where the
        layers cannot fit, are left out. What each layout contributes is computed once
        per microbatch size (`_kind_arrays`), so a call is a few array operations over
        the product whatever the number of layouts."""
        layers = self.costs.n
        if not per_kind or not all(per_kind):
            return np.zeros(0), np.zeros((len(per_kind), 0), dtype=int)
        kinds = tuple(sorted({lay.kind for lays in per_kind for lay in lays}))
        arrays = [self._kind_arrays(tuple(lays), b, kinds) for lays in per_kind]
        index = np.indices([len(lays) for lays in per_kind]).reshape(len(per_kind), -1)
        stages = sum(a.counts[i] for a, i in zip(arrays, index))
        index, stages = index[:, stages <= layers], stages[stages <= layers]
        if not index.shape[1]:
            return np.zeros(0), index
        grid = self._time_grid(b, kinds)
        at = first_enough([a.rooms for a in arrays], index, len(grid), layers)
        least = np.maximum(grid[np.minimum(at, len(grid) - 1)], third_slowest([a.inner[i] for a, i in zip(arrays, index)],
                                                                              [a.counts[i] for a, i in zip(arrays, index)]))
        # (a third slowest of inf: three stages or more that hold no middle layer, so one of them cannot be in the middle)
        bottleneck = np.where((at < len(grid)) & np.isfinite(least), (m - 1) * np.where(np.isfinite(least), least, 0.0), INF)
        # The summed stage times with memory alone limiting each stage.
        rates = np.stack([a.rates[i] for a, i in zip(arrays, index)], axis=1)
        extra = np.stack([a.extra[i] for a, i in zip(arrays, index)], axis=1)
        budget = layers - stages
        order = np.argsort(rates, axis=1, kind="stable")
        extra, rates = np.take_along_axis(extra, order, 1), np.take_along_axis(rates, order, 1)
        before = np.cumsum(extra, axis=1) - extra
        take = np.clip(budget[:, None] - before, 0, extra)
        sums = sum(a.firsts[i] for a, i in zip(arrays, index)) + (take * rates).sum(axis=1)
        sums = np.where((extra.min(axis=1) < 0) | (extra.sum(axis=1) < budget), INF, sums)
        tail = np.zeros(index.shape[1])
        if not registry.get(schedule).interleaved:
            tail_grid = self._tail_grid()
            tail = tail_grid[np.minimum(first_enough([a.held for a in arrays], index, len(tail_grid), layers), len(tail_grid) - 1)]
        lower = bottleneck + sums + tail + sum(a.sends[i] for a, i in zip(arrays, index))
        if registry.get(schedule).interleaved:  # its fit holds (one microbatch in flight), not its value
            rate = sum(self._kind_rate(lays[0].kind) for lays in per_kind)  # one kind per list
            lower = np.where(lower < INF, self._work_s() * m * b / rate, INF)
        keep = np.nonzero(lower < INF)[0]
        return lower[keep], index[:, keep]

    def product_floor(self, per_kind: list[list[KindLayout]], m: int, b: int, schedule: str) -> float:
        """A bound no combination of `product_table` goes below, without pricing the
        product (nor the grid of candidate times of its kinds): the search builds a
        product's table only when this reaches the front of its line, and most never
        do. Each kind is taken at its best layout for each part apart: the least
        bottleneck at which the kinds' roomiest layouts hold every layer; the summed
        stage times, every layer beyond a stage's first at no less than the least
        increment r of any layout (one layer per kind fell a third below the tables on
        64 GPUs of three kinds); the least tail at which they hold every layer. Inf,
        before any runs are priced, where memory alone leaves no combination room
        (`_most_held`)."""
        if not per_kind or not all(per_kind):
            return INF
        if registry.get(schedule).interleaved:  # every finite bound of the product is the work floor
            return self._work_s() * m * b / sum(self._kind_rate(lays[0].kind) for lays in per_kind) * _BELOW
        layers = self.costs.n
        if sum(self._most_held(tuple(lays), b) for lays in per_kind) < layers:
            return INF
        envelopes = [self._envelope(tuple(lays), b) for lays in per_kind]
        needs = [need for need, _, _ in envelopes]
        candidates = np.unique(np.concatenate(needs))
        rooms = sum(np.searchsorted(need, candidates, side="right") for need in needs)
        enough = np.nonzero(rooms >= layers)[0]
        if not enough.size:
            return INF  # no combination has room for every layer at any bottleneck
        # per kind apart: its least first-layer times (and own stages' sends) less r per stage, r the least increment
        step = min(rate for _, (_, _, rate), _ in envelopes)
        sums = layers * step + sum(float((firsts - counts * step).min()) for _, (counts, firsts, _), _ in envelopes)
        tail_grid = self._tail_grid()
        held = np.nonzero(sum(most for _, _, most in envelopes) >= layers)[0]
        tail = float(tail_grid[held[0] if held.size else len(tail_grid) - 1])
        return ((m - 1) * float(candidates[enough[0]]) + sums + tail) * _BELOW

    def _most_held(self, layouts: tuple[KindLayout, ...], b: int) -> float:
        """The most layers any of a kind's layouts holds, memory alone counted."""
        if (layouts, b) not in self._held_most:
            stages = np.array([lay.stages for lay in layouts])
            self._held_most[layouts, b] = float((stages * self.fits.kind(layouts, b).max(axis=1)).max())
        return self._held_most[layouts, b]

    def _envelope(self, layouts: tuple[KindLayout, ...], b: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, float],
                                                                         np.ndarray]:
        """One kind's best case over its layouts, for `product_floor`: per count r of
        layers (1..n), the least time at which some layout's stages have room for r
        layers (nondecreasing); each layout's stages and their least first-layer times
        with the sends between them, and the least increment per further layer of any;
        per candidate tail, the most layers some layout's stages hold."""
        key = (layouts, b)
        if key not in self._envelopes:
            counts, least, held, firsts, rates, *_, sends = self._kind_base(layouts, b)
            need = least_for_counts(counts, least, self.costs.n)
            self._envelopes[key] = need[np.isfinite(need)], (counts, firsts + sends, float(rates.min())), held.max(axis=0)
        return self._envelopes[key]

    def _kind_arrays(self, layouts: tuple[KindLayout, ...], b: int, kinds: tuple[str, ...]) -> _KindArrays:
        """What each of one kind's layouts contributes to `product_table`, on the grid
        of candidate times of `kinds` at microbatch size `b` (one microbatch in flight:
        the best case of every position)."""
        key = (layouts, b, kinds)
        if key not in self._kinds:
            grid = self._time_grid(b, kinds)
            counts, least, held, firsts, rates, extra, inner, sends = self._kind_base(layouts, b)
            rooms = counts_within(least, grid * FITS_TOL, counts)  # `least`'s rows are nondecreasing
            self._kinds[key] = _KindArrays(counts, rooms, held, firsts, rates, extra, inner, sends)
        return self._kinds[key]

    def _kind_base(self, layouts: tuple[KindLayout, ...], b: int) -> tuple[np.ndarray, ...]:
        """`_kind_arrays`' figures that do not depend on the grid of candidate times
        (a kind's layouts meet the grids of every set of kinds it is in): stages, per
        layout the least time at which one stage has room for q layers (plain or
        recomputing), the tails' rooms, the summed stage times' parts, and the least
        sends both ways between its own stages (every order pays them)."""
        key = (layouts, b)
        if key not in self._bases:
            if any(b % lay.dp for lay in layouts):
                raise ValueError(f"a layout's data-parallel degree does not divide the microbatch of {b}: no pipeline runs it")
            tail_grid, layers = self._tail_grid(), self.costs.n
            counts = np.array([lay.stages for lay in layouts], dtype=float)
            runs = self._runs_of(layouts, b)
            fitting = self.fits.kind(layouts, b).astype(float)
            q, fit, fit_remat = np.arange(1, layers + 1), fitting[:, :1], fitting[:, 1:]
            least = np.minimum(np.where(q <= fit, np.array([r.floor for r in runs]), INF),
                               np.where(q <= fit_remat, np.array([r.floor_remat for r in runs]), INF))
            held = [self._layout_tails(lay) for lay in layouts]
            plain = fitting[:, 0] >= 1  # a stage that cannot hold one layer without recomputing recomputes
            heads = np.array([(r.time[0], r.remat[0], r.step, r.step_remat) for r in runs]).reshape(len(layouts), 4)
            self._bases[key] = (
                counts, least, np.array(held).reshape(len(layouts), len(tail_grid)),
                counts * np.where(plain, heads[:, 0], heads[:, 1]),
                np.where(plain, heads[:, 2], heads[:, 3]),
                counts * (fitting.max(axis=1) - 1),
                middle_one(np.array([r.inner.one for r in runs]), np.array([r.inner.one_remat for r in runs]),
                           fitting[:, 0], fitting[:, 1]),
                2 * (counts - 1) * np.diag(self.costs.least_sends([lay.config for lay in layouts], b)) * _BELOW,
            )
        return self._bases[key]

    def _time_grid(self, b: int, kinds: tuple[str, ...]) -> np.ndarray:
        """Every least run time of every layout of `kinds` that runs microbatches of
        `b`: the bottleneck of any combination of them is one of these."""
        if (b, kinds) not in self._grids:  # each kind's once per size, the sets of kinds it is in merging them
            for k in kinds:
                if (b, (k,)) not in self._grids:
                    runs = self._runs_of(tuple(lay for lay in self._layouts_of(k) if b % lay.dp == 0), b)
                    self._grids[b, (k,)] = sorted_unique(np.concatenate([np.zeros(0)] + [r.time for r in runs] + [r.remat for r in runs]))
            self._grids[b, kinds] = sorted_unique(np.concatenate([self._grids[b, (k,)] for k in kinds]))
        return self._grids[b, kinds]

    def _layouts_of(self, kind: str) -> list[KindLayout]:
        """`kind_layouts` of a kind, kept (each kind's grid is made at every microbatch size)."""
        if kind not in self._kind_layouts:
            self._kind_layouts[kind] = kind_layouts(self.problem, kind)
        return self._kind_layouts[kind]

    def _tail_grid(self) -> np.ndarray:
        """Every least tail of every layout: the tail bound of any combination is one of
        them (each layout's tails, and its rooms on them, priced in one array pass)."""
        if self._tail_values is None:
            cfgs = list(dict.fromkeys(lay.config for k in self.problem.kinds for lay in kind_layouts(self.problem, k.name)))
            spans = np.array([self._tail_spans(cfg) for cfg in cfgs])
            tails = least_runs_rows(spans)
            n = self.costs.n  # a first stage's runs start at layer 0, a last's end at n
            self._end_tails.update(zip(cfgs, zip(spans[:, 0, 1:].min(axis=1), spans[:, :n, n].min(axis=1))))
            self._tails.update(zip(cfgs, tails))
            self._tail_values = np.unique(tails)
            self._held_tails.update(zip(cfgs, most_within(tails, self._tail_values, FITS_TOL)))
        return self._tail_values

    def order_bound(self, order: tuple[KindLayout, ...], m: int, b: int, schedule: str, beat: float = INF,
                    last: bool = False) -> float:
        """`order_bounds` of one order."""
        return float(self.order_bounds([order], m, b, schedule, beat, last)[0])

    def order_bounds(self, orders: list[tuple[KindLayout, ...]], m: int, b: int, schedule: str, beat: float = INF,
                     last: bool = False) -> np.ndarray:
        """`sets_order_bounds` of some orders of one set (the first order's)."""
        perms = np.array([[orders[0].index(lay) for lay in order] for order in orders])
        return self.sets_order_bounds([orders[0]], perms, m, b, schedule, beat, last)[0]

    def sets_order_bounds(self, sets: list[tuple[KindLayout, ...]], perms: np.ndarray, m: int, b: int, schedule: str,
                          beat: float = INF, last: bool = False) -> np.ndarray:
        """[set, order]: `bound` for each order of each set (`perms`: the orders, each
        a permutation of a set's positions, the same for every set: a stream's sets
        hold one layout of each of the same kinds), and tighter: each stage holds only
        as many layers as fit beside the activations its position keeps in flight, a
        stage that cannot hold one layer without recomputing pays the recompute, and
        every cut pays its least send both ways; with `last`, each stage is priced by
        the runs its place allows (`bottleneck.LayoutRows.by_place`: the last stage
        holds the model's last layers, the first its first, the others neither).
        Stops at `beat`: a bound that reaches it is as good as exact for pruning. The
        sets of as many stages in one array pass, every order of each (the search
        bounds a stream's next sets' orders together when the first of them reaches the
        front of its line: a pass per set's orders cost 64 GPUs of three kinds a third
        of their search)."""
        out = np.full((len(sets), len(perms)), INF)
        if registry.get(schedule).interleaved:
            for i, layouts in enumerate(sets):
                out[i] = self.bound(layouts, m, b, schedule)
            return out
        table = self._layout_rows([lay for layouts in sets for lay in layouts], b)
        groups = []
        for count, chosen in by_stages(sets).items():
            chosen_sets = [sets[i] for i in chosen]
            fitting, sends, at = self._order_parts(chosen_sets, perms, m, schedule, count, table)
            least = np.repeat([self._least_tail(tuple(sorted(layouts))) for layouts in chosen_sets], len(perms))
            tails = np.maximum(least, self._ends_tails(table, at, True))
            positions = (np.array(chosen)[:, None] * len(perms) + np.arange(len(perms))).reshape(-1)  # in `out`, flat
            groups.append(Rows(positions, fitting, at, sends + tails, sends))
        trips, flat = registry.get(schedule).round_trip_limited, out.reshape(-1)
        for rows in merged(groups):
            flat[rows.positions] = self._bounds(rows.fitting, m, b, rows.offsets, beat, last, table, rows.at,
                                                rows.sends if trips else None, counts=rows.counts)
        return out

    def _order_parts(self, sets: list[tuple[KindLayout, ...]], perms: np.ndarray, m: int, schedule: str, count: int,
                     table: LayoutRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per order of each set (`count` stages each; the rows set by set, each set's
        orders by `perms`): the most layers each stage holds (plain, recomputing) with
        its position's microbatches in flight, its cuts' least sends both ways, and each
        stage's layout in `table`."""
        held = np.array(self._in_flight(schedule, m, count)) - 1
        rows = order_rows(sets, perms, count, table)
        return table.fits[rows, held], row_sends(rows, table), rows

    def _bounds(self, fitting: np.ndarray, m: int, b: int, offsets: np.ndarray, beat: float, last: bool, table: LayoutRows,
                at: np.ndarray, trips: np.ndarray | None = None, placed: bool | None = None,
                counts: np.ndarray | None = None) -> np.ndarray:
        """Per row of layouts (rows of as many stages): the least (m - 1) t + summed
        stage times over candidate bottlenecks t (`bottleneck.least_steps`), plus the
        row's offset (its tail's bound and sends); `fitting` (rows x stages x 2): the most
        layers each stage holds without and with recomputation; `last`: the order is
        known, each stage priced by its place and the last's rooms also its last runs';
        `at`: each row's stages' layouts in `table`; `trips`: per row, its least sends both ways,
        where 1F1B's round trips may pace it; `counts`: each row's own stages, where rows are
        padded at the front (`row_passes.merged`) (both as `bottleneck.least_steps` takes
        them). (Plain schedules only: an interleaved schedule's tail is its device groups'
        chunks' tails summed, and its fill is 1/v, so these bounds do not hold for it.)"""
        layers = self.costs.n
        out = np.full(len(fitting), INF)
        n, nr = fitting[..., 0], fitting[..., 1]
        fits = np.maximum(n, nr).sum(axis=1) >= layers
        if not fits.any():
            return out
        out[fits & (offsets >= beat)] = beat
        live = np.nonzero(fits & (offsets < beat))[0]
        if not live.size:
            return out
        n, nr, offsets = n[live], nr[live], offsets[live]
        trips = None if trips is None else trips[live]
        counts = None if counts is None else counts[live]
        out[live] = least_steps(table, at[live], n, nr, m, layers, offsets, beat, last, trips, placed, counts)
        return out

    def interleaved_floor(self, layouts: tuple[KindLayout, ...], m: int, b: int, chunks: int) -> float:
        """No split of these device groups, each holding `chunks` = v stages (the row
        of groups repeated v times), runs an interleaved step faster than this: its
        pace (the busiest group's stages summed) is at least a group's v least
        one-layer times, and at least n / sum(1 / r_g) where r_g is the group's least
        time per layer over runs of any length (the groups balanced, were layers
        divisible); and at least the last group's other v - 1 stages' least times plus
        its last stage's, which holds the model's last layers (on a language model the
        head, heavier than any other layer: at least the least run that ends the
        model, as `_last_stage` argues). The first microbatch's pass: every stage's
        least time over v (the last stage's: its least run ending the model), and every
        one of its v x groups - 1 cuts' least send both ways (in full: each lies on
        that pass). (`layer_split._Row.pace_floor` on the stage tables, taken here
        before they are built, from the least runs that bound every table entry.)"""
        key = (layouts, b, chunks)
        if key not in self._interleaved:  # what does not depend on m: the search asks each order at every m
            counts = [lay.stages for lay in layouts]
            # the row's cuts: its groups' row repeated v times (from the last group back to the first between)
            table = self._layout_rows(layouts, b)
            groups = order_rows([layouts], np.arange(len(layouts))[None, :], sum(counts), table)
            sends = float(row_sends(np.tile(groups, chunks), table)[0]) * _BELOW
            paces = [self._layout_pace(lay, b) for lay in layouts]
            least = np.array([p[0] for p in paces])
            last = paces[-1][2]
            pace = max(chunks * float(least.max()), balanced_pace(self.costs.n, np.repeat([p[1] for p in paces], counts)),
                       last + (chunks - 1) * float(least[-1]))
            self._interleaved[key] = (float((least * counts).sum()) + (last - float(least[-1])) / chunks + sends, pace)
        first, pace = self._interleaved[key]
        return (first + (m - 1 / chunks) * pace) * _BELOW

    def _layout_pace(self, lay: KindLayout, b: int) -> tuple[float, float, float]:
        """`_least_pace` of a layout's stages, kept per layout (whose key hashes in C)."""
        key = (lay, b)
        if key not in self._layout_paces:
            self._layout_paces[key] = self._least_pace(lay.config, b)
        return self._layout_paces[key]

    def _least_pace(self, cfg: StageConfig, b: int) -> tuple[float, float, float]:
        """One stage's least one-layer time, least time per layer over runs of any
        length, and least time of a run that ends the model, a last stage's
        (`interleaved_floor`'s parts, asked for every row of device groups)."""
        key = (cfg, b)
        if key not in self._paces:
            r = self._stage_runs(cfg, b)
            lengths = np.arange(1, self.costs.n + 1)
            self._paces[key] = (min(r.time[0], r.remat[0]), float((np.minimum(r.time, r.remat) / lengths).min()),
                                float(min(r.last.min(), r.last_remat.min())))
        return self._paces[key]

    def _work_s(self) -> float:
        """Seconds of work per example at one FLOP/s: what a step's devices share."""
        return float(self.costs.flops.sum() if self.problem.training else self.costs.fwd_flops.sum())

    def _kind_rate(self, kind: str) -> float:
        k = self.problem.kind(kind)
        return k.count * k.flops

    def _work_floor(self, layouts: tuple[KindLayout, ...], examples: int) -> float:
        """An interleaved step's bound: no schedule beats all the layouts' devices at
        full speed on the examples' work. (The 1F1B bounds do not hold for it: their
        fill and microbatches in flight are one chunk per device group's, so they can
        exceed an interleaved step, whose fill is 1/v and whose chunks hold fewer.)"""
        return self._work_s() * examples / sum(self._kind_rate(lay.kind) for lay in layouts)

    def _layout_rows(self, layouts: list[KindLayout] | tuple[KindLayout, ...], b: int) -> LayoutRows:
        """The table of every layout of each kind a bound has met at microbatch size `b`,
        these included (a kind's layouts at once: its sets and orders meet most of them,
        and its runs are priced for its products' floors already; each figure is the
        layout's own, whatever the sets and orders it is in)."""
        table = self._layout_tables.get(b)
        kinds = {lay.kind for lay in layouts if table is None or lay not in table.index}
        if not kinds:
            return table
        missing = tuple(lay for kind in sorted(kinds) for lay in self._layouts_of(kind)
                        if b % lay.dp == 0 and (table is None or lay not in table.index))
        missing += tuple(lay for lay in dict.fromkeys(layouts)
                         if lay not in missing and (table is None or lay not in table.index))
        self._tail_grid()  # (prices every layout's end tails)
        members = [lay.config for lay in (table.layouts if table is not None else [])] + [lay.config for lay in missing]
        self._layout_tables[b] = table = with_layouts(table, missing, self._runs_of(missing, b),
                                                      self.fits.all(missing, b, range(1, self.costs.n + 1)),
                                                      np.array([self._end_tails[lay.config] for lay in missing]),
                                                      self.costs.least_sends(members, b))
        return table

    def _least_tail(self, layouts: tuple[KindLayout, ...]) -> float:
        """The least u such that stages whose every run costs at most u in tail (and
        per-microbatch ZeRO collectives, which a stage pays at least once) can hold
        all the layers: the slowest tail is at least that."""
        if layouts not in self._least_tails:
            candidates = self._tail_grid()
            held = sum(self._layout_tails(lay) for lay in layouts)  # nondecreasing along the candidates
            enough = int(held.searchsorted(self.costs.n))
            self._least_tails[layouts] = float(candidates[enough]) if enough < len(candidates) else 0.0
        return self._least_tails[layouts]

    def _ends_tails(self, table: LayoutRows, at: np.ndarray, ordered: bool) -> np.ndarray:
        """Per row of layouts (`at`: its stages' rows in `table`), a floor
        under its slowest tail: its first stage's least tail over the runs holding the
        model's first layer, and its last's holding the last (on a language model the
        embedding and the head, the largest by parameters: at least 94 ms where eight
        T4s hold Metis's 4096-wide GPT's embedding, against 17 ms for the set's bound,
        `_least_tail`, of T4, V100 and A100 layouts on 64 GPUs). Not `ordered` (a set):
        some stage is first and some last, each at least the least such tail among them."""
        ends = table.ends[at]  # [row, stage, first or last]
        return np.maximum(ends[:, 0, 0], ends[:, -1, 1]) if ordered else ends.min(axis=1).max(axis=1)

    def _layout_tails(self, lay: KindLayout) -> np.ndarray:
        """Per candidate tail, the most layers all of a layout's stages hold within it
        (kept per layout: every group and kind asks it, and a layout's key hashes in C)."""
        if lay not in self._tail_held:
            self._tail_held[lay] = lay.stages * self._tail_rooms(lay.config)
        return self._tail_held[lay]

    def _tail_rooms(self, cfg: StageConfig) -> np.ndarray:
        """Per candidate tail (`_tail_grid`), the most layers one such stage holds within it."""
        if cfg not in self._held_tails:
            self._held_tails[cfg] = longest(self._stage_tails(cfg), self._tail_grid())
        return self._held_tails[cfg]

    def _stage_tails(self, cfg: StageConfig) -> np.ndarray:
        """[n - 1]: over runs of n consecutive layers and ZeRO stages, the least tail
        (gradient sync and optimizer) plus per-microbatch ZeRO collectives, as the
        stage table prices them."""
        if cfg not in self._tails:
            self._tails[cfg] = least_runs(self._tail_spans(cfg))
        return self._tails[cfg]

    def _tail_spans(self, cfg: StageConfig) -> np.ndarray:
        """Per range of layers, `_stage_tails`' least over ZeRO stages."""
        least = np.full((self.costs.n + 1, self.costs.n + 1), INF)
        for zero in self.costs.zero_stages(cfg):
            extra_f, extra_b, _, tail = self.costs.step_costs(cfg, zero)
            least = np.minimum(least, extra_f + extra_b + tail)
        return least

    def _stage_runs(self, cfg: StageConfig, b: int) -> StageRuns:
        """The least times of runs of consecutive layers on one of these stages, the
        forward and backward summed as the stage table sums them (ZeRO's collectives
        and the choice of ZeRO stage only add to them), or as one program where that
        is less (a last stage's, `StageCosts._fused_backward`: it may be either); priced
        once per shape whose per-layer times are the same (`StageCosts.times_key`)."""
        key = self.costs.times_key(cfg, b)
        if key not in self._runs:
            self._all_runs([(cfg, b)])
        return self._runs[key]

    def _runs_of(self, layouts: tuple[KindLayout, ...], b: int) -> list[StageRuns]:
        """`_stage_runs` of each layout, kept per (layout, b) too: `times_key` builds and
        hashes a StageConfig (a dataclass, hashed in Python) per ask, and the groups and
        kinds ask each layout hundreds of times."""
        known = self._layout_runs
        try:
            return [known[lay, b] for lay in layouts]
        except KeyError:
            self.price_runs((lay, b) for lay in layouts)
            return [known[lay, b] for lay in layouts]

    def price_runs(self, shapes: Iterable[tuple[KindLayout, int]]) -> None:
        """`_runs_of` of each (layout, microbatch size), those not yet priced in one
        array pass: a search asks its kinds' layouts at every microbatch size, and a
        pass per size made 28 passes a solve on 64 GPUs of three kinds."""
        todo = list(dict.fromkeys(shape for shape in shapes if shape not in self._layout_runs))
        self._layout_runs.update(zip(todo, self._all_runs([(lay.config, b) for lay, b in todo])))

    def _all_runs(self, shapes: list[tuple[StageConfig, int]]) -> list[StageRuns]:
        """`_stage_runs` of each (stage, microbatch size), those not yet priced in one
        array pass (`rows`: the spans, least runs and steps of every shape at once)."""
        keys = [self.costs.times_key(cfg, b) for cfg, b in shapes]
        todo = {key: shape for key, shape in zip(keys, shapes) if key not in self._runs}
        if todo:
            layers = self.costs.layer_times_of(todo)  # (forward, backward, rerun, fused)
            fields = stage_runs(np.array([t[0] for t in layers]), np.array([t[1] for t in layers]), [t[3] for t in layers])
            self._runs.update(zip(todo, fields))
        return [self._runs[key] for key in keys]


    def _in_flight(self, schedule: str, m: int, num_stages: int) -> tuple[int, ...]:
        """Microbatches each position of a pipeline holds; the last holds one
        (solver.memory)."""
        key = (schedule, m, num_stages)
        if key not in self._held:
            self._held[key] = tuple(in_flight(schedule, m, p, num_stages) for p in range(num_stages - 1)) + (1,)
        return self._held[key]
