"""The cluster file's numbers: types and ranges, one declaration each (pydantic).

cluster_file.py walks the YAML node tree (so every message can name its line) and
hands each group's and link's scalar values here, as the text YAML holds them.
Numbers must be finite (NaN and .inf bandwidths once crashed the planner) and within
sizes a real cluster has (a 10^12-device group once ran out of memory).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# More devices than any cluster in existence, few enough to plan over.
MAX_DEVICES = 1 << 20


class _Fields(BaseModel):
    # Lax on purpose: YAML gives text ("12.5e9"); pydantic reads the number from it.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _f(unit: str, meaning: str, **limits: Any) -> Any:
    """A field with its unit and meaning, which the README's table of cluster-file
    fields is generated from (`fields_table`)."""
    return Field(description=meaning, json_schema_extra={"unit": unit}, **limits)


class LinkFields(_Fields):
    """A link: `intra_node:` and `inter_node:` of a group, and each entry of `links:`."""

    name: str | None = _f("-", "a label for views", default=None)
    bandwidth: Annotated[float, _f("bytes/s", "one flow's bandwidth, one direction (inter_node: one NIC's)", gt=0, le=1e15)]
    latency: Annotated[float, _f("s", "per message", ge=0, le=3600)]
    overlap: bool = _f("true/false", "pipeline sends over it run beside compute (false: a blocking transport; the "
                       "sender waits, and the estimator adds the send to its stage's time)", default=True)


class ReductionFields(_Fields):
    """`in_network_reduction:` under a group's `inter_node:` (InfiniBand SHARP) or
    `intra_node:` (NVLink SHARP): the link's switches sum the data crossing them."""

    switch_levels: Annotated[int, _f("count", "switch levels a reduction climbs and descends: 1 for one switch, 2 for "
                                     "leaf and spine, 3 for a three-tier fat tree", gt=0, le=16)]
    latency: Annotated[float, _f("s", "per switch level, each way", ge=0, le=1)]
    bandwidth: Annotated[float | None, _f("bytes/s", "what the switches reduce of one flow, a port's aggregation rate "
                                          "(default: the link's bandwidth)", default=None, gt=0, le=1e15)]
    max_message_bytes: Annotated[float | None, _f("bytes", "the largest message one reduction carries; a larger one goes "
                                                  "in pieces, each a trip up and down the switches (default: no limit)",
                                                  default=None, gt=0, le=1e15)]


class BetweenFields(LinkFields):
    """An entry of `links:`: the path between two groups."""

    between: list[str] | None = _f("group names", "the two groups it joins", default=None)
    direct: bool = _f("true/false", "device to device (RDMA; never between two vendors' devices); false: through both hosts (PCIe to host at each end)",
                      default=False)


class FlopsFields(_Fields):
    """A group's `flops:` mapping: peak dense FLOP/s per dtype, over the catalog's."""

    fp32: Annotated[float | None, _f("FLOP/s", "f32 without TF32", default=None, gt=0, le=1e18)]
    tf32: Annotated[float | None, _f("FLOP/s", "f32 matmuls under JAX's default precision (TF32 on Ampere and later)",
                                     default=None, gt=0, le=1e18)]
    bf16: Annotated[float | None, _f("FLOP/s", "bf16 matmuls, fp32 accumulate", default=None, gt=0, le=1e18)]
    fp16: Annotated[float | None, _f("FLOP/s", "fp16 matmuls, fp32 accumulate", default=None, gt=0, le=1e18)]
    fp8: Annotated[float | None, _f("FLOP/s", "fp8 matmuls", default=None, gt=0, le=1e18)]


class GroupCounts(_Fields):
    nodes: Annotated[int, _f("count", "nodes in the group", gt=0, le=MAX_DEVICES)]
    devices_per_node: Annotated[int, _f("count", "devices (JAX devices: an MI250X is two) per node", gt=0, le=MAX_DEVICES)]

    @model_validator(mode="after")
    def _size(self) -> "GroupCounts":
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise ValueError(
                f"the group has {self.nodes} x {self.devices_per_node} devices, more than the {MAX_DEVICES} "
                "hetpar plans over; check nodes and devices_per_node"
            )
        return self


