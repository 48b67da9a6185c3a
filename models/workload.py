"""What a reference model hands to hetpar: a step, its arguments, and its loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Workload:
    step: Callable  # (state, batch) -> (new_state, loss), an unmodified train step
    state: Any  # flax TrainState
    batch: Any  # dict of arrays with a leading batch dimension
    loss_fn: Callable  # (params, batch) -> scalar loss
    model: Any  # the flax module
