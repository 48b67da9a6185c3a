"""Proving that no split of a microbatch over replica pipelines can win, before any
pipeline is searched for a share.

A replica plan gives each of its kinds' pipelines a share of every microbatch and
takes as long as the slowest (plus the gradient sum across them). The planner finds
its shares by searching each kind's pipelines on candidate shares (`Planner.
_best_shares`), which on large microbatches first searches every kind on the whole
microbatch to learn its rate. Most such plans lose to the pipelines the main search
found; this refuses them from floors alone: a share is lost when a floor on its kind's
fastest pipeline (all its devices at full speed, which only grows with the share; or
the bounds' floor over the kind's layouts at that share) already reaches the best
found, and the plan is lost when every split of the microbatch has a lost share.
"""

from __future__ import annotations

from typing import Callable, Sequence


def most_share(size: int, in_time: Callable[[int], bool]) -> int:
    """The largest share in [0, size] that `in_time` accepts, for a test that only
    fails more as the share grows (0 where it accepts none above 0), by bisection."""
    lo, hi = 0, size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if in_time(mid) else (lo, mid - 1)
    return lo


def every_split_loses(size: int, most: Sequence[int], loses: Callable[[int, int], bool], budget: int) -> bool:
    """Whether every split of `size` examples into one positive share per part, part i
    taking at most `most[i]`, gives some part a share `loses(i, share)` says loses
    (True: proven; False: a split may win, or proving it would ask `loses` more than
    `budget` times). Each part's shares are an interval [lo, hi]: the parts' sum bounds
    each (lo_i >= size - sum of the others' hi, hi_i <= size - sum of the others' lo),
    and an end share that loses is cut off; when some interval empties no split is
    left. (Shares inside an interval are not asked: an interval that does not empty
    leaves the answer False, never a wrong True.)"""
    n = len(most)
    lo, hi = [1] * n, [min(h, size - (n - 1)) for h in most]
    asked: dict[tuple[int, int], bool] = {}

    def lost(i: int, share: int) -> bool:
        if (i, share) not in asked:
            asked[i, share] = loses(i, share)
        return asked[i, share]

    while True:
        # the sums first (to their fixed point: each pass only narrows)
        narrowed = True
        while narrowed:
            narrowed = False
            top, bottom = sum(hi), sum(lo)
            for i in range(n):
                new_lo, new_hi = max(lo[i], size - (top - hi[i])), min(hi[i], size - (bottom - lo[i]))
                if new_lo > new_hi:
                    return True
                if (new_lo, new_hi) != (lo[i], hi[i]):
                    lo[i], hi[i], narrowed = new_lo, new_hi, True
        if min(hi[i] - lo[i] + 1 for i in range(n)) > budget - len(asked):
            return False  # no part's shares can all be asked within the budget
        cut = False
        for i in range(n):
            for end, step in ((lo, 1), (hi, -1)):
                while lo[i] <= hi[i]:
                    if len(asked) >= budget and (i, end[i]) not in asked:
                        return False
                    if not lost(i, end[i]):
                        break
                    end[i] += step
                    cut = True
            if lo[i] > hi[i]:
                return True
        if not cut:
            return False