class GroupFields(GroupCounts):
    """An entry of `groups:`. Every figure past `inter_node` overrides the device
    type's catalog entry for this group alone."""

    name: str | None = _f("-", "the group's label (default: the device type)", default=None)
    device: str = _f("-", "a device type from `hetpar devices`", default="")
    intra_node: LinkFields | None = _f("mapping", "the link between a node's devices (default: the type's catalog link)",
                                       default=None)
    inter_node: LinkFields | None = _f("mapping", "the network between the group's nodes (needed when nodes > 1)",
                                       default=None)
    nics_per_node: Annotated[int, _f("count", "NICs a node's devices share to reach other nodes: flows leaving a node "
                                     "at once divide them (default 1)", default=1, gt=0, le=MAX_DEVICES)]
    peer_to_peer: bool = _f("true/false", "a node's devices copy to each other directly; false: every copy is staged "
                            "through host memory at host_bandwidth", default=True)
    host_bandwidth: Annotated[float | None, _f("bytes/s", "what a node's host memory moves for copies staged through it, "
                                               "all its devices together (default 25e9, one PCIe 4.0 x16 root)",
                                               default=None, gt=0, le=1e15)]
    memory_gib: Annotated[float | None, _f("GiB", "device memory", default=None, gt=0, le=1e6)]
    host_memory_gib: Annotated[float | None, _f("GiB", "host memory per node that offloaded optimizer state may fill "
                                                "(default: unknown, so the planner offloads nothing there)",
                                                default=None, gt=0, le=1e9)]
    nvme_gib: Annotated[float | None, _f("GiB", "local NVMe disk per node that NVMe-tier optimizer state may fill "
                                         "(default: none, so the planner keeps nothing on disk there)",
                                         default=None, gt=0, le=1e9)]
    nvme_gib_s: Annotated[float | None, _f("GiB/s", "what a node's NVMe disk reads or writes, all its devices "
                                           "together (default 3, a PCIe 4.0 NVMe drive's sustained rate)",
                                           default=None, gt=0, le=1e6)]
    memory_bandwidth: Annotated[float | None, _f("bytes/s", "device memory bandwidth", default=None, gt=0, le=1e15)]
    flops: FlopsFields | None = _f("mapping", "peak dense FLOP/s per dtype (keys below)", default=None)
    efficiency: Annotated[float | None, _f("fraction", "of peak that large matmuls reach", default=None, gt=0, le=1)]
    memory_fraction: Annotated[float | None, _f("fraction", "of device memory the JAX client takes (default: "
                                                "XLA_PYTHON_CLIENT_MEM_FRACTION from the environment, 0.75 on GPU if unset)",
                                                default=None, gt=0, le=1)]
    process_reserve_gib: Annotated[float | None, _f("GiB", "what one process keeps of that share beside its arrays "
                                                    "(runtime context, library workspaces; catalog: 1 on GPUs)",
                                                    default=None, ge=0, le=1e6)]


class ClusterFields(_Fields):
    """The file's top level."""

    name: str | None = _f("-", "the cluster's name (default: the file's stem)", default=None)
    groups: list[GroupFields] = _f("list", "node groups, each of one device type", default_factory=list)
    links: list[BetweenFields] = _f("list", "one entry per pair of groups", default_factory=list)


# Where each model's fields sit in a file, for the README's table.
SECTIONS = (("", ClusterFields), ("groups[]", GroupFields), ("groups[].flops", FlopsFields),
            ("groups[].intra_node / inter_node", LinkFields),
            ("groups[].intra_node / inter_node.in_network_reduction", ReductionFields), ("links[]", BetweenFields))


def fields_table() -> str:
    """The README's table of every cluster-file field, with its unit, from the models
    above (`scripts/cluster_fields.py` prints it; a test checks the README has it)."""
    rows = ["| field | unit | meaning |", "|---|---|---|"]
    for prefix, model in SECTIONS:
        for key, info in model.model_fields.items():
            unit = (info.json_schema_extra or {}).get("unit", "-")
            where = f"{prefix}.{key}" if prefix else key
            rows.append(f"| `{where}` | {unit} | {info.description or ''} |")
    return "\n".join(rows)


def validated(model: type[BaseModel], values: dict[str, Any]) -> tuple[BaseModel | None, str | None, str | None]:
    """(model, None, None), or (None, the field at fault or None, a one-line message)."""
    try:
        return model(**values), None, None
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = str(first["loc"][0]) if first["loc"] else None
        got = first.get("input")
        shown = f", got {str(got)[:40]}" if field and not isinstance(got, dict) else ""
        return None, field, f"{field + ' ' if field else ''}{_plain(first)}{shown}"


def _plain(error: dict) -> str:
    """pydantic's message in the words of the rest of hetpar's messages."""
    ctx, kind = error.get("ctx") or {}, error["type"]
    if kind == "greater_than":
        return "must be positive" if ctx.get("gt") == 0 else f"must be greater than {ctx.get('gt')}"
    if kind == "greater_than_equal":
        return "must not be negative" if ctx.get("ge") == 0 else f"must be at least {ctx.get('ge')}"
    if kind in ("less_than_equal", "less_than"):
        return f"must be at most {ctx.get('le', ctx.get('lt'))}"
    if kind == "finite_number":
        return "must be a finite number (not NaN or infinity)"
    if kind in ("int_parsing", "int_from_float", "int_type"):
        return "must be an integer"
    if kind in ("float_parsing", "float_type"):
        return "must be a number"
    return str(error["msg"]).removeprefix("Value error, ")
