"""One identity for a multi-process run: every process must run the same plan on
the same step with the same closed-over values, or the job trains something no one
asked for without a word (two processes with plan files a few percent apart, or
with different learning rates, each compute their own half of a different step).

Before the first step every process hashes what it is about to run, field by
field, and every process learns every other's hashes; any difference stops all of
them with the same one line: the first field that differs, on which process, and
the fix for that field.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json

import jax
import numpy as np

from hetpar.errors import HetparError
from hetpar.plan import Plan
from hetpar.plan.file import plan_to_dict
from hetpar.runtime.distributed import broadcast
from hetpar.trace.fingerprint import signature
from hetpar.trace.traced_step import TracedStep

DIGEST_CHARS = 16

# Field -> (what it is, the fix), in the order they are compared: the first that
# differs is the one reported, so causes come before their consequences.
FIELDS: dict[str, tuple[str, str]] = {
    "versions": ("hetpar and JAX versions", "install the same hetpar and JAX on every machine"),
    "arguments": ("argument shapes and dtypes",
                  "give every process the whole batch and state (the same shapes), not a per-process slice"),
    "step": ("traced step (its operators)", "run the same script and code version on every process"),
    "constants": ("values the step closes over (a learning rate, a schedule, an array)",
                  "start every process with the same settings: the step's constants must be equal"),
    "plan": ("plan", "give every process the same plan file, or leave plan= out so that process 0 solves "
                     "and shares its plan"),
}


def run_identity(plan: Plan, traced: TracedStep) -> dict[str, str]:
    """This process's hash of each field of FIELDS."""
    graph = traced.full
    sig = signature(graph)
    constants = hashlib.sha256()
    for value in sorted(graph.constants):
        constant = graph.constants[value]
        if isinstance(constant, jax.Array) and jax.dtypes.issubdtype(constant.dtype, jax.dtypes.prng_key):
            constant = jax.random.key_data(constant)
        array = np.asarray(constant)
        constants.update(f"{value}:{array.dtype}{array.shape}".encode())
        constants.update(np.ascontiguousarray(array).tobytes())
    return {
        "versions": _digest(f"{_version('hetpar')} {jax.__version__}"),
        "arguments": _digest(";".join(sig.inputs)),
        "step": _digest(f"{sig.digest} {';'.join(sig.outputs)}"),
        "constants": constants.hexdigest()[:DIGEST_CHARS],
        "plan": _digest(json.dumps(plan_to_dict(plan), sort_keys=True, default=str)),
    }


def check_same_run(identity: dict[str, str]) -> None:
    """Every process calls this with its own identity; all return, or all raise the
    same HetparError naming the first field and process that differ from process 0."""
    mine = np.frombuffer("".join(identity[f] for f in FIELDS).encode(), np.uint8)
    every = [broadcast(mine.copy(), p) for p in range(jax.process_count())]
    first = _split(every[0])
    for process, raw in enumerate(every[1:], start=1):
        theirs = _split(raw)
        for field, (what, fix) in FIELDS.items():
            if theirs[field] != first[field]:
                raise HetparError(f"process {process} is not running what process 0 runs: its {what} differ(s) "
                                  f"from process 0's; {fix}. No step was run.")


def _split(raw: np.ndarray) -> dict[str, str]:
    text = raw.tobytes().decode()
    return {f: text[i * DIGEST_CHARS:(i + 1) * DIGEST_CHARS] for i, f in enumerate(FIELDS)}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
