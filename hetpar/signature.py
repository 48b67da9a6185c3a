"""The `jax.jit` calling convention for a parallelized step: keyword arguments,
`static_argnums` and `donate_argnums`.

The planner works on a function of positional pytrees, so a call is first brought
to that form: keyword arguments are bound to their positions (keyword-only ones
travel as one trailing dict of pytrees), static arguments are closed over (and
become part of the cache key, as with `jax.jit`, so they must be hashable), and
the batch's position is counted among the remaining arguments.

Donation: hetpar runs many programs per step and reuses a parameter buffer in
place when it is already where a stage wants it, so input buffers cannot be handed
to XLA as they are by `jax.jit`. Instead the donated arguments' buffers are freed
after the step has *succeeded* (those not returned unchanged), which gives the
memory back while a step that fails, at planning or while running, leaves the
caller's state intact.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import jax

from hetpar.errors import HetparError


@dataclass(frozen=True)
class BoundCall:
    fn: Callable  # of the dynamic positional arguments only
    args: tuple  # the dynamic arguments
    batch_argnum: int  # among `args`
    static_key: tuple  # the static arguments' values, for the cache key
    donated: tuple  # the donated arguments' values (pytrees)
    kept: tuple  # the other arguments: buffers they share with donated ones stay
    # `args` flattened, once per call: the traceability check, the cache key and the
    # runtime all read these leaves (a TrainState's flattening is a fifth of a
    # millisecond, paid once rather than per reader).
    leaves: list = field(default_factory=list)
    treedef: Any = None


def normalize_argnums(argnums: int | tuple[int, ...] | None, what: str) -> tuple[int, ...]:
    if argnums is None:
        return ()
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if any(not isinstance(n, int) or n < 0 for n in nums):
        raise HetparError(f"{what} must be non-negative argument positions, got {argnums!r}")
    return nums


def bind_call(fn: Callable, args: tuple, kwargs: dict, batch_argnum: int,
              static_argnums: tuple[int, ...] = (), donate_argnums: tuple[int, ...] = ()) -> BoundCall:
    """`fn(*args, **kwargs)` as a function of its dynamic positional arguments."""
    keyword_only: dict = {}
    if kwargs:
        try:
            bound = inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as e:
            raise HetparError(f"the step cannot take these arguments: {e}") from None
        args, keyword_only = tuple(bound.args), dict(bound.kwargs)
    if batch_argnum >= len(args):
        raise HetparError(
            f"the step got {len(args)} positional arguments (keyword arguments included where they have a "
            f"position); batch_argnum={batch_argnum} names none of them"
        )
    if batch_argnum in static_argnums:
        raise HetparError(f"argument {batch_argnum} is the batch; it cannot also be in static_argnums")
    if set(static_argnums) & set(donate_argnums):
        raise HetparError("an argument cannot be both static and donated (static arguments are not arrays)")
    statics = {i: args[i] for i in static_argnums if i < len(args)}
    try:
        static_key = tuple(sorted((i, v) for i, v in statics.items()))
        hash(static_key)
    except TypeError:
        raise HetparError(
            "static arguments must be hashable (they are part of the cache key, as with jax.jit); "
            f"got {[type(v).__name__ for v in statics.values()]}"
        ) from None
    dynamic_pos = [i for i in range(len(args)) if i not in statics]
    dynamic = tuple(args[i] for i in dynamic_pos)
    leaves, treedef = jax.tree.flatten((*dynamic, keyword_only) if keyword_only else dynamic)
    if not all(map(_traceable, jax.tree.leaves(dynamic) if keyword_only else leaves)):
        for i in dynamic_pos:
            _check_traceable(fn, i, args[i])
    n = len(args)

    def call(*dyn: Any) -> Any:
        full: list = [statics.get(i) for i in range(n)]  # only the statics: no array is kept alive
        for i, value in zip(dynamic_pos, dyn[: len(dynamic_pos)]):
            full[i] = value
        extra = dyn[len(dynamic_pos)] if keyword_only else {}
        return fn(*full[:n], **extra)

    if keyword_only:
        dynamic = (*dynamic, keyword_only)
    donated = tuple(args[i] for i in donate_argnums if i < len(args))
    kept = tuple(args[i] for i in range(len(args)) if i not in donate_argnums) + (keyword_only,)
    return BoundCall(call, dynamic, dynamic_pos.index(batch_argnum), static_key, donated, kept, leaves, treedef)


def _check_traceable(fn: Callable, position: int, value: Any) -> None:
    """Refuses an argument JAX cannot trace (a string, a config object) in the
    user's terms: which argument, what it is, and the fix, instead of JAX's error
    from deep inside tracing. Called once `bind_call` found such a leaf, to name it."""
    if all(map(_traceable, jax.tree.leaves(value))):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        if _traceable(leaf):
            continue
        try:
            name = f" ({list(inspect.signature(fn).parameters)[position]!r})"
        except (TypeError, ValueError, IndexError):
            name = ""
        where = f"argument {position}{name}" + (jax.tree_util.keystr(path) if path else "")
        raise HetparError(
            f"{where} is a {type(leaf).__name__} ({_short(leaf)}), not an array JAX can trace: pass "
            f"static_argnums=({position},) to hetpar.parallelize, as with jax.jit, if it is a setting the step "
            "is compiled for; or pass it as an array"
        )


_ARRAY_TYPES: set[type] = set()  # the concrete classes of jax Arrays met so far


def is_array(leaf: Any) -> bool:
    """`isinstance(leaf, jax.Array)`, by the leaf's class once it has been seen: the
    test runs for every leaf of every call (twice), and `jax.Array` is an abstract
    class whose isinstance costs about a microsecond (a fifth of a millisecond per
    call of a GPT step's 164 leaves)."""
    if type(leaf) in _ARRAY_TYPES:
        return True
    if isinstance(leaf, jax.Array):
        _ARRAY_TYPES.add(type(leaf))
        return True
    return False


def _traceable(leaf: Any) -> bool:
    # A jax Array first: nearly every leaf of a step's state is one, and the test runs
    # per leaf per call.
    return is_array(leaf) or isinstance(leaf, (bool, int, float, complex)) or (
        hasattr(leaf, "shape") and hasattr(leaf, "dtype") and getattr(leaf.dtype, "kind", "f") not in "OUSV")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def free_donated(donated: tuple, outputs: Any, kept: tuple = ()) -> None:
    """Frees the donated buffers that the step did not return and that no other
    argument (`kept`) shares, after a successful step."""
    buffers = [x for x in jax.tree.leaves(donated) if isinstance(x, jax.Array)]
    if not buffers:  # nothing donated: no walk over the outputs, every step
        return
    keep = {id(x) for x in jax.tree.leaves((outputs, kept))}
    for x in buffers:
        if isinstance(x, jax.Array) and id(x) not in keep and not x.is_deleted():
            x.delete()
