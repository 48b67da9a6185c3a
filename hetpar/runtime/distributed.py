"""The multi-controller runtime: one process per host on `jax.distributed`.

Every process runs the user's script (JAX's convention for many hosts), gets the
same plan (process 0 makes it and broadcasts it: the planner has wall-clock limits,
so independent solves could differ), builds the same global stage meshes from the
cluster's device positions, and runs the one interpreter (runtime/interpreter.py) over
the same device transport as one process (runtime/executor.py): each jitted
stage program runs on the processes that own devices in its mesh (the others do not
dispatch it: they make placeholder outputs with no local shards, remote.py), and
values move between stage meshes with `jax.device_put` across processes (JAX's
cross-host transfers). Parameters and optimizer state stay on their stage's devices
between steps; nothing passes through a driver.

On CPU, collectives across processes need gloo, and with gloo XLA runs every
collective over it, also those among one process's own devices: about 10 ms per
all-reduce on loopback against under 1 ms in-process, which made a 2-stage GPT step
2.4-4x slower over two processes than in one (README, "Many processes"). So when no
stage mesh spans processes (`hetpar launch` knows from the cluster file: one node
per group), the job runs with XLA's in-process collectives ("local"), and the few
values every process must agree on (the plan, `to_host`) travel by transfer.

`initialize()` reads what `hetpar launch` (hetpar/runtime/launcher.py) puts in the
environment. Each process also keeps a small status file (its stages, its step, its
error) that the launcher reads to name the process and stage when one fails.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetpar.cluster.cluster import Cluster
from hetpar.compile.compiled import CompiledStep
from hetpar.errors import HetparError, PlanError
from hetpar.plan import Plan
from hetpar.plan.file import plan_from_dict, plan_to_dict
from hetpar.runtime.communicator import check_host_staged
from hetpar.runtime.executor import RunStats, StateCopies, run
from hetpar.runtime.remote import has_local_devices, placeholder, skipped

log = logging.getLogger("hetpar.distributed")

# What `hetpar launch` tells each process (one name per fact, all strings).
ENV_COORDINATOR = "HETPAR_COORDINATOR"  # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "HETPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "HETPAR_PROCESS_ID"
ENV_TRANSFER_ADDRESS = "HETPAR_TRANSFER_ADDRESS"  # host:port this process serves cross-host transfers on
ENV_CPU_DEVICES = "HETPAR_CPU_DEVICES"  # on CPU: this process's number of virtual devices
ENV_STATUS_DIR = "HETPAR_STATUS_DIR"  # where each process writes process-<i>.json for the launcher
ENV_HEARTBEAT_S = "HETPAR_HEARTBEAT_TIMEOUT_S"  # jax.distributed's heartbeat timeout (default 30)
# On CPU: "gloo" (collectives across processes) or "local" (each process's collectives
# in-process; no stage mesh may span processes). Default gloo; `hetpar launch` sets it.
ENV_CPU_COLLECTIVES = "HETPAR_CPU_COLLECTIVES"
CPU_COLLECTIVES = ("gloo", "local")
ENV_CLUSTER_FILE = "HETPAR_CLUSTER_FILE"  # the cluster file the launcher started this job on


@dataclass(frozen=True)
class ProcessInfo:
    process_id: int
    num_processes: int


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None,
    transfer_address: str | None = None, cpu_devices: int | None = None, cpu_collectives: str | None = None,
) -> ProcessInfo:
    """Joins this process to the job, before any JAX computation: from the arguments,
    else from what `hetpar launch` set in the environment; without either, JAX's own
    auto-detection (SLURM, cloud TPU) is tried when the environment looks like one,
    and otherwise the process runs alone. Call it at the top of the training script.

    `cpu_collectives` (CPU only): "gloo", the default, runs collectives over TCP
    between processes, and then also between the devices of one process; "local"
    keeps XLA's in-process collectives, an order of magnitude faster per all-reduce
    (README, "Many processes"), for jobs where every stage mesh lies in one process."""
    env = os.environ
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _int_env(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _int_env(ENV_PROCESS_ID)
    transfer_address = transfer_address or env.get(ENV_TRANSFER_ADDRESS)
    cpu_devices = cpu_devices if cpu_devices is not None else _int_env(ENV_CPU_DEVICES)
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    cpu_collectives = cpu_collectives or env.get(ENV_CPU_COLLECTIVES) or "gloo"
    if cpu_collectives not in CPU_COLLECTIVES:
        raise HetparError(f"cpu_collectives ({ENV_CPU_COLLECTIVES}) must be one of {', '.join(CPU_COLLECTIVES)}, "
                          f"got {cpu_collectives!r}")
    if coordinator_address is None and "SLURM_JOB_ID" not in env:
        return ProcessInfo(0, 1)
    _check_job(coordinator_address, num_processes, process_id)
    jax.config.update("jax_cpu_collectives_implementation", "gloo" if cpu_collectives == "gloo" else None)
    if transfer_address:
        jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
    heartbeat = _int_env(ENV_HEARTBEAT_S) or 30
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, heartbeat_timeout_seconds=heartbeat, initialization_timeout=120,
                               shutdown_timeout_seconds=heartbeat)
    _report_uncaught()
    info = ProcessInfo(jax.process_index(), jax.process_count())
    log.info("process %d of %d joined; %d local devices of %d", info.process_id, info.num_processes,
             jax.local_device_count(), jax.device_count())
    return info


def _check_job(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """What jax.distributed would fail on obscurely (a raw ValueError, a hang, or a
    crash of its coordination service), said in one line first."""
    if num_processes is not None and num_processes < 1:
        raise HetparError(f"the number of processes ({ENV_NUM_PROCESSES}) must be at least 1, got {num_processes}")
    if process_id is not None and (process_id < 0 or (num_processes is not None and process_id >= num_processes)):
        raise HetparError(f"process id {process_id} ({ENV_PROCESS_ID}) is outside 0..{(num_processes or 1) - 1}: "
                          f"give each of the {num_processes} processes a distinct id from 0 (hetpar launch sets them)")
    if coordinator is None:
        return
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise HetparError(f"the coordinator address ({ENV_COORDINATOR}) must be host:port, got {coordinator!r}")
    if process_id == 0 and host in ("127.0.0.1", "localhost", socket.gethostname()):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed job's TIME_WAIT is not "in use"
            try:
                s.bind((host, int(port)))
            except OSError:
                raise HetparError(f"process 0 cannot serve the coordinator on {coordinator}: the port is in use by "
                                  "another program (a job still running?); choose another port") from None


def _report_uncaught() -> None:
    """An exception that ends the script (outside a step too) is written to the status
    file first: the launcher then stops the job at once, instead of waiting for this
    process's exit, which jax.distributed's shutdown barrier can hold up."""
    previous = sys.excepthook

    def hook(kind: type, error: BaseException, tb: Any) -> None:
        status = Status()
        if not status.read().get("error"):
            status.update(error=f"process {jax.process_index()} raised {kind.__name__}: {str(error).strip()[:300]}")
        previous(kind, error, tb)

    sys.excepthook = hook


def _int_env(name: str) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise HetparError(f"{name} must be an integer, got {text!r}; it is set by hetpar launch") from None


def launched_cluster(default: str | Path) -> Cluster:
    """The cluster this process's job was started on, bound to the job's devices: the
    file `hetpar launch` names (after an elastic restart, the nodes that are left),
    else `default`. Read it rather than a fixed path so a script survives a restart
    on fewer nodes."""
    return Cluster.from_file(os.environ.get(ENV_CLUSTER_FILE) or str(default)).bind()


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def cross_process_collectives() -> bool:
    """Whether one program may span processes' devices (always on accelerators;
    on CPU only with gloo, see `initialize`)."""
    return jax.default_backend() != "cpu" or jax.config.jax_cpu_collectives_implementation is not None


def share_plan(make: Callable[[], Plan]) -> Plan:
    """Process 0 makes the plan; every process gets that plan (as plan-file JSON over
    a broadcast), so all compile the same programs."""
    if not is_multiprocess():
        return make()
    payload = np.zeros((0,), np.uint8)
    if jax.process_index() == 0:
        payload = np.frombuffer(json.dumps(plan_to_dict(make())).encode(), np.uint8)
    size = int(broadcast(np.int32(payload.size), 0))
    padded = np.zeros((size,), np.uint8)
    padded[: payload.size] = payload
    data = broadcast(padded, 0)
    return plan_from_dict(json.loads(data.tobytes().decode()), where="plan from process 0")


def to_host(tree: Any) -> Any:
    """Every array of `tree` as a numpy array on every process (for logging, checks
    and checkpoints of small values). Each process must make the same call. A value
    on other processes' devices is made whole on its own mesh, read by the first
    process that holds it, and broadcast from there (`broadcast`). Typed PRNG keys
    come back as their key data."""
    if not is_multiprocess():
        return jax.device_get(tree)

    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return one(jax.random.key_data(x))
        owners = sorted({d.process_index for d in x.sharding.device_set})
        whole = replicate(x) if len(owners) > 1 else x
        here = jax.process_index()
        kind = np.uint8 if x.dtype == np.bool_ else x.dtype
        if here in owners:
            value = np.asarray(whole.addressable_data(0) if len(owners) > 1 else jax.device_get(whole)).astype(kind)
        else:
            value = np.zeros(x.shape, kind)
        return broadcast(value, owners[0]).astype(x.dtype)

    return jax.tree.map(one, tree)


def broadcast(value: np.ndarray, source: int) -> np.ndarray:
    """Process `source`'s `value` on every process (every process calls it with a
    value of the same shape and dtype). With cross-process collectives, a sum over a
    mesh of one device per process, to which the others add zeros
    (multihost_utils.broadcast_one_to_all assumes every process has as many devices;
    a cluster's hosts need not); without, one cross-process transfer per receiver."""
    value = np.asarray(value)
    mesh = _one_device_per_process()
    if not cross_process_collectives():
        return _broadcast_by_transfer(value, source, list(mesh.devices.flat))
    mine = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    local = value if jax.process_index() == source else np.zeros_like(value)
    kind = np.int32 if local.dtype == np.uint8 else local.dtype  # sum without overflow
    shard = jax.device_put(local.astype(kind)[None], mine)
    stacked = jax.make_array_from_single_device_arrays((mesh.size, *value.shape), NamedSharding(mesh, PartitionSpec("p")),
                                                       [shard])
    total = jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(mesh, PartitionSpec()))(stacked)
    return np.asarray(total.addressable_data(0)).astype(value.dtype)


