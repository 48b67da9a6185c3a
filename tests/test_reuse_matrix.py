"""Every way to reuse what `hetpar.parallelize` gives back, on every kind of plan
(issue 34): routes x plans x models, each cell parity with `jax.jit` (fp32) or a
refusal by hetpar naming the limit.

Routes (ROUTES): call the step again with the state it returned (and compile
nothing); `like=` the same step (and compile nothing); `like=` a forward-only eval;
the plan saved, loaded and run; an orbax checkpoint saved, restored and trained on
(compiling nothing); `hetpar.gather` then a plain `jax.jit` eval. Plans (PLANS):
1F1B, interleaved chunks, ZeRO-2, ZeRO-3, recomputation, uneven data-parallel
replicas, and two and three device kinds. Models: the examples' GPT and
transformers' FlaxGPT2 with dropout on, both tiny.

Each test is one (model, plan) pair and runs all its routes on one compiled step, so
a plan is compiled once whatever the number of routes (and pytest-xdist never
compiles it twice); the test id carries its cell count, and a failing cell does not
hide the others: every cell's outcome is reported together."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import hetpar
from hetpar.options import ShardingOption, StageOption
from models import gpt
from parity import assert_close

log = logging.getLogger(__name__)

CLUSTERS = Path(__file__).parent.parent / "examples" / "clusters"
TWO = {"A100": 4, "V100": 4}
THREE = {"H100": 2, "A100": 2, "V100": 4}
B = 8

# name -> (cluster, parallelize options)
PLANS: dict[str, tuple[dict, dict]] = {
    "1f1b-two-kinds": (TWO, dict(num_stages=2, num_microbatches=2, schedule="1f1b")),
    "interleaved": (TWO, dict(num_stages=2, num_microbatches=4, schedule="interleaved", chunks=2)),
    "zero2": (TWO, dict(num_stages=2, num_microbatches=2, schedule="1f1b", sharding_option=ShardingOption(zero=2))),
    "zero3": (TWO, dict(num_stages=2, num_microbatches=2, schedule="1f1b", sharding_option=ShardingOption(zero=3))),
    "remat": (TWO, dict(num_stages=2, num_microbatches=2, stage_option=StageOption(remat="full"))),
    # One device and one microbatch a replica, so shares need not split further: H100 takes more.
    "uneven-replicas": ({"H100": 1, "V100": 1}, dict(num_replicas=2, num_microbatches=1)),
    "three-kinds": (THREE, dict(num_stages=3, num_microbatches=2)),
}
ROUTES = ("again", "like-step", "like-eval", "plan-file", "orbax", "gather-jit")
MODELS = ("gpt", "gpt2")
# Dropout: FlaxGPT2 trains with it on (train=True, a dropout key split from the state
# every step, its bits drawn for the whole batch and sliced per microbatch) in every
# row; the examples' GPT has no dropout layer.
CASES = [(m, p) for m in MODELS for p in PLANS]
CELLS = len(CASES) * len(ROUTES)


# --- counting compilations -------------------------------------------------------
# '/jax/core/compile/backend_compile_duration' is recorded for every executable JAX
# asks the backend for (a persistent-cache hit included, which also records
# '/jax/compilation_cache/cache_hits').
# JAX's own transfer helper: placing a committed single-device array (a checkpoint
# restored onto one device) in a layout split over a mesh (ZeRO's sharded state)
# slices it on its device with a small jitted program per shape, once per process.
TRANSFER = "_multi_slice"
_COMPILES = {"backend": 0, "cache_hits": 0, "transfer": 0}


def _on_duration(event: str, duration: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["transfer" if TRANSFER in str(kwargs.get("fun_name", "")) else "backend"] += 1


def _on_event(event: str, **kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _COMPILES["cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def compiles() -> int:
    """Programs compiled so far, JAX's transfer slicing (TRANSFER) apart."""
    return _COMPILES["backend"]


# --- models -----------------------------------------------------------------------
@dataclass
class Model:
    step: Callable  # (state, batch) -> (state, loss)
    evaluate: Callable  # (state, batch) -> loss, forward only
    state: Any
    batches: tuple  # two batches: the first step's and the next one's


def examples_gpt() -> Model:
    w = gpt.setup(batch_size=B, config=gpt.GPTConfig(n_layers=4, d_model=16, n_heads=2, seq_len=8, vocab_size=32))
    other = gpt.setup(batch_size=B, config=gpt.GPTConfig(n_layers=4, d_model=16, n_heads=2, seq_len=8, vocab_size=32),
                      seed=1).batch

    def evaluate(state, batch):
        return w.loss_fn(state.params, batch)

    return Model(w.step, evaluate, w.state, (w.batch, other))


