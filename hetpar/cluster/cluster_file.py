"""Cluster files (YAML): node groups, their links, and the links between groups.

    name: two-types
    groups:
      - name: fast
        device: A100            # a type from `hetpar devices`
        nodes: 4
        devices_per_node: 8
        intra_node: {bandwidth: 300e9, latency: 3e-6}   # optional: the type's usual link
        inter_node:                                     # needed when nodes > 1
          bandwidth: 25e9
          latency: 5e-6
          in_network_reduction: {switch_levels: 2, latency: 0.6e-6}   # optional: the switches sum (SHARP)
        nics_per_node: 8          # one 200 Gb/s NIC per GPU (default 1: the node's devices share one)
      - name: slow
        device: V100
        nodes: 4
        devices_per_node: 8
        inter_node: {bandwidth: 12.5e9, latency: 5e-6}
        memory_gib: 16            # any catalog figure, for this group alone (V100 16GB boards)
        memory_fraction: 0.9      # the JAX client's share (else XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75)
    links:                        # every pair of groups: a pipeline may put them side by side
      - between: [fast, slow]
        bandwidth: 12.5e9
        latency: 10e-6
        direct: false             # true: device to device (RDMA); false: through the hosts

Every field, with its unit, is in the README's table (`schema.fields_table`).
Every mistake is reported with its line, so a user can fix the file without reading
hetpar's code.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import yaml

from hetpar.cluster.catalog import Link, catalog
from hetpar.cluster.groups import HOST_LINK, NVME_BANDWIDTH, DeviceGroup, DeviceOverrides, GroupLink
from hetpar.cluster.schema import FlopsFields, GroupFields, LinkFields, ReductionFields, validated
from hetpar.errors import ClusterError
from solver.collectives import SwitchReduction


class _Located:
    """A YAML mapping or value with its source line, for messages."""

    def __init__(self, node: yaml.Node, path: str):
        self.node, self.path = node, path

    @property
    def line(self) -> int:
        return self.node.start_mark.line + 1

    def fail(self, message: str) -> ClusterError:
        return ClusterError(f"{self.path} line {self.line}: {message}")

    def mapping(self, what: str) -> dict[str, "_Located"]:
        if not isinstance(self.node, yaml.MappingNode):
            raise self.fail(f"{what} must be a mapping (key: value lines)")
        out: dict[str, _Located] = {}
        for k, v in self.node.value:
            key = _Located(k, self.path)
            if not isinstance(k, yaml.ScalarNode):
                raise key.fail(f"keys of {what} must be plain names, not lists or mappings")
            if k.value in out:  # YAML would keep the last silently
                raise key.fail(f"{what} has key {k.value!r} twice; keep one")
            out[k.value] = _Located(v, self.path)
        return out

    def sequence(self, what: str) -> list["_Located"]:
        if not isinstance(self.node, yaml.SequenceNode):
            raise self.fail(f"{what} must be a list (lines starting with '-')")
        return [_Located(v, self.path) for v in self.node.value]

    def text(self, what: str) -> str:
        if not isinstance(self.node, yaml.ScalarNode) or self.node.value == "":
            raise self.fail(f"{what} must be a single value")
        return str(self.node.value)


def read_cluster_file(path: str | Path) -> tuple[tuple[DeviceGroup, ...], dict[frozenset, GroupLink], str]:
    """A cluster file's groups, links between groups and name, each checked, for
    `Cluster.from_file` to assemble."""
    path = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ClusterError(f"cannot read cluster file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ClusterError(f"{path} is not a text (UTF-8) file; a cluster file is YAML (see examples/clusters/)") from None
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ClusterError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if root is None:
        raise ClusterError(f"{path}: the file is empty; it needs a 'groups:' list")
    top = _Located(root, path).mapping("the cluster file")
    _no_unknown_keys(top, {"name", "groups", "links"}, _Located(root, path))
    if "groups" not in top:
        raise _Located(root, path).fail("missing 'groups:' (a list of node groups)")
    groups = [_group(g) for g in top["groups"].sequence("groups")]
    if not groups:
        raise top["groups"].fail("'groups' is empty; describe at least one node group")
    labels = [g.label for g in groups]
    for label in labels:
        if labels.count(label) > 1:
            raise top["groups"].fail(f"two groups are named {label!r}; group names must differ")
    links = _links(top.get("links"), {g.label: g.spec.vendor for g in groups}, _Located(root, path))
    name = top["name"].text("name") if "name" in top else Path(path).stem
    return tuple(groups), links, name


def _check(model: type, values: dict, fields: dict[str, _Located], loc: _Located, what: str):  # noqa: ANN202
    """Types and ranges from hetpar/cluster/schema.py, reported at the field's line."""
    checked, field, message = validated(model, values)
    if checked is None:
        raise (fields[field] if field in fields else loc).fail(f"{what} {message}".strip())
    return checked


