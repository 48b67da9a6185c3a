"""Pipeline schedules, registered once: `get(name)` and `names()` are how the
simulator, planner, memory model, dispatch order, timeline, CLI and plan checks learn
about schedules. Adding one is a module defining a `Schedule` and a line below (or
`registered(...)` for a while)."""

from solver.schedules.base import Schedule, StageTimes, Work, device_totals
from solver.schedules.gpipe import GPipe
from solver.schedules.interleaved import Interleaved1F1B
from solver.schedules.one_f_one_b import OneFOneB
from solver.schedules.registry import get, names, register, registered, unregister

register(GPipe())
register(OneFOneB())
register(Interleaved1F1B())

# The schedule a hand-made plan runs when none is named, and the planner's default
# choices (where 1F1B may run the planner leaves GPipe out: `GPipe.dominated_by`).
DEFAULT = GPipe.name

__all__ = ["DEFAULT", "Schedule", "StageTimes", "Work", "device_totals", "get", "names", "register", "registered", "unregister"]