def flax_gpt2(dropout: bool) -> Model:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2)
    model = transformers.FlaxGPT2LMHeadModel(cfg, seed=0)
    tx = optax.adamw(1e-3, eps=1e-3)

    def loss(params, batch, key, train):
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], params=params,
                       dropout_rng=key, train=train).logits
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["input_ids"][:, 1:])
        mask = batch["attention_mask"][:, 1:].astype(jnp.float32)
        return jnp.sum(ce * mask) / jnp.sum(mask)

    def step(state, batch):
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)
        value, grads = jax.value_and_grad(loss)(params, batch, dropout_key, dropout)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), value

    def evaluate(state, batch):
        return loss(state[0], batch, None, False)

    def batch(seed):
        ids = jax.random.randint(jax.random.key(seed), (B, 8), 0, 32)
        lengths = np.array([8, 2, 5, 8, 1, 6, 3, 7])  # padding uneven across microbatches
        return {"input_ids": ids, "attention_mask": jnp.asarray((np.arange(8)[None] < lengths[:, None]).astype(np.int32))}

    return Model(step, evaluate, (model.params, tx.init(model.params), jax.random.key(5)), (batch(1), batch(2)))


@functools.cache
def make_model(name: str) -> Model:
    return examples_gpt() if name == "gpt" else flax_gpt2(dropout=True)


@functools.cache
def reference(name: str) -> tuple:
    """jax.jit's two steps from the model's state, and its eval after the first:
    the same for every plan of a model."""
    m = make_model(name)
    step = jax.jit(m.step)
    first = step(m.state, m.batches[0])
    second = step(first[0], m.batches[1])
    return first, second, jax.jit(m.evaluate)(first[0], m.batches[1])


@pytest.fixture(scope="module", autouse=True)
def every_program_cached():
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


# --- the routes -------------------------------------------------------------------
@dataclass
class Trained:
    """One compiled plan, shared by every route of its test: the step after one call,
    and jax.jit's reference for two steps."""

    model: Model
    cluster: hetpar.Cluster
    train: hetpar.ParallelFunction
    state1: Any  # hetpar's state after one step
    ref1: Any  # jax.jit's
    ref2: Any  # jax.jit's state and loss after the second step
    ref_eval: Any  # jax.jit's eval of ref1 on the second batch


def _second_step(t: Trained, state: Any, what: str) -> None:
    state2, loss2 = t.train(state, t.model.batches[1])
    assert_close(loss2, t.ref2[1], f"{what}: loss")
    assert_close(jax.device_get(state2), jax.device_get(t.ref2[0]), f"{what}: state")


def route_again(t: Trained, tmp_path: Any) -> str:
    before = compiles()
    _second_step(t, t.state1, "second call")
    assert compiles() == before, f"the second call compiled {compiles() - before} programs"
    return "ok, 0 compiles"


def route_like_step(t: Trained, tmp_path: Any) -> str:
    before = compiles()
    again = hetpar.parallelize(t.model.step, like=t.train)
    state2, loss2 = again(t.state1, t.model.batches[1])
    assert_close(loss2, t.ref2[1], "like= the step: loss")
    assert_close(jax.device_get(state2), jax.device_get(t.ref2[0]), "like= the step: state")
    assert compiles() == before, f"like= the same step compiled {compiles() - before} programs"
    return "ok, 0 compiles"


def route_like_eval(t: Trained, tmp_path: Any) -> str:
    evaluate = hetpar.parallelize(t.model.evaluate, like=t.train)
    value = evaluate(t.state1, t.model.batches[1])
    assert_close(value, t.ref_eval, "eval like= the step")
    train_s, eval_s = t.train.plan.predicted_step_time_s, evaluate.plan.predicted_step_time_s
    assert eval_s > 0, f"the eval is not priced: {evaluate.plan.notes}"
    assert eval_s < train_s, f"the forward-only eval is priced at {eval_s}, the train step at {train_s}"
    return f"ok, priced {eval_s / train_s:.2f}x the train step"


def route_plan_file(t: Trained, tmp_path: Any) -> str:
    path = tmp_path / "plan.json"
    hetpar.save_plan(t.train.plan, path)
    loaded = hetpar.parallelize(t.model.step, plan=str(path), cluster=t.cluster)
    compiled, read = compiles(), _COMPILES["cache_hits"]
    state1, loss1 = loaded(t.model.state, t.model.batches[0])
    compiled, read = compiles() - compiled, _COMPILES["cache_hits"] - read
    assert_close(jax.device_get(state1), jax.device_get(t.ref1), "loaded plan: state")
    assert loaded.plan.stages == t.train.plan.stages or [s.device_ids for s in loaded.plan.stages] == [
        s.device_ids for s in t.train.plan.stages]
    return f"ok, {read} of {compiled} programs read from the persistent cache"


def route_orbax(t: Trained, tmp_path: Any) -> str:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", t.state1)
    checkpointer.wait_until_finished()
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), t.state1)
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    before, transfers = compiles(), _COMPILES["transfer"]
    _second_step(t, restored, "restored")
    assert compiles() == before, f"the restored state compiled {compiles() - before} programs"
    transfers = _COMPILES["transfer"] - transfers
    return "ok, 0 compiles" + (f" ({transfers} of JAX's {TRANSFER} to lay restored arrays out over a mesh)"
                               if transfers else "")