def _no_unknown_keys(fields: dict[str, _Located], allowed: set[str], where: _Located) -> None:
    for key, value in fields.items():
        if key not in allowed:
            raise value.fail(f"unknown key {key!r}; expected one of: {', '.join(sorted(allowed))}")


def _link(loc: _Located, what: str, other_keys: frozenset = frozenset()) -> Link:
    fields = loc.mapping(what)
    if "in_network_reduction" in fields and what not in ("intra_node", "inter_node"):
        raise fields["in_network_reduction"].fail(
            "in_network_reduction belongs to the fabric whose switches sum: put it under a group's inter_node: "
            "(InfiniBand SHARP) or intra_node: (NVLink SHARP), not on a link between groups")
    reducing = {"in_network_reduction"} if what in ("intra_node", "inter_node") else set()
    _no_unknown_keys(fields, {"bandwidth", "latency", "name", "overlap"} | reducing | other_keys, loc)
    for key in ("bandwidth", "latency"):
        if key not in fields:
            raise loc.fail(f"{what} needs '{key}:' ({'bytes/s' if key == 'bandwidth' else 'seconds'})")
    given = [k for k in ("bandwidth", "latency", "overlap") if k in fields]
    link = _check(LinkFields, {k: fields[k].text(k) for k in given}, fields, loc, what)
    reduction = _reduction(fields["in_network_reduction"], what, link.bandwidth) if "in_network_reduction" in fields else None
    return Link(fields["name"].text("name") if "name" in fields else what, link.bandwidth, link.latency, link.overlap,
                reduction)


def _reduction(loc: _Located, what: str, link_bandwidth: float) -> SwitchReduction:
    """A link's `in_network_reduction:` (hetpar/cluster/schema.py's ReductionFields)."""
    where = f"{what}.in_network_reduction"
    fields = loc.mapping(where)
    _no_unknown_keys(fields, set(ReductionFields.model_fields), loc)
    for key, unit in (("switch_levels", "how many levels of switches a reduction climbs, e.g. 2"),
                      ("latency", "seconds per switch level, e.g. 0.6e-6")):
        if key not in fields:
            raise loc.fail(f"{where} needs '{key}:' ({unit})")
    checked = _check(ReductionFields, {k: v.text(k) for k, v in fields.items()}, fields, loc, where)
    return SwitchReduction(checked.switch_levels, checked.bandwidth or link_bandwidth, checked.latency,
                           checked.max_message_bytes or 0.0)


# A group's single values, checked by schema.GroupFields; its mappings are read apart.
_GROUP_SCALARS = ("nodes", "devices_per_node", "nics_per_node", "peer_to_peer", "host_bandwidth", "host_memory_gib", "nvme_gib", "nvme_gib_s", "memory_gib",
                  "memory_bandwidth", "efficiency", "memory_fraction", "process_reserve_gib")
_GROUP_KEYS = {"name", "device", "intra_node", "inter_node", "flops", *_GROUP_SCALARS}


