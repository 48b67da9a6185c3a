"""`hetpar launch --ray`: the job's processes placed by Ray on the machines of a Ray
cluster, one per node of the cluster file.

Ray only places and watches here; JAX does the computing and the transfers. Each
process is a Ray actor that reserves its node's accelerators (`num_gpus` =
`devices_per_node` for a GPU group, so Ray picks a machine that has them and sets
CUDA_VISIBLE_DEVICES) and starts the user's command there with the same
`jax.distributed` environment `hetpar launch` gives local processes. The launcher
polls every actor; a process that fails or a machine that disappears stops the
others, and the launch fails naming the process, its stages and the cause.
With `virtual=True` (tests, a CPU-only Ray cluster) processes reserve nothing and
get `devices_per_node` virtual CPU devices, labelled by the cluster file.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from typing import Any, Mapping, Sequence

from hetpar.cluster.catalog import device_type
from hetpar.cluster.cluster import Cluster
from hetpar.errors import HetparError
from hetpar.runtime import distributed as dist
from hetpar.runtime.launcher import ProcessSpec, collective_settings, describe_failure, free_ports, process_layout

log = logging.getLogger("hetpar.launch")


class HostProcess:
    """One process of the job, on the machine Ray placed this actor on."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.rank = 0
        self.status_dir = tempfile.mkdtemp(prefix="hetpar-launch-")

    def address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def ports(self, count: int) -> list[int]:
        return free_ports(count, host="0.0.0.0")

    def start(self, command: list[str], env: dict[str, str]) -> int:
        child_env = dict(os.environ)
        child_env.update(env)
        child_env[dist.ENV_STATUS_DIR] = self.status_dir
        self.child = subprocess.Popen(command, env=child_env, start_new_session=True)
        return self.child.pid

    def poll(self) -> tuple[int | None, dict[str, Any]]:
        code = self.child.poll() if self.child else None
        return code, dist.read_status(self.status_dir, self.rank)

    def set_rank(self, rank: int) -> None:
        self.rank = rank

    def stop(self, grace_s: float) -> None:
        if self.child is None or self.child.poll() is not None:
            return
        os.killpg(self.child.pid, signal.SIGTERM)
        try:
            self.child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait()


def _resources(spec: ProcessSpec, virtual: bool) -> dict[str, Any]:
    if virtual or device_type(spec.device_type).platform == "cpu":
        return {"num_cpus": 0}
    return {"num_cpus": 0, "num_gpus": spec.num_devices}


def launch_ray(cluster: Cluster, command: Sequence[str], address: str | None = None, virtual: bool = False,
               timeout_s: float | None = None, grace_s: float = 5.0,
               collective_env: Mapping[str, str] | None = None) -> None:
    """Runs `command` as one process per node of `cluster` on the Ray cluster at
    `address` (or a local one); returns when all exit 0, else raises HetparError.
    `collective_env`: the collective library's settings the plan needs (unless this
    process's environment sets them otherwise: `collective_settings`)."""
    import ray

    from hetpar.runtime.ray_runtime import init

    init(address)
    layout = process_layout(cluster)
    actor = ray.remote(max_restarts=0)(HostProcess)
    actors = [actor.options(**_resources(spec, virtual)).remote() for spec in layout]
    ray.get([a.set_rank.remote(spec.process_id) for a, spec in zip(actors, layout)])
    addresses = ray.get([a.address.remote() for a in actors])
    ports = ray.get([a.ports.remote(2) for a in actors])
    coordinator = f"{addresses[0]}:{ports[0][0]}"
    for spec, a, host, (_, transfer) in zip(layout, actors, addresses, ports):
        env = {
            dist.ENV_COORDINATOR: coordinator,
            dist.ENV_NUM_PROCESSES: str(len(layout)),
            dist.ENV_PROCESS_ID: str(spec.process_id),
            dist.ENV_TRANSFER_ADDRESS: f"{host}:{transfer}",
            **collective_settings(collective_env, os.environ),
        }
        if virtual or device_type(spec.device_type).platform == "cpu":
            env[dist.ENV_CPU_DEVICES] = str(spec.num_devices)
            env["JAX_PLATFORMS"] = "cpu"
        ray.get(a.start.remote(list(command), env))
    log.info("launched %d processes on Ray (coordinator %s)", len(actors), coordinator)
    try:
        _watch(actors, layout, timeout_s, grace_s)
    finally:
        for a in actors:
            ray.kill(a)


def _watch(actors: list[Any], layout: list[ProcessSpec], timeout_s: float | None, grace_s: float) -> None:
    import ray

    start = time.monotonic()
    while True:
        states: list[tuple[int | None, dict] | None] = []
        for a in actors:
            try:
                states.append(ray.get(a.poll.remote(), timeout=60))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                states.append(None)  # the actor (its machine) is gone or stuck
        codes = [s[0] if s else -signal.SIGKILL for s in states]
        if all(code == 0 for code in codes):
            return
        failed = next((i for i, s in enumerate(states) if s is None or s[0] not in (None, 0) or s[1].get("error")), None)
        if failed is not None:
            _stop(actors, grace_s)
            status = states[failed][1] if states[failed] else {}
            lost = " (its Ray actor or machine was lost)" if states[failed] is None else ""
            raise HetparError(describe_failure(failed, codes[failed] if states[failed] else None, layout, status,
                                                len(actors)) + lost)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            _stop(actors, grace_s)
            raise HetparError(f"the job did not finish within {timeout_s:.0f} s; all {len(actors)} processes were stopped")
        time.sleep(0.5)


def _stop(actors: list[Any], grace_s: float) -> None:
    import ray

    calls = [a.stop.remote(grace_s) for a in actors]
    for call in calls:
        try:
            ray.get(call, timeout=grace_s + 30)
        except Exception:  # an actor already gone: ray.kill below ends what is left
            pass
