"""What a reference model hands to hetpar: a step, its arguments, and its loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn


@dataclass
class Workload:
    step: Callable  # (state, batch) -> (new_state, loss), an unmodified train step
    state: Any  # flax TrainState
    batch: Any  # dict of arrays with a leading batch dimension
    loss_fn: Callable  # (params, batch) -> scalar loss
    model: nn.Module  # the flax module, for tools that want its structure
