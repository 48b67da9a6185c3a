"""hetpar: automatic parallelization of JAX train steps on heterogeneous clusters."""

from hetpar.api import ParallelFunction, parallelize
from hetpar.cluster.catalog import DeviceType, devices
from hetpar.cluster.cluster import Cluster, DeviceGroup
from hetpar.errors import ClusterError, HetparError, PlanError, UnsupportedStepError
from hetpar.markers import grad, value_and_grad
from hetpar.plan import Plan, StagePlan

__all__ = [
    "Cluster",
    "ClusterError",
    "DeviceGroup",
    "DeviceType",
    "HetparError",
    "ParallelFunction",
    "Plan",
    "PlanError",
    "StagePlan",
    "UnsupportedStepError",
    "devices",
    "grad",
    "value_and_grad",
    "parallelize",
]
