"""Work that must see the whole batch at once, done once before the microbatches.

Two kinds of operators give a different answer when run per microbatch, yet are
exactly computable before any microbatch runs, because they do not depend on the
parameters:

* Random bits shaped by the batch (dropout masks, per-example keys). Run on a
  microbatch-shaped trace, `random_bits` would draw the bits of the *first* slice
  of the full-size draw for every microbatch (the key is the same), so every
  microbatch would reuse one mask. With threefry (JAX's default, and also with
  `jax_threefry_partitionable` on or off) the bits of a full-size draw are a
  function of the key and of each element's position in the full shape. Rather
  than re-derive that counter layout (which differs between the partitionable and
  the legacy mode and is not public API), hetpar draws the bits once at the full
  batch shape, exactly as `jax.jit(step)` does, and hands each microbatch its
  slice. Exact by construction for any PRNG implementation, at the cost of holding
  one full-batch bit array per random call during the step.
* Batch-wide reductions of batch inputs alone, such as the token count
  `sum(mask)` of a padding-masked mean loss. They are computed over the full batch
  and read by every microbatch as a constant, so `sum(ce * mask) / sum(mask)` is
  exact however the padding falls across microbatches.

Both run in the "pre" phase on the full-batch trace; their outputs that carry the
batch dimension are "sliced" values: each microbatch reads its slice.
"""

from __future__ import annotations

from hetpar.trace.opgraph import OpGraph

# Primitives that draw random bits from a key: their outputs depend on the shape drawn.
RANDOM_PRIMITIVES = frozenset({
    "random_bits", "random_split", "threefry2x32", "rng_bit_generator", "rng_uniform",
})


def whole_batch_ops(graph: OpGraph, batch_axis: dict[int, int], batch_invars: list[int]) -> set[int]:
    """The operators to run once over the whole batch (see the module docstring)."""
    invars = set(graph.invars)
    batch = set(batch_invars)
    batch_dependent = set(batch)
    batch_only = set(batch)  # values computed from batch inputs and constants alone
    free = set(graph.constants)  # values computed from no input at all
    seeds: set[int] = set()
    for op in graph.ops:
        ins = op.inputs
        depends = any(v in batch_dependent for v in ins)
        if not depends and op.name in RANDOM_PRIMITIVES and any(v in batch_axis for v in op.outputs):
            seeds.add(op.index)
        if all(v in free for v in ins):
            free.update(op.outputs)
        elif all(v in free or v in batch_only for v in ins) and not any(v in invars and v not in batch for v in ins):
            batch_only.update(op.outputs)
            if any(v not in batch_axis for v in op.outputs):
                seeds.add(op.index)  # a batch-wide reduction (or a scalar) of batch inputs alone
        if depends:
            batch_dependent.update(op.outputs)
    # The seeds' inputs must exist before the microbatches too.
    chosen, todo = set(), list(seeds)
    while todo:
        i = todo.pop()
        if i in chosen:
            continue
        chosen.add(i)
        for v in graph.ops[i].inputs:
            p = graph.producer.get(v)
            if p is not None and p not in chosen and all(o in free or o in batch_only or p in seeds for o in graph.ops[p].outputs):
                todo.append(p)
    return chosen
