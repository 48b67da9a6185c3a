"""How one kind's devices may form a pipeline's stages (`KindLayout`): what the
planner's bounds, their fitting figures and the search all enumerate and key by, in
a module of its own so each of them can import it."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from solver.cost.stage_costs import StageConfig
from solver.planner.problem import Problem


class KindLayout(NamedTuple):
    """How one kind's devices form stages. (A tuple: the search hashes millions of
    them as cache keys, and a tuple hashes in C.)"""

    kind: str
    stages: int
    dp: int
    tp: int

    @property
    def config(self) -> StageConfig:
        return _config(self.kind, self.dp, self.tp)


@lru_cache(maxsize=None)
def _config(kind: str, dp: int, tp: int) -> StageConfig:
    """One StageConfig per shape (a value, so sharing it is safe): the search asks tens of thousands of times."""
    return StageConfig(kind, dp, tp)


def kind_layouts(problem: Problem, kind_name: str) -> list[KindLayout]:
    kind = problem.kind(kind_name)
    out = []
    for tp in kind.tp_degrees(problem.max_tp):
        if kind.count % tp:
            continue
        rest = kind.count // tp
        for k in range(1, min(rest, len(problem.layers)) + 1):
            if rest % k == 0:
                out.append(KindLayout(kind_name, k, rest // k, tp))
    return out
