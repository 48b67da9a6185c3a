"""A device that fails inside a program stops its process in seconds, not a minute.

When one device of a mesh fails in the middle of a program (a host callback in the
user's step raises, say), the mesh's other devices wait at the program's next
collective for a partner that never comes. The caller never sees an exception: the
step's results are never ready. XLA:CPU gives up on such a wait only after warning
for 20 s and waiting 40 s more, then aborts the process (on purpose: after a
half-run collective no state of the process can be trusted).

hetpar shortens both waits when it is imported, before JAX starts its CPU client,
so that such a process aborts about `HETPAR_COLLECTIVE_TIMEOUT_S` seconds (8 by
default) after the failure, the failing device's error (the user's own traceback)
printed first; under `hetpar launch` the launcher then stops the job's other
processes and quotes those lines. A collective that legitimately waits longer (a
host callback that blocks for seconds on one device only) needs a larger value;
`HETPAR_COLLECTIVE_TIMEOUT_S=0` keeps XLA's own, and a timeout the user set in
`XLA_FLAGS` always wins. Imported after JAX's CPU client started, this does
nothing (XLA reads its flags once).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("hetpar.runtime")

ENV = "HETPAR_COLLECTIVE_TIMEOUT_S"
DEFAULT_S = 8.0
_WARN = "--xla_cpu_collective_call_warn_stuck_timeout_seconds"
_TERMINATE = "--xla_cpu_collective_call_terminate_timeout_seconds"


def collective_timeout_flags(xla_flags: str, setting: str | None) -> str:
    """`xla_flags` with XLA:CPU's stuck-collective timeouts set from `setting` (seconds
    in all: part warning, the rest waiting), unless the user set them there."""
    try:
        total = DEFAULT_S if setting is None or not setting.strip() else float(setting)
    except ValueError:
        log.warning("hetpar: %s=%r is not a number of seconds; keeping %.0f s", ENV, setting, DEFAULT_S)
        total = DEFAULT_S
    if not total > 0:
        return xla_flags
    warn = max(1, round(total * 3 / 8))
    flags = xla_flags.split()
    added = [f"{name}={value}" for name, value in ((_WARN, warn), (_TERMINATE, max(1, round(total) - warn)))
             if not any(f.startswith(name + "=") for f in flags)]
    return " ".join(flags + added)


def shorten_collective_timeouts() -> None:
    """Sets the flags in this process's environment (its children inherit them)."""
    os.environ["XLA_FLAGS"] = collective_timeout_flags(os.environ.get("XLA_FLAGS", ""), os.environ.get(ENV))
