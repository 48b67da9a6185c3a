"""The exact split of a chain of layers over an ordered row of stages.

For a fixed row of stages and microbatch count, a 1F1B step is

    S + (m - 1) x max(the slowest stage or send, S / k where m > k)
    + the slowest tail (gradient sync and optimizer),
    S = sum of stage times + 2 x sum of sends

(`solver.pipeline_sim.pipeline_time`; S / k: the first stage's round trips, k
microbatches in flight per S). S is additive over stages, the two maxima are not, so
the split cannot be one dynamic program. It is one per pair of bounds (T on stage and
send times, U on tails): with both fixed, the least S is a shortest path over cut
positions, and the step only grows with S, so that path is the best split within the
bounds. Sweeping T and U upward from their least feasible values, and stopping when
`least unconstrained S + (m - 1) max(T, S / k) + U` can no longer beat the best split
found, gives the exact optimum after a handful of passes, because the bubble term
dominates and moves little between neighbouring bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from solver import schedules
from solver.schedules import StageTimes
from solver.schedules.one_f_one_b import round_trip_pace
from solver.cost.stage_costs import INF
from solver.cost.stage_tables import StageTable
from solver.planner.rows import sorted_unique
from solver.planner.runs import balanced_pace


@dataclass(frozen=True)
class Split:
    cuts: tuple[int, ...]  # layer index where each stage after the first starts
    objective_s: float


def score(tables: Sequence[StageTable], sends: Sequence[np.ndarray], m: int, cuts: Sequence[int], schedule: str = schedules.DEFAULT,
          chunks: int = 1) -> float:
    """The schedule's closed-form step time of one split (inf if a stage does not fit)."""
    bounds = list(zip([0, *cuts], [*cuts, tables[0].forward.shape[0] - 1]))
    fwd = [t.forward.item(i, j) for t, (i, j) in zip(tables, bounds)]  # (Python floats: the figures below add as floats)
    bwd = [t.backward.item(i, j) for t, (i, j) in zip(tables, bounds)]
    sent = [float(s[c]) for s, c in zip(sends, cuts)] + [0.0]
    if not all(map(math.isfinite, fwd + bwd + sent)):
        return INF
    times = [StageTimes(f, b, e, t.tail.item(i, j)) for f, b, e, t, (i, j) in zip(fwd, bwd, sent, tables, bounds)]
    return schedules.get(schedule).step_time(times, m, chunks)


