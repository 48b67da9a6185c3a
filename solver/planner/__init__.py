"""The heterogeneous planner (no JAX here): layers and device kinds in, plans out."""

from solver.planner.problem import (
    DeviceKind,
    LayerCost,
    PlanChoice,
    PlanningError,
    Problem,
    SearchResult,
    StageChoice,
)
from solver.planner.search import Planner, plan

__all__ = [
    "DeviceKind", "LayerCost", "PlanChoice", "Planner", "PlanningError", "Problem", "SearchResult", "StageChoice", "plan",
]