def _broadcast_by_transfer(value: np.ndarray, source: int, devices: list[Any]) -> np.ndarray:
    """`broadcast` as device_puts from the source's first device to each other
    process's first device (every process makes every call, in one order)."""
    def on(device: Any) -> NamedSharding:
        return NamedSharding(Mesh(np.array([device]), ("p",)), PartitionSpec())

    here = jax.process_index()
    start = on(devices[source])
    if here == source:
        x = jax.device_put(value, start)
    else:
        x = placeholder(jax.ShapeDtypeStruct(value.shape, value.dtype), start)
    out = value
    for d in devices:
        if d.process_index != source:
            moved = jax.device_put(x, on(d))
            if d.process_index == here:
                out = np.asarray(moved.addressable_data(0))
    return out


def barrier() -> None:
    """Returns once every process has called it (each hears from every other)."""
    if not is_multiprocess():
        return
    for p in range(jax.process_count()):
        broadcast(np.int32(p), p)


def _one_device_per_process() -> Mesh:
    first: dict[int, Any] = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)
    return Mesh(np.array([first[p] for p in sorted(first)]), ("p",))


def replicate(x: jax.Array) -> jax.Array:
    """`x` whole on every device of its own mesh (a no-op if it already is): every
    process calls it; those without devices in the mesh do nothing."""
    if x.is_fully_replicated:
        return x
    sharding = x.sharding
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else Mesh(np.array(list(sharding.device_set)), ("d",))
    target = NamedSharding(mesh, PartitionSpec())
    return jax.jit(lambda v: v, out_shardings=target)(x)