class _Row:
    """One row of stages, with the masked shortest path over cut positions.

    Every stage holds a layer at least (a table's range [i, j) runs only where i < j,
    inf elsewhere), so stage p of k can only start at a cut in [p, p + w) and end at one
    in [p + 1, p + 1 + w), w = n - k + 1 (the last stage ends at n): the paths run on
    those windows of each table (`_window`), not the whole (n+1, n+1) tables. Every
    entry left out is inf in the sums (its range does not run, or no path reaches its
    start), so each least figure is the same; the tables' minima lose only infs."""

    def __init__(self, tables: Sequence[StageTable], sends: Sequence[np.ndarray]):
        self.tables = tables
        self.times = [t.time for t in tables]
        self.tails = [t.tail for t in tables]
        self.sends = [np.asarray(s) for s in sends]
        self.n = self.times[0].shape[0] - 1
        self.width = self.n - len(self.times) + 1
        self.times_w = [self._window(t, p) for p, t in enumerate(self.times)]
        self.tails_w = [self._window(u, p) for p, u in enumerate(self.tails)]
        self.sends_w = [s[p + 1 : p + 1 + self.width] for p, s in enumerate(self.sends)]
        self.doubled_w = [2 * s for s in self.sends_w]  # (2 x a send is exact: the same figure however often taken)
        self._free: tuple[float, list[np.ndarray]] | None = None  # `least_total`'s paths

    def _window(self, table: np.ndarray, p: int) -> np.ndarray:
        """Stage p's ranges that some split can give it: rows (start cuts) [p, p + w),
        columns (end cuts) [p + 1, p + 1 + w), only n for the last stage, only 0 as the
        start of the first (a 1-D row)."""
        w, n = self.width, self.n
        if p == 0:
            return table[0, 1 : 1 + w] if len(self.times) > 1 else table[0, n : n + 1]
        if p == len(self.times) - 1:
            return table[p : p + w, n : n + 1]
        return table[p : p + w, p + 1 : p + 1 + w]

    def _end(self, p: int, j: int) -> int:
        """The column of end cut j in stage p's window (p >= 1)."""
        return 0 if p == len(self.times) - 1 else j - p - 1

    def least_sum(self, t_max: float = INF, u_max: float = INF) -> tuple[float, tuple[int, ...]]:
        if t_max == INF and u_max == INF:
            self.least_total()
            value, totals = self._free
        else:
            costs = [np.where((t <= t_max) & (u <= u_max), t, INF) for t, u in zip(self.times_w, self.tails_w)]
            value, totals = self._sum_paths(costs, t_max)
        if value == INF:
            return INF, ()
        cuts, j = [], self.n
        for p in range(len(totals), 0, -1):  # back from the end: each stage's start is its end column's least entry
            j = p + int(totals[p - 1][:, self._end(p, j)].argmin())
            cuts.append(j)
        return value, tuple(reversed(cuts))

    def _sum_paths(self, costs: Sequence[np.ndarray], t_max: float) -> tuple[float, list[np.ndarray]]:
        """The least sum over `costs` (a stage's window each, sends within `t_max` twice)
        and each stage's costs [start, end] of the paths, which give the cuts back."""
        best, totals = costs[0], []
        for p in range(1, len(costs)):
            doubled = self.doubled_w[p - 1]
            start = best + (doubled if t_max == INF else np.where(self.sends_w[p - 1] <= t_max, doubled, INF))
            totals.append(start[:, None] + costs[p])
            best = np.minimum.reduce(totals[-1], axis=0)
        return float(best[-1]), totals

    def least_total(self) -> float:
        """`least_sum()`'s value without its cuts (the same sums, so the same figure):
        most pipelines are refused on it before their cuts matter, and those that are
        not take their cuts from its paths (kept)."""
        if self._free is None:
            self._free = self._sum_paths(self.times_w, INF)
        return self._free[0]

    def least_work(self) -> float:
        """The least summed stage time of any split, sends left out: every split's
        device groups share at least this much compute between them."""
        best = self.times_w[0]
        for t in self.times_w[1:]:
            best = np.minimum.reduce(best[:, None] + t, axis=0)
        return float(best[-1])

    def pace_floor(self, v: int) -> float:
        """A floor under the pace of the busiest device group of the row (stage p on
        group p mod k/v, each holding v stages) in any split, beside the least shared
        work spread evenly (`least_work`), which misses what slow kinds cost:
        - every stage holds a layer at least, so a group takes at least the least time
          of any range on each of its stages, summed;
        - no stage runs a range faster per layer than its least time per layer over
          the ranges it can hold, so group g spends at least its stages' least such
          rate r_g on each of its q_g layers; with sum q_g = n, the busiest group takes
          at least n / sum(1 / r_g) (the balance were layers divisible)."""
        groups = len(self.times) // v
        least = np.array([t.least_time for t in self.tables]).reshape(v, groups)
        per_layer = np.array([t.least_rate for t in self.tables])
        rates = per_layer.reshape(v, groups).min(axis=0)
        return max(float(least.sum(axis=0).max()), balanced_pace(self.n, rates))

    def group_paths(self, v: int, rate: float, limit: float) -> np.ndarray:
        """Per device group g (stage p on group p mod k/v): the least over splits whose
        stage and send times all stay within `limit` of

            sum_p t_p / v + 2 sum of sends + sum over g's stages p of (rate t_p + u_p),

        t_p a stage's time, u_p its tail. Additive over stages, so one shortest path per
        group, all groups at once: the paths share every stage's cost but group g's own
        (`_every_group_loses` says why each is a floor under an interleaved step)."""
        groups = len(self.times) // v
        for p, (t, u) in enumerate(zip(self.times_w, self.tails_w)):
            masked = np.where(t <= limit, t, INF)
            light = masked / v
            heavy = light + rate * masked + u  # (tails are 0 where a range does not run, its time inf)
            g = p % groups
            if p == 0:
                best = np.tile(light, (groups, 1))
                best[g] = heavy
                continue
            start = best + np.where(self.sends_w[p - 1] <= limit, self.doubled_w[p - 1], INF)
            total = start[:, :, None] + light  # [group, start, end]: g's own stage priced heavy, the others light
            np.add(start[g][:, None], heavy, out=total[g])
            best = np.minimum.reduce(total, axis=1)
        return best[:, -1]

    def group_memory(self, memories: Sequence[np.ndarray], v: int, limit: float) -> np.ndarray:
        """Per device group g: the least bytes its stages hold together (`memories`: each
        stage's per range) over splits whose stage and send times all stay within
        `limit`, summed in the order `chunk_memory.chunks_fit` sums them (stage order), so a
        split's own figure is exactly its path's."""
        groups = len(self.times) // v
        for p, (t, held) in enumerate(zip(self.times_w, memories)):
            runs = t <= limit
            free, own = np.where(runs, 0.0, INF), np.where(runs, self._window(held, p), INF)
            g = p % groups
            if p == 0:
                best = np.tile(free, (groups, 1))
                best[g] = own
                continue
            start = best + np.where(self.sends_w[p - 1] <= limit, 0.0, INF)
            total = start[:, :, None] + free  # [group, start, end]: g holds its stage's bytes, the others none
            np.add(start[g][:, None], own, out=total[g])
            best = np.minimum.reduce(total, axis=1)
        return best[:, -1]

    def sums_and_tails(self, t_maxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`least_sum(t_max)`'s value and `least_max(t_max, of_tails=True)` for each of
        `t_maxes` (the same figures: the same sums in the same order), in one pass: both
        mask the same stage times and sends by each bound, and nearly every caller that
        asks one asks the other. A range over its bound is priced inf after the sum or
        maximum (copied over it in place) rather than before: start + inf and max(start,
        inf) are inf either way, so the figures stay, with one array fewer per stage.
        With several bounds (the sweep's), the middle stages run on their bands, the
        ranges short enough to fit the largest bound (`_reach`, `_band`): a few of a
        window's columns, read along its diagonals, whose least is the window's (every
        range left out is over every bound)."""
        limits = t_maxes[:, None]
        bounds = limits[:, :, None]
        first = self.times_w[0] <= limits
        best_sum = np.where(first, self.times_w[0], INF)
        best_tail = np.where(first, self.tails_w[0], INF)
        k, w = len(self.times), self.width
        if len(t_maxes) > 1 and k > 2 and float(t_maxes.max()) < INF:
            q = self._reach(float(t_maxes.max()))
            sums_buf, sums_least = _skewed_buffer(len(t_maxes), q, w)
            tails_buf, tails_least = _skewed_buffer(len(t_maxes), q, w)
            for p in range(1, k - 1):
                sent = self.sends_w[p - 1] <= limits
                band, tail_band = self._band(self.times[p], p, q), self._band(self.tails[p], p, q)
                over = band > bounds
                np.add((best_sum + np.where(sent, self.doubled_w[p - 1], INF))[:, None, :], band, out=sums_buf)
                np.copyto(sums_buf, INF, where=over)
                best_sum = np.minimum.reduce(sums_least, axis=1)
                np.maximum(np.where(sent, best_tail, INF)[:, None, :], tail_band, out=tails_buf)
                np.copyto(tails_buf, INF, where=over)
                best_tail = np.minimum.reduce(tails_least, axis=1)
            stages = range(k - 1, k)
        else:
            stages = range(1, k)
        for p in stages:
            time, tail, send, doubled = self.times_w[p], self.tails_w[p], self.sends_w[p - 1], self.doubled_w[p - 1]
            sent = send <= limits
            over = time > bounds
            total = (best_sum + np.where(sent, doubled, INF))[:, :, None] + time
            np.copyto(total, INF, where=over)
            best_sum = np.minimum.reduce(total, axis=1)
            top = np.maximum(np.where(sent, best_tail, INF)[:, :, None], tail)
            np.copyto(top, INF, where=over)
            best_tail = np.minimum.reduce(top, axis=1)
        return best_sum[:, -1], best_tail[:, -1]

    def _reach(self, limit: float) -> int:
        """A bound on the layers any middle stage's range within `limit` holds: no range
        runs faster per layer than its table's least rate (`StageTable.least_rate`), so
        one of q layers takes at least q times it (widened for the rounding of the
        rates' quotients, and at most the window's width: a bound, not the least)."""
        most = 1
        for table in self.tables[1:-1]:
            rate = table.least_rate
            if not rate > 0:
                return self.width
            most = max(most, int(min(limit / rate * _ABOVE, self.width)) + 1)
        return min(most, self.width)

    def _band(self, table: np.ndarray, p: int, q: int) -> np.ndarray:
        """Stage p's window (p a middle stage) read along its diagonals, [d, i] its range
        from window row i holding d + 1 layers (`table`[p + i, p + 1 + i + d]): the
        ranges of at most q layers, a view of the table in place. Entries past the
        window's last column (i + d >= w) run on into the table's next row (never
        read: `_skewed_buffer` takes a stage's end cuts only where its window has them);
        numpy refuses a view past the table's end (none is: p + w - 1 <= n - 2)."""
        table = np.ascontiguousarray(table)
        down, across = table.strides
        return np.ndarray((q, self.width), buffer=table, offset=p * down + (p + 1) * across, strides=(across, down + across))

    def least_max(self, t_max: float = INF, of_tails: bool = False) -> float:
        """The least possible largest stage time (or tail, among splits whose stage and
        send times stay within `t_max`): a bottleneck path, min over cuts of the max."""
        if of_tails and t_max == INF:
            return self._least_tail()

        def masked(p: int) -> np.ndarray:
            t = self.times_w[p]
            if t_max == INF:  # nothing to mask (every entry is at most inf): the same figures, without the copy
                return self.tails_w[p] if of_tails else t
            return np.where(t <= t_max, self.tails_w[p] if of_tails else t, INF)

        best = masked(0)
        for p in range(1, len(self.times_w)):
            send = self.sends_w[p - 1]
            start = best if of_tails else np.maximum(best, send)
            if t_max < INF:
                start = np.where(send <= t_max, start, INF)
            best = np.minimum.reduce(np.maximum(start[:, None], masked(p)), axis=0)
        return float(best[-1])

    def _least_tail(self) -> float:
        """`least_max(of_tails=True)` with no bound, on the whole tables, not the
        windows: a range that does not run has tail 0 there (not inf), so a path may
        pass through ranges no split holds, and the windows' figure could differ. Only
        the last stage's column n is priced (the figure reads only it)."""
        k, n = len(self.tails), self.n
        best = self.tails[0][0]
        for p in range(1, k):
            best = np.minimum.reduce(np.maximum(best[:, None], self.tails[p] if p < k - 1 else self.tails[p][:, n:]), axis=0)
        return float(best[-1])


def best_split(
    tables: Sequence[StageTable], sends: Sequence[np.ndarray], m: int, beat: float = INF, schedule: str = schedules.DEFAULT,
    chunks: int = 1, shared: bool = False,
) -> Split | None:
    """The split with the least 1F1B step time, or None when none fits or none beats `beat`.

    For GPipe (whose two maxima bound the forward and the backward separately, and
    which has no round trips to wait for) the same sweep runs on the 1F1B form without
    its round trips and the result is scored with GPipe's: close, not proven optimal; a
    search that may pick 1F1B does not try GPipe (`Schedule.dominated_by`). Interleaved
    splits (`chunks` = v > 1 stages per device group) take the 1F1B sweep too, pruned by
    the 1F1B form (without round trips) of the splits it finds, each scored with the
    interleaved form: close, not proven optimal (their pace is a device group's sum of
    chunks). Only the early refusals use the interleaved form's own bound (the fill
    counts 1/v, the rest m - 1/v stage times). With `shared` (v > 1), also None where no
    split whose chunks share their device groups' memory beats `beat` (the caller
    refuses a split that does not fit: `chunk_memory.chunks_fit`)."""
    v = chunks
    row = _Row(tables, sends)
    n, k = row.n, len(tables)
    if k > n:
        return None
    t_lo = row.least_max()
    if t_lo == INF or (m - 1) * t_lo >= beat:
        return None
    sum0 = row.least_total()

    def round_trips(t: float, total: float) -> float:
        """The pace of a split whose slowest stage or send is `t` and whose stage times
        and sends both ways sum to `total` (the sweep's bounds take the least of each)."""
        return max(t, round_trip_pace(total, k, m))

    pace = round_trips if v == 1 and schedules.get(schedule).round_trip_limited else _slowest  # 1F1B's may pace it
    # An interleaved pace is a device group's chunks summed: at least the groups' least
    # shared work spread evenly over them (k / v groups), which one chunk's t_lo is not.
    pace_lo = pace(t_lo, sum0) if v == 1 else max(t_lo, row.least_work() * v / k, row.pace_floor(v) * _BELOW)
    if sum0 / v + (m - 1 / v) * pace_lo >= beat:
        return None  # before the tail's bound (tails are never negative) and the sweep's grids
    u_floor = row.least_max(of_tails=True)
    if sum0 / v + (m - 1 / v) * pace_lo + u_floor >= beat:
        return None
    if v > 1 and beat < INF and _every_group_loses(row, m, v, sum0, u_floor, beat):
        # an interleaved row whose one group alone loses, before the sweep (which bounds 1F1B's form, not
        # the beat): first, as on the benchmark scenarios it refuses every row the next one does and more
        return None
    if shared and v > 1 and beat < INF and not _fitting_may_win(row, tables, m, v, sum0, u_floor, beat):
        return None  # a split fast enough leaves some group's chunks over its memory
    if m - 1 / v > 0 and beat < INF and _every_bottleneck_loses(row, m, v, pace_lo, sum0, u_floor, beat, pace):
        return None  # before the sweep's grids: most pipelines the search prices lose here
    sum0, cuts0 = row.least_sum()
    # Every bottleneck and tail a split can have: each table's own, sorted once per table
    # (a table serves many pipelines), merged (a stable sort runs through sorted runs).
    t_values = sorted_unique(np.concatenate([t.run_times for t in tables] + [s[1:n] for s in row.sends]), kind="stable")
    if m == 1 and v == 1:
        # One microbatch: no pace term, so the loosest bottleneck's least sums are every split's least (the
        # sweep would walk up to them from the tightest, pricing each on the way).
        t_values = t_values[-1:]
    u_values = sorted_unique(np.concatenate([t.run_tails for t in tables]), kind="stable")
    best = Split(cuts0, score(tables, sends, m, cuts0, schedule, chunks))
    # What the sweep prunes against: the best objective (one chunk), or the best 1F1B
    # form seen (interleaved: its objective is not the form the sweep bounds).
    best_value = min(best.objective_s, beat) if v == 1 else _flow_shop(tables, sends, m, cuts0)
    swept = _swept(row, t_values[np.searchsorted(t_values, t_lo):],
                   lambda t: sum0 + (m - 1) * pace(t, sum0) + u_floor < best_value,
                   lambda t, sum_t: sum_t + (m - 1) * pace(t, sum_t) + u_floor < best_value)
    for t_max, sum_t, u_lo in swept:
        least = sum_t + (m - 1) * pace(t_max, sum_t)  # of every split within t_max, before its tail
        if least + u_floor >= best_value:
            continue  # no tail bound can make this bottleneck win (the loop below would stop at once)
        for u_max in u_values[np.searchsorted(u_values, u_lo):]:
            if least + u_max >= best_value:
                break
            value, cuts = row.least_sum(t_max, u_max)
            if value + (m - 1) * pace(t_max, value) + u_max < best_value:
                objective = score(tables, sends, m, cuts, schedule, chunks)
                if objective < best.objective_s:
                    best = Split(cuts, objective)
                    best_value = min(best_value, objective) if v == 1 else best_value
                if v > 1:
                    best_value = min(best_value, _flow_shop(tables, sends, m, cuts))
            if value <= sum_t:
                break  # a looser tail bound cannot shorten the sum further
    return best if best.objective_s < beat else None


_BELOW = 1 - 1e-9  # a pace bound kept below what it bounds despite rounding (the splits' figures sum in their own order)


_ABOVE = 1 + 1e-9  # a count of layers bounded above despite the rounding of the per-layer rates it divides by


_REFUSE_TOL = 1 + 1e-9  # a bound refuses only what loses by more than rounding (score sums in its own order)


def _slowest(t: float, total: float) -> float:
    """A pace that is its slowest stage or send alone (no round trip counted)."""
    return t


def _every_bottleneck_loses(row: _Row, m: int, v: int, pace_lo: float, sum0: float, u_floor: float, beat: float,
                            pace: Callable[[float, float], float] = _slowest) -> bool:
    """Whether no split beats `beat`, proven for every pace that could win at once
    instead of at each bottleneck value: a split whose pace (1F1B: its slowest stage
    or send; interleaved, v chunks: its busiest device group's chunks or sends, each
    of which it bounds) lies in [pace_lo, hi] costs at least least_sum(hi) / v +
    (m - 1/v) pace_lo + least_tail(hi) (both least figures only grow as the bound on
    stage times falls; a group's tail is at least its slowest chunk's; 1F1B's pace is
    also at least its round trip's at least_sum(hi), `pace`), and one whose
    pace exceeds `hi` loses on sum0 / v + (m - 1/v) pace + u_floor alone. One
    shortest path or two instead of the sweep's grids of every table entry: on the
    benchmark scenarios this refuses nearly every pipeline the sweep would."""
    rate = m - 1 / v
    hi = np.array([(beat * _REFUSE_TOL - sum0 / v - u_floor) / rate])
    if not hi[0] > pace_lo:
        return False  # (the caller's refusals leave none such; the sweep keeps the say)
    sums, tails = row.sums_and_tails(hi)  # (the sum alone seldom refuses: both in one pass)
    sum_hi = float(sums[0]) / v
    rest = rate * pace(pace_lo, float(sums[0]))  # (1F1B: its round trips at that sum at the least)
    if sum_hi + rest + u_floor < beat * _REFUSE_TOL:
        return sum_hi + rest + max(float(tails[0]), u_floor) >= beat * _REFUSE_TOL
    return True


def _every_group_loses(row: _Row, m: int, v: int, sum0: float, u_floor: float, beat: float) -> bool:
    """Whether no split of an interleaved row (v > 1 chunks per device group) beats
    `beat`. Its step (`Interleaved1F1B.step_time`) is

        I = sum_p t_p / v + 2 sum of sends + (m - 1/v) pace + the largest group tail,

    pace the busiest group's stage times summed (or its sends), a group's tail its
    stages' tails summed. A split whose pace exceeds hi = (beat - sum0 / v - u_floor)
    / (m - 1/v) loses on that alone (its stage and send sums at least sum0, which is
    least over all splits, its tail at least u_floor). In one whose pace is within
    hi, every stage time and send is within hi (each lies in some group's sum), and
    for every group g, pace >= g's times summed and the largest tail >= g's tails
    summed: I is at least the additive cost of `_Row.group_paths` for g, whose least
    over such splits it computes. So when some group's least reaches `beat`, no split
    does. It bites where the shared work's floors do not: a device group that must
    hold the head (the last stage's group) or slow kinds paces every split, and an
    interleaved row's sweep (bounded by the 1F1B form of the splits it finds, not the
    beat) would otherwise run to its end. Both comparisons keep `_REFUSE_TOL`'s margin
    for rounding (hi is widened by it, which only weakens the bound)."""
    rate = m - 1 / v
    hi = (beat * _REFUSE_TOL - sum0 / v - u_floor) / rate
    if not hi > 0:
        return False  # (the caller's refusals leave none such; the sweep keeps the say)
    return float(row.group_paths(v, rate, hi).max()) >= beat * _REFUSE_TOL


def _fitting_may_win(row: _Row, tables: Sequence[StageTable], m: int, v: int, sum0: float, u_floor: float,
                     beat: float) -> bool:
    """Whether some split of an interleaved row both fits (each device group's chunks
    within its memory, `chunk_memory.chunks_fit`) and could beat `beat`: a split whose
    pace exceeds hi (`_every_group_loses`) loses, and in one within it every stage
    and send time is within hi, so each group holds at least the least bytes of
    `_Row.group_memory` over such splits (summed in `chunks_fit`'s order, the same
    figures); where that exceeds some group's capacity, no split both fits and wins.
    (On 256 GPUs of three kinds: a first group of T4s can hold its two chunks only
    with splits whose pace loses.)"""
    rate = m - 1 / v
    hi = (beat * _REFUSE_TOL - sum0 / v - u_floor) / rate
    if not hi > 0:
        return True  # (the caller's refusals leave none such; the sweep keeps the say)
    least = row.group_memory([t.memory for t in tables], v, hi)
    return all(float(u) <= tables[g].capacity * (1 + 1e-12) for g, u in enumerate(least))


def _swept(row: _Row, t_values: np.ndarray, going: Callable[[float], bool], useful: Callable[[float, float], bool],
           block: int = 4) -> Iterator[tuple[float, float, float]]:
    """(t, least sum of stage times within t, least slowest tail within t) for each
    bottleneck t in order while `going(t)` (asked afresh for each, as the best split
    improves), priced a block of bottlenecks at a time (growing: most sweeps stop early,
    long ones go far): most bottlenecks only need their sum to be ruled out, and the
    tail is priced (else inf) only where `useful(t, sum)` says the sum alone does not."""
    start = 0
    while start < len(t_values):
        ts = t_values[start : start + block]
        ahead = 0  # the bottlenecks still in the running now (fewer can be, later): only theirs are priced
        while ahead < len(ts) and going(float(ts[ahead])):
            ahead += 1
        if not ahead:
            return
        ts = ts[:ahead]
        sums, tails = row.sums_and_tails(ts)
        # The least tails only matter where the sum leaves the bottleneck in the running
        # (priced with the sums all the same: nearly always most are, and one pass masks once).
        live = np.array([useful(float(t), float(s)) for t, s in zip(ts, sums)], dtype=bool)
        tails = np.where(live, tails, INF)
        for t_max, sum_t, u_lo in zip(ts, sums, tails):
            if not going(float(t_max)):
                return
            yield float(t_max), float(sum_t), float(u_lo)
        start, block = start + len(ts), min(2 * block, 64)


def _flow_shop(tables: Sequence[StageTable], sends: Sequence[np.ndarray], m: int, cuts: Sequence[int]) -> float:
    """The 1F1B form of a split without its round trips (the module docstring's, S / k
    left out): what the sweep bounds where it splits an interleaved row."""
    bounds = list(zip([0, *cuts], [*cuts, tables[0].forward.shape[0] - 1]))
    per_mb = [t.time.item(i, j) for t, (i, j) in zip(tables, bounds)]
    sent = [float(s[c]) for s, c in zip(sends, cuts)]
    tail = max(t.tail.item(i, j) for t, (i, j) in zip(tables, bounds))
    return sum(per_mb) + 2 * sum(sent) + (m - 1) * max(per_mb + sent) + tail


def _skewed_buffer(count: int, q: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """A stage's path costs over its band: `buffer` [t, d, i] for bound t, the range
    from window row i holding d + 1 layers, and `least`, the same memory read as [t,
    d, j]: the range of d + 1 layers ending at window column j (row j - d; rows before
    the window are the inf padding), so the least over d is the least over start cuts
    (the same entries as the whole window's column j but those over every bound)."""
    padded = np.empty((count, q, q - 1 + w))
    padded[:, :, : q - 1] = INF
    along, down, across = padded.strides
    least = np.ndarray((count, q, w), buffer=padded, offset=(q - 1) * across, strides=(along, down - across, across))
    return padded[:, :, q - 1 :], least
