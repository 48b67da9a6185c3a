"""How XLA groups a program's operators into kernels and buffers: the one place the
time model (hetpar.predict.programs) and the memory models of recomputation
(hetpar.trace.layers) look up what fuses.

Two questions with different answers, asked of the same operators:

- Time: which operators run as kernels of their own (`own_kernel`): matmuls,
  reductions, gathers and scatters, and transposes (strided copies). Everything else,
  transcendentals included, runs inside a fusion and costs only the buffers the
  fusion reads and writes.
- Memory: which results XLA recomputes inside each fusion that reads them rather
  than keeping a buffer (`FUSED_INTO_READERS`): cheap elementwise arithmetic and
  layout changes. A transcendental fuses into its reader too, but XLA does not
  duplicate one into several readers, so its result is kept; so is anything a matmul
  reads (no elementwise work fuses into a matmul's operands).
"""

from __future__ import annotations

from hetpar.trace.flops import MATMUL_OPS

# Results recomputed inside every fusion that reads them instead of kept in a buffer.
FUSED_INTO_READERS = frozenset({
    "add", "add_any", "sub", "mul", "neg", "max", "min", "abs", "sign", "square", "integer_pow",
    "one_minus_square", "select_n", "clamp", "convert_element_type", "stop_gradient",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "split", "slice", "copy", "copy_p",
})

# Operators XLA runs as kernels of their own, with their results in memory.
_UNFUSED = frozenset({"gather", "scatter-add", "scatter_add", "argmax", "cumsum"})
# Transposes run as strided copies of their own but rarely keep a buffer alive: they
# cost time as a kernel, not memory.
_OWN_KERNEL = frozenset({"transpose"})


def materialized(name: str) -> bool:
    """A kernel of its own whose result is written to memory."""
    return name in MATMUL_OPS or name.startswith("reduce") or name in _UNFUSED


def own_kernel(name: str) -> bool:
    """A kernel of its own (a transpose too), outside any fusion."""
    return materialized(name) or name in _OWN_KERNEL
