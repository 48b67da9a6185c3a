"""Mixed-kind stages in the planner: a pipeline stage whose data-parallel parts sit on
devices of two or three kinds, each part taking rows of every microbatch in
proportion to its speed (Metis's load balancer, HETHUB's and Whale's split).

The search's space has one kind per stage. Its finalists are then widened here: where
a finalist leaves devices idle (a kind too slow or too small to hold a stage of its
own, or the rest of a kind a stage did not use), each stage (on its own mesh or a
narrower data axis) is tried with one or two idle kinds as extra parts (each with its
fastest meshes that hold the layers).
Adjacent stages of different kinds are also tried as one mixed stage over both their
layers and their devices (each kind's own mesh or a narrower data axis, which lets a
smaller microbatch split), as Metis puts V100 and T4 nodes in one stage. Each variant
is tried as split and with the pipeline's layers split again around the mixed stage
(`_resplit`: a mixed stage is faster than its lead alone, so it should take more layers,
or layers the stage it swallowed had), with each stage's and each part's fastest ZeRO
stage and recomputation that fit, at the finalist's microbatch count and coarser ones.
The rows follow the parts' speeds (whole examples, a multiple of each part's
data-parallel degree as the search gives a stage, at least the problem's least
microbatch: a part's rows are traced as a microbatch is). Every variant is priced by the one
estimator (`solver.cost.estimate`: the slowest part's rows set the stage's time, the
parts' gradients are summed as the runtime sums them over their links, each part's
memory must fit), and kept only where it is faster than the finalist it came from.
(A variant whose floor over every split, memory aside, already reaches the best so far
is refused before its tables are built: `mixed_floor`; one whose floor with its
positions' memory does, before the rest of them are: `tables_floor`. Where the caller
reads only the first few plans, the best so far starts at the last of those.)
So the planner chooses a mixed stage exactly when the estimator says it wins.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Sequence

import numpy as np

from solver.cost.estimate import estimate, simulated, step_floor_s
from solver.cost.problem import PlanningError, Problem
from solver.cost.ranges import at
from solver.cost.stage_costs import INF, StageConfig, StageCosts
from solver.cost.topologies import shares_sum_times
from solver.memory import OFFLOAD_TIERS, in_flight
from solver.planner.mixed_floor import (earning, members as _members, part_steps, position_floors, position_key,
                                       refused, split_floor, stage_meshes as _meshes)
from solver.planner.problem import PlanChoice, StageChoice
from solver.planner.step import ROUNDING, decisions, with_costs

MIXED_FINALISTS = 4  # single-chunk finalists widened with mixed stages (the best few: the rest rarely overtake them)
MAX_PART_KINDS = 2  # idle kinds joined to one stage: a stage of at most three kinds
LAYOUTS_PER_KIND = 2  # an idle kind's fastest meshes tried as a part
MERGED_MESHES = 1  # meshes per kind tried for a merged stage's parts: the widest data axes that split the rows (2: twice the time, no win seen)
LEAD_MESHES = 2  # meshes a stage joined by idle kinds is tried on: its own, then narrower data axes while the rows split coarsely
COARSE = 0.05  # a split whose slowest part is this much behind a split by speed tries the lead on a narrower data axis
COARSER = 2  # microbatch counts halved this many times beside the finalist's
_PART_STATS = ("part floor", "stats")  # the memo's entry for `_refused_by_tables`: floors taken, candidates refused


def proportional_examples(size: int, speeds: Sequence[float], least: Sequence[int] | int = 1,
                          unit: Sequence[int] | int = 1) -> tuple[int, ...]:
    """`size` rows split in proportion to `speeds`, whole examples: each part at least
    `least` and a multiple of `unit` rows (one number, or one per part: the planner
    gives a part a multiple of its data-parallel degree, as the search gives a stage).
    From each part's least, every `unit` left goes where it finishes soonest (the
    least (rows + unit) / speed; ties to the part furthest below its share), which
    keeps the slowest part, and so the stage, as fast as whole examples allow."""
    n = len(speeds)
    units = [unit] * n if isinstance(unit, int) else list(unit)
    floors = [least] * n if isinstance(least, int) else list(least)
    counts = [-(-max(f, 1) // u) * u for f, u in zip(floors, units)]  # the least, rounded up to whole units
    if size < sum(counts):
        raise PlanningError(f"a microbatch of {size} examples cannot give the parts at least {counts} each")
    total = sum(speeds)
    ideal = [size * v / total for v in speeds]
    left = size - sum(counts)
    while left:
        fits = [i for i in range(n) if units[i] <= left]
        if not fits:
            raise PlanningError(f"{size} examples do not split into parts of multiples of {units} rows")
        i = min(fits, key=lambda i: ((counts[i] + units[i]) / speeds[i], counts[i] - ideal[i]))
        counts[i] += units[i]
        left -= units[i]
    return tuple(counts)


def with_mixed_stages(problem: Problem, found: list[PlanChoice], costs: StageCosts,
                      read: int | None = None) -> list[PlanChoice]:
    """`found` (ranked by the estimator) with the best mixed variant of each of its
    first `MIXED_FINALISTS` single-chunk pipelines of different shapes (`_shapes`) added
    where it is faster, ranked again. `read`: how many plans of the ranking the caller
    reads, its first (None: every one); a variant is only looked for below the last of
    those so far (`_read_to`), as one no faster could not be among them."""
    if len(problem.kinds) < 2 or not problem.allow_mixed:
        return found
    plain = _shapes([c for c in found if _widened(c)])[:MIXED_FINALISTS]
    memo: dict = {}  # positions and parts priced for one finalist's variants serve the next's
    extra: list[PlanChoice] = []
    for c in plain:
        v = best_mixed(problem, c, costs, memo, _read_to(found, extra, read))
        if v is not None:
            extra.append(v)
    return sorted([*found, *extra], key=lambda c: c.step_s) if extra else found


def _read_to(found: list[PlanChoice], extra: list[PlanChoice], read: int | None) -> float:
    """The step of the `read`-th plan of `found` and `extra` ranked (inf where fewer, or
    where every plan is read). A variant added later ranks after every plan of its step
    already there (the ranking is stable, variants come last), and more variants only
    push it further down: one not below this step is never read, and leaving it out
    leaves the plans read as they were."""
    if read is None or read < 1 or len(found) + len(extra) < read:
        return INF
    return sorted(c.step_s for c in (*found, *extra))[read - 1]


def ranked_to(problem: Problem, ranked: list[PlanChoice], finalists: list[PlanChoice]) -> float:
    """The step up to which `with_mixed_stages` reads a ranking of `finalists` of which
    `ranked` are ranked so far: the fastest plan of each of its first
    `MIXED_FINALISTS` shapes (`step.rank`'s `exact_to`). Every shape's, where fewer
    shapes are ranked than it widens and some are not ranked yet (inf); -inf where no
    stage is widened."""
    if len(problem.kinds) < 2 or not problem.allow_mixed:
        return -INF
    firsts = _shapes([c for c in ranked if _widened(c)])
    if len(firsts) >= MIXED_FINALISTS:
        return firsts[MIXED_FINALISTS - 1].step_s
    if len(firsts) < len({_shape(c) for c in finalists if _widened(c)}):
        return INF
    return firsts[-1].step_s if firsts else -INF


def _widened(c: PlanChoice) -> bool:
    """Whether `with_mixed_stages` widens this finalist: a single pipeline of one chunk."""
    return c.chunks == 1 and len(c.replica_batch) == 1


def _shape(c: PlanChoice) -> tuple[str, ...]:
    return tuple(s.kind for s in c.stages)


def _shapes(plain: list[PlanChoice]) -> list[PlanChoice]:
    """The fastest pipeline of each shape (its stages' kinds in order), fastest first:
    the next finalists of a shape differ in meshes and microbatches, which the variants
    choose again anyway (`_resplit`, `_coarser`), while another shape puts other stages
    beside the idle kinds."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for c in plain:
        shape = _shape(c)
        if shape not in seen:
            seen.add(shape)
            out.append(c)
    return out


def idle_devices(problem: Problem, choice: PlanChoice) -> dict[str, int]:
    """Devices of each kind no stage of `choice` runs on (a group's chunks share theirs)."""
    used: dict[str, int] = {}
    for s in choice.stages[: len(choice.stages) // choice.chunks]:
        used[s.kind] = used.get(s.kind, 0) + s.devices
    return {k.name: k.count - used.get(k.name, 0) for k in problem.kinds if k.count > used.get(k.name, 0)}


def best_mixed(problem: Problem, choice: PlanChoice, costs: StageCosts, memo: dict | None = None,
               beat: float = INF) -> PlanChoice | None:
    """The fastest variant of `choice` with one mixed stage (idle devices joined to a
    stage, or two adjacent stages of different kinds made one), as split and with the
    layers split again around it, if one beats it and `beat` under the estimator; None
    otherwise (the first of the fastest in the order tried: every cut below is sound, so
    a lower `beat` only leaves out variants no faster than it).
    Single pipelines without interleaving only (the runtime's mixed stages have one chunk)."""
    if choice.chunks > 1 or len(choice.replica_batch) > 1 or choice.mixed:
        return None
    idle = idle_devices(problem, choice)
    best, best_s = None, min(choice.step_s, beat)

    memo = {} if memo is None else memo  # pipeline positions' tables and parts, shared by the variants

    def consider(candidate: PlanChoice | None) -> None:
        nonlocal best, best_s
        if candidate is None or refused(problem, candidate, costs, memo, best_s):
            return  # no split of it could be priced below the best so far (`mixed_floor`): its tables unbuilt
        if earning(memo, _PART_STATS, lambda: _refused_by_tables(problem, candidate, costs, memo, best_s)):
            return  # nor once its positions' memory rules: the tables of the positions it holds unbuilt
        split = _resplit(problem, candidate, costs, memo)
        options = [(candidate, 0.0)] if split is None else [(candidate, split[2]), split[:2]]
        if split is not None and split[0] == candidate:
            options = options[:1]  # the split again is its own (the same plan would be priced twice)
        for c, floor in options:
            # `floor`: the least the busiest position is busy a step (`_position`'s
            # "least"), which no schedule beats; past the best so far, not priced
            if floor >= best_s:
                continue
            cost = estimate(problem, decisions(c), costs, simulate_step=False)
            if not cost.fits or step_floor_s(problem, cost) * (1 - ROUNDING) >= best_s:
                continue  # its simulated step could not beat the best so far: not simulated
            cost = simulated(problem, cost)
            if cost.step_s < best_s:
                best, best_s = with_costs(c, cost), cost.step_s

    for m in _coarser(problem, choice):
        b = choice.replica_batch[0] // m
        base = replace(choice, num_microbatches=m)
        for p in range(len(choice.stages)):
            own = base.stages[p]
            layouts = {k: _layouts(problem, costs, k, n, own, b)[:LAYOUTS_PER_KIND] for k, n in idle.items()}
            layouts = {k: v for k, v in layouts.items() if v}
            for r in range(1, min(MAX_PART_KINDS, len(layouts)) + 1):
                for kinds in itertools.combinations(sorted(layouts), r):
                    for parts in itertools.product(*(layouts[k] for k in kinds)):
                        for stage in _lead_meshes(problem, own):
                            led = replace(base, stages=tuple(stage if i == p else s for i, s in enumerate(base.stages)))
                            candidate, off = _mixed_split(led, p, list(parts), b, costs)
                            consider(candidate)
                            if off <= COARSE:  # rows close to the speeds: a narrower lead would not split closer
                                break
        for p in range(len(choice.stages) - 1):
            for meshes in _merged_meshes(problem, base, p, b):
                consider(_merged(problem, base, p, costs, meshes))
    return best


def _lead_meshes(problem: Problem, stage: StageChoice) -> list[StageChoice]:
    """The stage on its own mesh and on up to `LEAD_MESHES - 1` narrower data axes
    (twice the tensor parallelism each, within a node): a lead whose data axis takes
    rows in smaller units leaves a slow part a share closer to its speed."""
    out, tp = [stage], stage.tp
    node = min(problem.max_tp, problem.kind(stage.kind).devices_per_node)
    while len(out) < LEAD_MESHES and stage.devices % (tp * 2) == 0 and tp * 2 <= node:
        tp *= 2
        out.append(replace(stage, dp=stage.devices // tp, tp=tp))
    return out


def _merged_meshes(problem: Problem, choice: PlanChoice, p: int, b: int) -> list[tuple[StageConfig, StageConfig]]:
    """Meshes for stages p and p + 1 made one mixed stage: per kind its stage's own
    and narrower data axes (more tensor parallelism within a node), the widest
    `MERGED_MESHES` whose data-parallel degrees leave each part a row per device."""
    a, c = choice.stages[p], choice.stages[p + 1]
    if a.kind == c.kind:
        return []

    def meshes(s: StageChoice) -> list[StageConfig]:
        k = problem.kind(s.kind)
        tps = [t for t in (1, 2, 4, 8) if t <= min(problem.max_tp, k.devices_per_node) and s.devices % t == 0]
        return [StageConfig(s.kind, s.devices // t, t) for t in tps if s.devices // t < b]

    out = [(x, y) for x in meshes(a) for y in meshes(c) if x.dp + y.dp <= b]
    keep_a = set(sorted({x.dp for x, _ in out}, reverse=True)[:MERGED_MESHES])
    keep_c = set(sorted({y.dp for _, y in out}, reverse=True)[:MERGED_MESHES])
    return [(x, y) for x, y in out if x.dp in keep_a and y.dp in keep_c]


def _merged(problem: Problem, choice: PlanChoice, p: int, costs: StageCosts,
            meshes: tuple[StageConfig, StageConfig] | None = None) -> PlanChoice | None:
    """`choice` with stages p and p + 1, of different kinds, made one mixed stage over
    both their layers on both their devices (as `meshes`, by default their own): one
    pipeline stage fewer (less bubble), and the two kinds share every layer in
    proportion to their speed, as Metis puts V100 and T4 nodes in one stage."""
    a, c = choice.stages[p], choice.stages[p + 1]
    if a.kind == c.kind:
        return None
    meshes = meshes or (StageConfig(a.kind, a.dp, a.tp), StageConfig(c.kind, c.dp, c.tp))
    b = choice.replica_batch[0] // choice.num_microbatches
    joined = replace(a, layer_end=c.layer_end, remat=a.remat or c.remat)
    parts = []
    for s, cfg in zip((a, c), meshes):
        zero = s.zero if cfg.dp > 1 else 0
        seconds = _pass_s(costs, cfg, b, zero, "full" if joined.remat else "", joined.layer_start, joined.layer_end)
        parts.append((cfg, zero, b / seconds if seconds > 0 else 1.0))
    try:
        rows = proportional_examples(b, [speed for _, _, speed in parts], least=problem.min_microbatch,
                                     unit=[parts[0][0].dp, parts[1][0].dp])
    except PlanningError:
        return None
    (ca, za, _), (cc, zc, _) = parts
    stages = [*choice.stages[:p], replace(joined, dp=ca.dp, tp=ca.tp, zero=za, examples=rows[0]), *choice.stages[p + 2:]]
    stages.append(replace(joined, kind=c.kind, dp=cc.dp, tp=cc.tp, zero=zc, offload="", part_of=p, examples=rows[1]))
    return replace(choice, stages=tuple(stages))


def _refused_by_tables(problem: Problem, choice: PlanChoice, costs: StageCosts, memo: dict, best_s: float) -> bool:
    """Whether `tables_floor` proves that neither `choice`'s own split nor `_resplit`'s
    reaches below `best_s`: with its mixed positions' tables, then (where that is not
    enough) its other positions' too. Not where no split fits: `_resplit` then leaves
    the candidate to the estimator, and so does this."""
    floor = tables_floor(problem, choice, costs, memo)
    if floor >= best_s or any(costs.offload.allowed(problem.kind(s.kind)) for s in choice.stages):
        return best_s <= floor < INF  # (a table that may offload picks among tiers by what fits: not monotone in what it holds)
    return best_s <= tables_floor(problem, choice, costs, memo, alone=True) < INF


def tables_floor(problem: Problem, choice: PlanChoice, costs: StageCosts, memo: dict | None = None,
                 alone: bool = False) -> float:
    """`least_floor`, with each mixed position's own least (`_position`'s, whose parts'
    memory rules out the choices that do not fit: most of them on a coarse microbatch)
    in place of its floor, and with `alone`, each other position's least too, at the
    fewest microbatches in flight of the positions on its devices' stage (memory grows
    with them, so fewer fit no fewer choices: no more than its own least, where the
    tables hold only on-device choices). At most the busiest position's least of
    every split of `choice`, its own and `_resplit`'s, which reads the same tables,
    built once (`memo`); the other positions' floors are the ones `refused` took."""
    memo = {} if memo is None else memo
    members = _members(choice)
    floors = position_floors(problem, choice, costs, memo)
    m, n = choice.num_microbatches, len(members)
    fewest: dict[tuple, int] = {}  # per stage (and whether last), the fewest microbatches its positions hold
    for p, mine in enumerate(members):
        key = (_stage_key(choice, mine), p == n - 1)
        fewest[key] = min(fewest.get(key, m + n), in_flight(choice.schedule, m, p, n))
    for p, mine in enumerate(members):
        if len(mine) > 1 or alone:
            held = fewest[_stage_key(choice, mine), p == n - 1] if len(mine) == 1 else None
            floors[p] = np.where(costs.nonempty, _table(problem, choice, costs, memo, members, p, held)["least"], INF)
    return split_floor(floors)


def _stage_key(choice: PlanChoice, mine: list[int]) -> tuple:
    return position_key(tuple(choice.stages[k] for k in mine))


def _table(problem: Problem, choice: PlanChoice, costs: StageCosts, memo: dict, members: list[list[int]], p: int,
           held: int | None = None) -> dict:
    """Position `p`'s `_position` tables (holding `held` microbatches, by default its
    schedule's), from `memo` by what they depend on where built before."""
    m = choice.num_microbatches
    b = choice.replica_batch[0] // m
    stages = tuple(choice.stages[k] for k in members[p])
    last = p == len(members) - 1
    held = in_flight(choice.schedule, m, p, len(members)) if held is None else held
    key = (_stage_key(choice, members[p]), b, held, last, m)
    if key not in memo:
        memo[key] = _position(problem, costs, stages, b, m, held, last, memo)
    return memo[key]


def _resplit(problem: Problem, choice: PlanChoice, costs: StageCosts,
             memo: dict | None = None) -> tuple[PlanChoice, float, float] | None:
    """`choice` (one mixed stage among its stages, the same meshes and rows) with its
    layers split again over its pipeline positions: the split whose busiest position
    (a microbatch's forward and backward, the slowest part's for a mixed one, plus its
    once-per-step tail over the microbatches) is least, each stage and part with its
    fastest ZeRO stage and recomputation that fit there (a stage of its own on the mesh
    of its devices that suits the rows best). With the floor of that split
    and of `choice`'s own (the busiest position's `least`: no schedule beats it), or
    None where no split fits. `memo`: positions' tables already built, by what they depend on."""
    members, layers = _members(choice), costs.n
    leads = [mine[0] for mine in members]
    memo = {} if memo is None else memo
    tables = [_table(problem, choice, costs, memo, members, p) for p in range(len(members))]
    own = max(float(t["least"][choice.stages[i].layer_start, choice.stages[i].layer_end]) for t, i in zip(tables, leads))
    # best[j]: the least busiest-position cost of positions 0..p holding layers [0, j)
    best = tables[0]["cost"][0].copy()
    back = []
    for t in tables[1:]:
        cand = np.maximum(best[:, None], t["cost"])
        back.append(cand.argmin(axis=0))
        best = cand.min(axis=0)
    if not np.isfinite(best[layers]):
        return None
    cuts = [layers]
    for arg in reversed(back):
        cuts.append(int(arg[cuts[-1]]))
    cuts.append(0)
    cuts.reverse()
    stages = list(choice.stages)
    floor = 0.0
    for p, mine in enumerate(members):
        lo, hi, t = cuts[p], cuts[p + 1], tables[p]
        floor = max(floor, float(t["least"][lo, hi]))
        for k, q in enumerate(mine):
            stages[q] = replace(stages[q], layer_start=lo, layer_end=hi, remat=bool(t["remat"][lo, hi]),
                                zero=int(t["zero"][k][lo, hi]), offload=OFFLOAD_TIERS[int(t["offload"][k][lo, hi])])
        if "tp" in t:  # a stage of its own, on the mesh its table chose
            tp = int(t["tp"][lo, hi])
            stages[mine[0]] = replace(stages[mine[0]], dp=stages[mine[0]].devices // tp, tp=tp)
    return replace(choice, stages=tuple(stages)), floor, own


def _position(problem: Problem, costs: StageCosts, stages: tuple[StageChoice, ...], b: int, m: int, held: int,
              last: bool, memo: dict | None = None) -> dict:
    """One pipeline position (`stages`: a stage, or a mixed stage's parts, lead first)
    for every layer range: "cost" (a microbatch's forward and backward plus the
    once-per-step tail over the `m` microbatches, inf where it does not fit), "fb", per
    member the ZeRO stage and offload tier picked and the recomputation the parts share,
    and "least": seconds the position is busy a step at the least, whatever its members'
    choices that fit (each member's least `m` forwards and backwards, and the lead's
    tail; the estimator charges a mixed position its slowest part's forwards,
    backwards and update, each at least these), which no schedule beats. `memo`:
    parts already priced (the variants of a finalist set share many)."""
    memo = {} if memo is None else memo
    shape = (costs.n + 1, costs.n + 1)
    upper = np.triu(np.ones(shape, dtype=bool), k=1)
    if len(stages) == 1:  # a stage of its own: the search's tables, its devices on the mesh that suits the rows best
        s = stages[0]
        out: dict | None = None
        for cfg in _meshes(problem, s, b):
            t = costs.table(cfg, b, held, last, m)
            fb = np.where(upper, t.time, INF)
            zero = t.zero if t.zero is not None else np.zeros(shape, dtype=int)
            offload = t.offload if t.offload is not None else np.zeros(shape, dtype=int)
            mine = {"cost": fb + t.tail / m, "fb": fb, "remat": t.remat, "zero": [zero], "offload": [offload],
                    "least": m * fb + t.tail, "tp": np.full(shape, cfg.tp)}
            if out is None:
                out = mine
                continue
            take = mine["cost"] < out["cost"]
            for name in ("cost", "fb", "remat", "tp"):
                out[name] = np.where(take, mine[name], out[name])
            out["zero"], out["offload"] = [np.where(take, mine["zero"][0], out["zero"][0])], [np.where(take, offload, out["offload"][0])]
            out["least"] = np.minimum(out["least"], mine["least"])
        return out
    streams = min(s.devices for s in stages)
    topology, _ = costs.replica_reduction([s.kind for s in stages], streams)
    cum = np.concatenate([[0.0], np.cumsum(costs.params)])
    cross = shares_sum_times(topology, len(stages), np.maximum(cum[None, :] - cum[:, None], 0.0) / max(streams, 1))
    remats = ["full"] if problem.force_remat else [""] + (["full"] if problem.allow_remat else [])
    best: dict | None = None
    for remat in remats:
        fb_all, tail_all, least, zeros = np.zeros(shape), np.zeros(shape), np.zeros(shape), []
        for k, s in enumerate(stages):
            key = ("part", s.kind, s.dp, s.tp, s.examples or b, m, held, last, remat)
            if key not in memo:
                memo[key] = _part(costs, StageConfig(s.kind, s.dp, s.tp), s.examples or b, m, held, last, remat, memo)
            part_cost, part_fb, part_tail, part_zero = memo[key]
            fb_all, tail_all = np.maximum(fb_all, part_fb), np.maximum(tail_all, part_tail)
            least = np.maximum(least, part_cost)
            zeros.append(part_zero)
        fb_all = np.where(upper, fb_all, INF)
        cost = fb_all + (tail_all + cross) / m
        if best is None:
            best = {"cost": cost, "fb": fb_all, "remat": np.full(shape, bool(remat)), "zero": zeros, "least": least}
        else:
            take = cost < best["cost"]
            best["cost"], best["fb"] = np.where(take, cost, best["cost"]), np.where(take, fb_all, best["fb"])
            best["remat"] = np.where(take, bool(remat), best["remat"])
            best["zero"] = [np.where(take, z, old) for z, old in zip(zeros, best["zero"])]
            best["least"] = np.minimum(least, best["least"])
    best["offload"] = [np.zeros(shape, dtype=int) for _ in stages]
    return best


def _part(costs: StageCosts, cfg: StageConfig, rows: int, m: int, held: int, last: bool,
          remat: str, memo: dict | None = None) -> tuple[np.ndarray, ...]:
    """A mixed stage's part on `rows` of every microbatch, for every layer range: the
    least of `m` forwards and backwards plus the tail over its ZeRO stages that fit
    (inf where none does; the first such stage of the least), that choice's forward
    and backward, its tail, its ZeRO stage. Every part holds its optimizer state and
    runs its own update, as the estimator prices it (`solver.cost.mixed`). `memo`:
    parts' times already stacked (`part_steps`)."""
    zeros = costs.zero_stages(cfg)
    steps, fbs, tails = part_steps(costs, cfg, rows, m, last, remat, memo)
    memory = costs._choice_memory.totals(cfg, rows, held, last, [(zero, remat) for zero in zeros])  # each `variant`'s, at once
    cost = np.where(memory <= costs.capacity(cfg.kind), steps, INF)
    least = cost.min(axis=0)
    pick = (cost == least).argmax(axis=0)[None]  # the first of the least, as a scan keeping strict improvements
    fits = least < INF
    return (least, np.where(fits, np.take_along_axis(fbs, pick, axis=0)[0], INF),
            np.where(fits, np.take_along_axis(tails, pick, axis=0)[0], 0.0), np.where(fits, np.array(zeros)[pick[0]], 0))


def _coarser(problem: Problem, choice: PlanChoice) -> list[int]:
    """The finalist's microbatch count and up to `COARSER` coarser ones the problem allows:
    a part's share is whole examples, so larger microbatches split closer to speed."""
    batch, m = choice.replica_batch[0], choice.num_microbatches
    allowed = problem.microbatches
    out = []
    for k in range(COARSER + 1):
        n = m >> k
        if n >= 1 and batch % n == 0 and (allowed is None or n in allowed) and batch // n >= problem.min_microbatch:
            out.append(n)
    return list(dict.fromkeys(out))


def _layouts(problem: Problem, costs: StageCosts, kind: str, devices: int, stage: StageChoice,
             b: int) -> list[tuple[StageConfig, int, float]]:
    """The idle `devices` of `kind` as each allowed (dp, tp) mesh (tensor parallelism
    within a node) that holds the stage's layers at a microbatch of `b` rows with the
    least ZeRO stage that fits: (mesh, ZeRO stage, examples per second)."""
    k = problem.kind(kind)
    i, j = stage.layer_start, stage.layer_end
    remat = "full" if stage.remat else ""
    out = []
    for tp in (t for t in (1, 2, 4, 8) if t <= min(problem.max_tp, k.devices_per_node) and devices % t == 0):
        cfg = StageConfig(kind, devices // tp, tp)
        if 2 * cfg.dp > b:  # a row per data-parallel device, and the lead keeps at least half
            continue
        share = max(cfg.dp, b * cfg.devices // max(1, devices + stage.devices))  # about the rows it would take
        for zero in sorted(z for z in problem.zero_stages if z == 0 or cfg.dp > 1):
            v = costs.variant(cfg, share, 1, False, zero, remat)
            if at(v.memory.total, v.forward.shape, i, j) > costs.capacity(kind):
                continue
            seconds = _pass_s(costs, cfg, share, zero, remat, i, j)
            if seconds > 0:
                out.append((cfg, zero, share / seconds))
            break
    return sorted(out, key=lambda layout: -layout[2])


def _pass_s(costs: StageCosts, cfg: StageConfig, b: int, zero: int, remat: str, i: int, j: int) -> float:
    """A forward and backward of one microbatch of `b` rows over layers [i, j) (`variant`'s
    times, its memory left unbuilt): what a part's speed (rows over it) is reckoned from."""
    forward, backward, _, _, _ = costs._placed_times(cfg, b, zero, remat, False)
    return at(forward, forward.shape, i, j) + at(backward, forward.shape, i, j)


def _mixed(choice: PlanChoice, p: int, parts: list[tuple[StageConfig, int, float]], b: int,
           costs: StageCosts) -> PlanChoice | None:
    """`choice` with stage `p` joined by `parts` (mesh, ZeRO stage, examples per
    second), rows by speed, at least one per data-parallel device."""
    return _mixed_split(choice, p, parts, b, costs)[0]


def _mixed_split(choice: PlanChoice, p: int, parts: list[tuple[StageConfig, int, float]], b: int,
                 costs: StageCosts) -> tuple[PlanChoice | None, float]:
    """`_mixed`, and how far its whole rows leave the slowest part behind a split in
    proportion to speed (its time over the ideal, less one; inf where none splits)."""
    lead = choice.stages[p]
    cfg = StageConfig(lead.kind, lead.dp, lead.tp)
    seconds = _pass_s(costs, cfg, b, lead.zero, "full" if lead.remat else "", lead.layer_start, lead.layer_end)
    speeds = [b / seconds if seconds > 0 else 1.0, *(speed for _, _, speed in parts)]
    try:
        rows = proportional_examples(b, speeds, least=costs.problem.min_microbatch,  # a part's rows trace as a microbatch
                                     unit=[lead.dp, *(c.dp for c, _, _ in parts)])
    except PlanningError:
        return None, INF
    stages = list(choice.stages)
    stages[p] = replace(lead, examples=rows[0])
    for (c, zero, _), n in zip(parts, rows[1:]):
        stages.append(replace(lead, kind=c.kind, dp=c.dp, tp=c.tp, zero=zero, offload="", part_of=p, examples=n))
    off = max(n / v for n, v in zip(rows, speeds)) * sum(speeds) / b - 1
    return replace(choice, stages=tuple(stages)), off
