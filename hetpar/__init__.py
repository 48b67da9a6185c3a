"""hetpar: automatic parallelization of JAX train steps on heterogeneous clusters."""

from hetpar.runtime.stuck import shorten_collective_timeouts

shorten_collective_timeouts()  # before anything starts JAX's CPU client (hetpar/runtime/stuck.py)


from hetpar.api import ParallelFunction, parallelize
from hetpar.cluster.catalog import DeviceType, devices
from hetpar.cluster.cluster import Cluster, DeviceGroup
from hetpar.errors import ClusterError, HetparError, PlanError, UnsupportedStepError
from hetpar.markers import grad, value_and_grad
from hetpar.options import RuntimeOption, ShardingOption, StageOption
from hetpar.outputs import gather
from hetpar.plan import Plan, StagePlan
from hetpar.plan.file import load_plan, save_plan
from hetpar.runtime.distributed import initialize as initialize_distributed
from hetpar.runtime.distributed import launched_cluster, to_host
from hetpar.runtime.nvme_store import NvmeArray, NvmeStore
from hetpar.runtime.ray_runtime import init, shutdown
from hetpar.pipeline import make_plan
from hetpar.compare import compare_plans
from hetpar.checkpoint import latest_checkpoint, restore_checkpoint, save_checkpoint

__all__ = [
    "Cluster",
    "ClusterError",
    "DeviceGroup",
    "DeviceType",
    "HetparError",
    "NvmeArray",
    "NvmeStore",
    "ParallelFunction",
    "Plan",
    "RuntimeOption",
    "ShardingOption",
    "StageOption",
    "PlanError",
    "StagePlan",
    "UnsupportedStepError",
    "devices",
    "gather",
    "grad",
    "init",
    "initialize_distributed",
    "to_host",
    "shutdown",
    "load_plan",
    "make_plan",
    "compare_plans",
    "save_plan",
    "save_checkpoint",
    "restore_checkpoint",
    "latest_checkpoint",
    "launched_cluster",
    "value_and_grad",
    "parallelize",
]