def stages_of_process(plan: Plan, device_order: Sequence[Any], process: int) -> list[int]:
    """The stages with a device on `process` (device positions index `device_order`)."""
    return [s.index for s in plan.stages if any(device_order[p].process_index == process for p in s.device_ids)]


def check_cross_process(plan: Plan, device_order: Sequence[Any], collectives: bool = True) -> None:
    """Refuses a plan whose values could not cross between its stages: JAX moves a
    value between processes shard for shard, so stages in different processes need
    meshes of one size, unless each lies within one process (then a value crosses
    through one device: hetpar.runtime.communicator). Without cross-process
    collectives (`collectives` False), also one whose stage mesh spans processes."""
    owners = {s.index: {device_order[p].process_index for p in s.device_ids} for s in plan.stages}
    spanning = [s.index for s in plan.stages if len(owners[s.index]) > 1]
    if spanning and not collectives:
        raise PlanError(
            f"stage {spanning[0]} spans processes {sorted(owners[spanning[0]])}, but this job runs without cross-process "
            f"collectives on CPU ({ENV_CPU_COLLECTIVES}=local): start it with {ENV_CPU_COLLECTIVES}=gloo "
            "(hetpar launch picks gloo when a group has several nodes), or give each stage the devices of one process")
    for a in plan.stages:
        for b in plan.stages:
            if (a.index < b.index and owners[a.index] != owners[b.index] and len(a.device_ids) != len(b.device_ids)
                    and (a.index in spanning or b.index in spanning)):
                raise PlanError(
                    f"stages {a.index} and {b.index} run in different processes with meshes of different sizes "
                    f"({len(a.device_ids)} and {len(b.device_ids)} devices) and one of them spans processes: values cross between "
                    "such meshes shard for shard, so give them the same number of devices (equal devices_per_node in "
                    "the cluster file), or keep each stage within one process")


