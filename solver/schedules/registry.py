"""The one list of schedules: every part of hetpar and the solver that needs a
schedule's name, order, memory or time asks here."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from solver.schedules.base import Schedule

_SCHEDULES: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    """Adds a schedule under its name (once: a second schedule of one name is a bug)."""
    if not schedule.name or schedule.name in _SCHEDULES:
        raise ValueError(f"a schedule needs a unique name; {schedule.name!r} is empty or taken")
    _SCHEDULES[schedule.name] = schedule
    return schedule


def unregister(name: str) -> Schedule:
    """Removes the schedule called `name` (what `registered` does on the way out)."""
    schedule = get(name)
    del _SCHEDULES[name]
    return schedule


@contextmanager
def registered(schedule: Schedule) -> Iterator[Schedule]:
    """The schedule known everywhere inside the block, and gone after it."""
    register(schedule)
    try:
        yield schedule
    finally:
        unregister(schedule.name)


def names() -> tuple[str, ...]:
    """Every registered schedule's name, in registration order."""
    return tuple(_SCHEDULES)


def get(name: str) -> Schedule:
    """The schedule called `name`; a ValueError naming the known ones otherwise."""
    try:
        return _SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(_SCHEDULES)}") from None