def _group(loc: _Located) -> DeviceGroup:
    fields = loc.mapping("a group")
    _no_unknown_keys(fields, _GROUP_KEYS, loc)
    if "device" not in fields:
        raise loc.fail("the group needs 'device:' (a device type; `hetpar devices` lists them)")
    device = fields["device"].text("device")
    if device not in catalog():
        raise fields["device"].fail(f"unknown device type {device!r}; known types: {', '.join(sorted(catalog()))}")
    for key in ("nodes", "devices_per_node"):
        if key not in fields:
            raise loc.fail(f"the group needs '{key}:'")
    group = _check(GroupFields, {k: fields[k].text(k) for k in _GROUP_SCALARS if k in fields}, fields, loc, "")
    nodes, per_node = group.nodes, group.devices_per_node
    if nodes > 1 and "inter_node" not in fields:
        raise loc.fail(f"a group of {nodes} nodes needs 'inter_node:' (the network between its nodes)")
    flops = ()
    if "flops" in fields:
        rates = fields["flops"].mapping("flops")
        _no_unknown_keys(rates, set(FlopsFields.model_fields), fields["flops"])
        checked = _check(FlopsFields, {k: v.text(k) for k, v in rates.items()}, rates, fields["flops"], "flops")
        flops = tuple((k, v) for k, v in checked.model_dump().items() if v is not None)
    gib = 2**30
    overrides = DeviceOverrides(
        memory_bytes=int(group.memory_gib * gib) if group.memory_gib is not None else None,
        peak_flops=flops,
        memory_bandwidth=group.memory_bandwidth,
        efficiency=group.efficiency,
        process_reserve_bytes=group.process_reserve_gib * gib if group.process_reserve_gib is not None else None,
        memory_fraction=group.memory_fraction,
    )
    return DeviceGroup(
        device,
        name=fields["name"].text("name") if "name" in fields else device,
        nodes=nodes,
        devices_per_node=per_node,
        intra_node=_link(fields["intra_node"], "intra_node") if "intra_node" in fields else None,
        inter_node=_link(fields["inter_node"], "inter_node") if "inter_node" in fields else None,
        overrides=overrides,
        nics_per_node=group.nics_per_node,
        peer_to_peer=group.peer_to_peer,
        host_bandwidth=group.host_bandwidth if group.host_bandwidth is not None else HOST_LINK.bandwidth,
        host_memory_bytes=group.host_memory_gib * gib if group.host_memory_gib is not None else 0.0,
        nvme_bytes=group.nvme_gib * gib if group.nvme_gib is not None else 0.0,
        nvme_bandwidth=group.nvme_gib_s * gib if group.nvme_gib_s is not None else NVME_BANDWIDTH,
    )


def _links(loc: _Located | None, vendors: dict[str, str], root: _Located) -> dict[frozenset, GroupLink]:
    """The links between groups (`vendors`: each group's vendor, by label)."""
    labels = list(vendors)
    links: dict[frozenset, GroupLink] = {}
    for entry in loc.sequence("links") if loc is not None else []:
        fields = entry.mapping("a link")
        if "between" not in fields:
            raise entry.fail("the link needs 'between: [group, group]'")
        ends = [e.text("a group name") for e in fields["between"].sequence("between")]
        if len(ends) != 2 or ends[0] == ends[1]:
            raise fields["between"].fail("'between' names two different groups")
        for end in ends:
            if end not in labels:
                raise fields["between"].fail(f"no group is named {end!r}; groups: {', '.join(labels)}")
        direct = fields["direct"].text("direct").lower() in ("true", "yes", "1") if "direct" in fields else False
        if direct and vendors[ends[0]] != vendors[ends[1]]:
            raise fields["direct"].fail(
                f"'direct: true' between {ends[0]!r} ({vendors[ends[0]]}) and {ends[1]!r} ({vendors[ends[1]]}): no device "
                "link joins two vendors' devices (NVLink, Infinity Fabric and RDMA to device memory stay within one), "
                "so their values go through both hosts; remove 'direct'")
        link = _link(entry, "link", frozenset({"between", "direct"}))
        if frozenset(ends) in links:
            raise fields["between"].fail(f"a second link between {ends[0]!r} and {ends[1]!r}; keep one")
        links[frozenset(ends)] = GroupLink(Link(f"{ends[0]}<->{ends[1]}", link.bandwidth, link.latency, link.overlaps), direct)
    for a, b in combinations(labels, 2):
        if frozenset((a, b)) not in links:
            where = loc if loc is not None else root
            raise where.fail(
                f"no link between groups {a!r} and {b!r}; a pipeline may place them side by side, "
                f"so add '- between: [{a}, {b}]' with bandwidth and latency under 'links:'"
            )
    return links
