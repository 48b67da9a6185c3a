"""Errors a user can act on. Each message names the problem and the fix."""


class HetparError(Exception):
    """Base class: bad input or a program hetpar cannot parallelize as written."""


class UnsupportedStepError(HetparError):
    """The traced train step does something the microbatch analysis cannot split."""


class PlanError(HetparError):
    """A plan that does not fit the model, the cluster or the options."""


class ClusterError(HetparError):
    """An impossible cluster description."""


class CombineRefusal(UnsupportedStepError):
    """The step's per-microbatch results cannot be combined into the full batch's.
    Raised only when there is more than one microbatch: with one, the step runs whole."""