def route_gather_jit(t: Trained, tmp_path: Any) -> str:
    gathered = hetpar.gather(t.state1)
    value = jax.jit(t.model.evaluate)(gathered, t.model.batches[1])
    assert_close(value, t.ref_eval, "jax.jit eval of the gathered state")
    return "ok"


ROUTE_FNS = {"again": route_again, "like-step": route_like_step, "like-eval": route_like_eval,
             "plan-file": route_plan_file, "orbax": route_orbax, "gather-jit": route_gather_jit}
assert tuple(ROUTE_FNS) == ROUTES


def _keys_as_data(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.random.key_data(x) if hasattr(x, "dtype") and jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x, tree)


@pytest.mark.parametrize("model,plan", CASES, ids=[f"{m}-{p}-{len(ROUTES)}cells" for m, p in CASES])
def test_reuse(model, plan, tmp_path):
    """One (model, plan) pair: every route, each parity or a HetparError."""
    kinds, options = PLANS[plan]
    m = make_model(model)
    (ref1, ref_loss1), ref2, ref_eval = reference(model)
    cluster = hetpar.Cluster.virtual(kinds)
    train = hetpar.parallelize(m.step, cluster=cluster, **options)
    state1, loss1 = train(m.state, m.batches[0])
    assert_close(loss1, ref_loss1, "first step: loss")
    assert_close(jax.device_get(state1), jax.device_get(ref1), "first step: state")
    _check_plan(plan, train.plan)
    if model == "gpt2":
        assert train.compiled().analysis.sliced, "no dropout bits drawn for the whole batch: dropout is not tested"
    t = Trained(m, cluster, train, state1, ref1, ref2, ref_eval)

    outcomes, failures = {}, []
    for route in ROUTES:
        (tmp_path / route).mkdir()
        started = time.perf_counter()
        try:
            outcomes[route] = ROUTE_FNS[route](t, tmp_path / route)
        except hetpar.HetparError as e:  # a refusal: hetpar's own error, in the user's terms
            outcomes[route] = f"refused: {e}"
        except Exception as e:  # noqa: BLE001 (every cell's outcome is reported together)
            outcomes[route] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            failures.append(route)
        outcomes[route] += f" ({time.perf_counter() - started:.1f}s)"
    table = "\n".join(f"  {model} x {plan} x {route}: {outcomes[route]}" for route in ROUTES)
    print(f"reuse matrix, {len(ROUTES)} of {CELLS} cells:\n{table}")
    assert not failures, f"{len(failures)} of {len(ROUTES)} cells failed:\n{table}"
    for route in ("again", "like-step", "orbax", "gather-jit"):  # these must run, never be refused
        assert outcomes[route].startswith("ok"), f"{route}: {outcomes[route]}"


def _check_plan(name: str, plan: hetpar.Plan) -> None:
    """The plan is the kind its row claims, so the row tests what it says."""
    if name == "interleaved":
        assert plan.chunks == 2 and plan.schedule == "interleaved"
    elif name.startswith("zero"):
        assert {s.zero for s in plan.stages} == {int(name[-1])}
    elif name == "remat":
        assert all(s.remat == "full" for s in plan.stages)
    elif name == "uneven-replicas":
        assert plan.num_replicas == 2 and len(set(plan.replica_batch)) == 2, plan.replica_batch
    elif name == "three-kinds":
        assert len({s.group for s in plan.stages}) == 3


def test_matrix_size():
    """The matrix's size, printed: models x plans x routes."""
    print(f"reuse matrix: {len(CASES)} (model, plan) pairs x {len(ROUTES)} routes = {CELLS} cells")
    assert CELLS == len(MODELS) * len(PLANS) * len(ROUTES) == 84


def test_like_on_the_returned_state_of_an_auto_plan():
    """Issue 34's reproduction: the examples' GPT on examples/clusters/virtual_8.yaml,
    auto-planned over 2 microbatches; `like=` the step on the state it returned ran
    the step placed as an eval and failed with a KeyError. Now it runs the train
    plan with jax.jit's loss on the gathered state, and a forward-only eval like= it
    is priced below the step."""
    import models

    w = models.get("gpt", batch_size=8)
    train = hetpar.parallelize(w.step, cluster=CLUSTERS / "virtual_8.yaml", num_microbatches=2)
    state, _ = train(w.state, w.batch)
    _, loss = hetpar.parallelize(w.step, like=train)(state, w.batch)
    _, ref_loss = jax.jit(w.step)(hetpar.gather(state), w.batch)
    assert_close(loss, ref_loss, "like= the step on its returned state")

    evaluate = hetpar.parallelize(lambda s, b: w.loss_fn(s.params, b), like=train)
    assert_close(evaluate(state, w.batch), jax.jit(w.loss_fn)(hetpar.gather(state).params, w.batch), "eval like=")
    assert 0 < evaluate.plan.predicted_step_time_s < train.plan.predicted_step_time_s
    assert sum(s.flops for s in evaluate.plan.stages) < sum(s.flops for s in train.plan.stages) / 2