class Status:
    """This process's status file for the launcher: which stages it holds, which step
    it is on, and the error it stopped with. Written once per step, never per program."""

    def __init__(self) -> None:
        folder = os.environ.get(ENV_STATUS_DIR)
        self.path = Path(folder) / f"process-{jax.process_index()}.json" if folder else None
        self.fields: dict[str, Any] = {"process": jax.process_index()}

    def read(self) -> dict[str, Any]:
        return read_status(self.path.parent, jax.process_index()) if self.path else {}

    def update(self, **fields: Any) -> None:
        if self.path is None:
            return
        self.fields = {**self.read(), **self.fields, **fields}  # another Status of this process may have written
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.fields))
        tmp.replace(self.path)


def read_status(folder: str | Path, process: int) -> dict[str, Any]:
    """What process `process` last wrote (empty if nothing)."""
    try:
        return json.loads((Path(folder) / f"process-{process}.json").read_text())
    except (OSError, ValueError):
        return {}


class StageTracker:
    """Which stage program this process dispatched last, so an exception raised in a
    step names its stage. Wraps each program's callable; the interpreter is unchanged."""

    def __init__(self) -> None:
        self.current: tuple[int, str, int | None] | None = None

    def wrap(self, programs: list[Any]) -> list[Any]:
        return [None if p is None else replace(
            p, fn=self._tracked(p.fn, p.task.stage, p.task.kind),
            first=p.first and self._tracked(p.first, p.task.stage, p.task.kind)) for p in programs]

    def _tracked(self, fn: Callable, stage: int, kind: str) -> Callable:
        def call(*args: Any) -> Any:
            self.current = (stage, kind, None)
            return fn(*args)

        call.lower = getattr(fn, "lower", None)  # Program.lower still reaches the jitted function
        return call

    def describe(self) -> str:
        if self.current is None:
            return "before its first stage program"
        stage, kind, _ = self.current
        return f"in stage {stage} ({kind} program)"


class DistributedStep:
    """A compiled step run by every process of the job: the interpreter over the
    device transport, as in one process, with each failure turned into a HetparError naming this process and the stage.
    Programs whose mesh has none of this process's devices are not dispatched here:
    their outputs are placeholders (hetpar/runtime/remote.py), which is all this
    process needs to send to or receive from them."""

    def __init__(self, step: CompiledStep, stages: list[int]):
        if step.vendors:
            check_host_staged(step.vendors, jax.devices())
        self.tracker = StageTracker()
        programs = [p if p is None else self.tracker.wrap([p])[0] if has_local_devices(p.mesh.devices.flat) else replace(
            p, fn=skipped(p.fn), init_acc=p.init_acc and skipped(p.init_acc), finish=p.finish and skipped(p.finish),
            first=p.first and skipped(p.first))
            for p in step.programs]
        fused = {i: f if has_local_devices(f.mesh.devices.flat) else replace(f, fn=skipped(f.fn))
                 for i, f in step.fused.items()}
        self.step = replace(step, programs=programs, fused=fused)
        self.graph = step.graph
        self.status = Status()
        self.steps = 0
        self.status.update(stages=stages, step=0)
        self.kept = StateCopies()  # mixed stages' parts' and replicas' state copies between calls, as in one process

    def __call__(self, flat_args: Sequence[Any], stats: RunStats | None = None) -> list[Any]:
        self.steps += 1
        self.status.update(step=self.steps)
        self.tracker.current = None
        try:
            return run(self.step, flat_args, stats, kept=self.kept)
        except Exception as e:
            raise step_failure(e, self.tracker, self.status, self.steps) from e


def step_failure(error: BaseException, tracker: StageTracker, status: Status, step: int) -> HetparError:
    """The error a process raises (and records for the launcher) when its part of a
    step fails: it names the process, the stage and the cause."""
    where = tracker.describe()
    cause = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}".rstrip(": ")
    message = f"process {jax.process_index()} of {jax.process_count()} failed {where} during step {step}: {cause}"
    stage = tracker.current[0] if tracker.current else None
    status.update(error=message, failed_stage=stage)
    return HetparError(message)
