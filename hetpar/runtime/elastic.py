"""`hetpar launch --elastic`: lose a host, plan again for what is left, resume.

A job of several processes cannot finish a step without one of them, so when one
is lost the launcher stops the rest (as any launch does), takes the lost process's
node out of the cluster file, and starts the command again on the nodes that are
left. The script does the rest with what hetpar already has: it reads the cluster
it was started on (`hetpar.launched_cluster`), which the planner plans for in
seconds, and restores its latest checkpoint (`hetpar.latest_checkpoint`), which any
plan places. What is lost is the work since that checkpoint.

A process that *ended with an error* is not a lost node: its node stays, and the
job is started again on the same cluster (a transient fault), until the restarts
run out; an error that comes back every time then stops the job with its message.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import yaml

from hetpar.cluster.cluster import Cluster
from hetpar.errors import HetparError
from hetpar.runtime.launcher import ProcessFailed, ProcessSpec, launch_local

log = logging.getLogger("hetpar.launch")

ENV_RESTART = "HETPAR_RESTART"  # how many times the job was started again (0 the first time)


def launch_elastic(cluster_file: str | Path, command: Sequence[str], max_restarts: int = 3,
                   timeout_s: float | None = None, port: int | None = None,
                   collective_env: Mapping[str, str] | None = None) -> int:
    """Runs the job, starting it again after each failure (without a lost node's
    process if one was lost) up to `max_restarts` times. Returns how many restarts
    it took; raises the last failure when they run out or no node is left."""
    path = Path(cluster_file)
    folder = Path(tempfile.mkdtemp(prefix="hetpar-elastic-"))
    for restart in range(max_restarts + 1):
        cluster = Cluster.from_file(str(path))
        env = dict(os.environ, **{ENV_RESTART: str(restart)})
        try:
            launch_local(cluster, command, timeout_s=timeout_s, env=env, port=port, cluster_file=str(path),
                         collective_env=collective_env)
            return restart
        except ProcessFailed as failure:
            if restart == max_restarts:
                raise HetparError(f"{failure} The job failed {restart + 1} times; no restarts left "
                                  "(--max-restarts)") from None
            if failure.lost:
                smaller = folder / f"cluster-{restart + 1}.yaml"
                if not without_node(path, failure.spec, smaller):
                    raise HetparError(f"{failure} No node is left to continue on.") from None
                path = smaller
                log.warning("hetpar launch: %s\nhetpar launch: starting again without that node: %s "
                            "(restart %d of at most %d)", failure, Cluster.from_file(str(path)).describe(),
                            restart + 1, max_restarts)
            else:
                log.warning("hetpar launch: %s\nhetpar launch: starting again on the same nodes "
                            "(restart %d of at most %d)", failure, restart + 1, max_restarts)
    raise AssertionError("unreachable")


def without_node(cluster_file: Path, spec: ProcessSpec, out: Path) -> bool:
    """Writes `cluster_file` less the node of `spec` to `out` (a group left with no
    node goes, with its links); False if no node would be left."""
    doc = yaml.safe_load(cluster_file.read_text())
    groups = doc["groups"]
    group = next(g for g in groups if g.get("name", g.get("device")) == spec.group)
    group["nodes"] = int(group.get("nodes", 1)) - 1
    if group["nodes"] == 0:
        groups.remove(group)
        doc["links"] = [link for link in doc.get("links") or [] if spec.group not in link.get("between", ())]
        if not doc["links"]:
            doc.pop("links")
    if not groups:
        return False
    doc["name"] = f"{doc.get('name', cluster_file.stem)}-without-{spec.group}-{spec.node}"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return True
