"""The multi-process runtime on a real local Ray cluster (loopback only): two actors,
each a process with 4 CPU virtual devices; the same numbers as jax.jit, clear
failures, and no process left behind."""

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hetpar
from models import gpt
from parity import run_parity

TWO_TYPES = {"A100": 4, "V100": 4}
FAST_SLOW = {"H100": 4, "V100": 4}


@pytest.fixture(scope="module")
def ray_cluster():
    hetpar.init(num_cpus=2)
    import ray

    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes())  # loopback only
    yield
    hetpar.shutdown()


@pytest.fixture(scope="module")
def workload():
    return gpt.setup(batch_size=16, config=gpt.GPTConfig(n_layers=2))  # two blocks: a fraction of the compile time


@pytest.mark.parametrize(
    "options",
    [
        dict(cluster=TWO_TYPES, num_stages=2, num_microbatches=4, num_layers=2, schedule="1f1b"),
        # 12:4 batch split; 3 steps: each replica updates its own copy (Ray's from the arguments)
        dict(cluster=FAST_SLOW, num_replicas=2, num_microbatches=2, num_layers=2),
    ],
    ids=["1f1b", "uneven-replicas"],
)
def test_ray_runtime_parity(ray_cluster, workload, options):
    options = dict(options)
    cluster = hetpar.Cluster.virtual(options.pop("cluster"))
    plan = run_parity(workload, cluster, runtime="ray", **options)
    assert plan.num_stages == 2
    if plan.num_replicas == 2:
        assert plan.replica_batch == (12, 4)


def test_ray_mixed_stage_parity(ray_cluster, workload):
    """A mixed-kind stage on Ray: stage 1's parts on a V100 worker and a T4 worker, 5 + 3
    rows of each 8-example microbatch, parity with jax.jit."""
    from hetpar.plan.mixed import Part, mix_stage
    from parity import with_grads

    cluster = hetpar.Cluster.virtual({"A100": 2, "V100": 2, "T4": 2})
    plan = hetpar.make_plan(with_grads(workload.loss_fn), (workload.state, workload.batch), cluster, num_stages=2,
                            num_layers=2, num_microbatches=2)
    last = plan.stages[1]
    mixed = mix_stage(plan, 1, [Part(last.group, last.device_ids, 5), Part("T4", (4, 5), 3)])
    used = run_parity(workload, cluster, steps=3, runtime="ray", plan=mixed)  # every part updates its own copy
    assert [s.device_type for s in used.parts(1)] == ["V100", "T4"]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_worker_that_dies_mid_step_is_reported_quickly(ray_cluster, workload):
    import ray

    step = hetpar.parallelize(
        workload.step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, num_microbatches=4, num_layers=2, runtime="ray"
    )
    state, _ = step(workload.state, workload.batch)
    compiled = step.compiled()
    victim = compiled.workers[1]
    errors, finished = [], []

    def train():
        nonlocal state
        try:
            for _ in range(1000):
                state, _ = step(state, workload.batch)
        except hetpar.HetparError as e:
            errors.append(str(e))
        finished.append(time.monotonic())

    thread = threading.Thread(target=train)
    thread.start()
    time.sleep(1.0)
    killed = time.monotonic()
    ray.kill(victim)
    thread.join(timeout=90)
    assert finished and finished[0] - killed < 60, "the driver hung after a worker died"
    assert errors and "stage 1" in errors[0] and "died" in errors[0]
    step.shutdown()


def test_an_error_in_a_worker_reaches_the_driver_with_its_message(ray_cluster):
    driver = os.getpid()

    def step(w, batch):  # traces differently in any process but the driver's
        def loss_fn(w):
            y = batch["x"] @ w
            return jnp.mean(y**2) if os.getpid() == driver else jnp.mean(jnp.abs(y))

        loss, g = jax.value_and_grad(loss_fn)(w)
        return w - 0.1 * g, loss

    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_microbatches=2, runtime="ray")
    with pytest.raises(hetpar.HetparError, match=r"worker raised PlanError: stage \d+'s worker traced a different program"):
        parallel(jnp.ones((8, 4)), {"x": jnp.ones((16, 8))})
    parallel.shutdown()


def test_shutdown_leaves_no_worker_process(ray_cluster, workload):
    step = hetpar.parallelize(
        workload.step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, num_microbatches=2, num_layers=2, runtime="ray"
    )
    step(workload.state, workload.batch)
    pids = list(step.compiled().pids().values())
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    step.shutdown()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_ray_runtime_returns_host_arrays_the_caller_can_use(ray_cluster, workload):
    step = hetpar.parallelize(
        workload.step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, num_microbatches=2, num_layers=2, runtime="ray"
    )
    state, loss = step(workload.state, workload.batch)
    assert isinstance(loss, jax.Array) and np.isfinite(float(loss))
    step.shutdown()


def test_a_retry_after_a_worker_error_equals_jit(ray_cluster, workload):
    # Stage 1's worker raises at its last microbatch (1F1B) with partial values held;
    # the retry, and a step from another state, must not see any of them.
    from parity import assert_close, with_grads

    step = with_grads(workload.loss_fn)
    parallel = hetpar.parallelize(
        step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, num_microbatches=4, num_layers=2,
        schedule="1f1b", runtime="ray",
    )
    later, _, _ = parallel(workload.state, workload.batch)

    def sabotage(worker, fault_at):
        import dataclasses

        calls = [0]

        def wrap(fn):
            def faulty(acc, *args):
                calls[0] += 1
                if calls[0] == fault_at:
                    raise RuntimeError("injected fault")
                return fn(acc, *args)

            return faulty

        # The worker's `fault_at`-th call of a program's `fn` raises. The last stage calls
        # it for microbatches 1 and 2 only (its first starts the accumulators with
        # `first`, its last runs the fused update; no pre or second update program is
        # dispatched, compile/remade.py): the 2nd is microbatch 2.
        worker._saved = list(worker._programs)
        worker._programs = [p if p is None else dataclasses.replace(p, fn=wrap(p.fn)) for p in worker._programs]

    def restore(worker):
        worker._programs = worker._saved

    import ray

    victim = parallel.compiled().workers[1]
    ray.get(victim.__ray_call__.remote(sabotage, 2))
    with pytest.raises(hetpar.HetparError, match="RuntimeError: .*injected fault"):
        parallel(later, workload.batch)
    ray.get(victim.__ray_call__.remote(restore))
    reference = jax.jit(step)
    for state in (workload.state, later):  # first from another state than the failed step's
        ref_state, ref_loss, ref_grads = reference(jax.device_get(state), workload.batch)
        par_state, par_loss, par_grads = parallel(state, workload.batch)
        assert_close(par_loss, ref_loss, "loss after a failed step")
        assert_close(par_grads, ref_grads, "gradients after a failed step")
        assert_close(par_state.params, ref_state.params, "parameters after a failed step")
    parallel.shutdown()


def test_an_unpicklable_step_is_one_clear_error(ray_cluster):
    lock = threading.Lock()

    def step(w, batch):
        with lock:  # a lock cannot travel to another process
            loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - 0.1 * g, loss

    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_stages=2, runtime="ray")
    with pytest.raises(hetpar.HetparError, match="cannot be sent to the Ray workers.*module-level function") as info:
        parallel(jnp.ones((8, 4)), {"x": jnp.ones((16, 8))})
    assert "\n" not in str(info.value)


def test_per_example_outputs_and_dropout_bits_as_jit(ray_cluster):
    """Bits drawn for the whole batch, each microbatch its slice (on the worker that
    drew them), and a per-example output laid end to end from the microbatches'
    pieces on two workers: jax.jit's bits, bit for bit."""

    def step(key, x):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        y = jnp.where(keep, x, 0.0) * 2.0
        return jax.random.split(key)[0], (keep, y, jnp.sum(y))

    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(TWO_TYPES), num_microbatches=4, num_stages=2,
                                  runtime="ray")
    key, x = jax.random.key(3), jax.random.normal(jax.random.key(4), (16, 6))
    (new_key, (masks, y, total)), (ref_key, (ref_masks, ref_y, ref_total)) = parallel(key, x), jax.jit(step)(key, x)
    np.testing.assert_array_equal(np.asarray(masks), np.asarray(ref_masks))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref_y))
    np.testing.assert_allclose(np.asarray(total), np.asarray(ref_total), rtol=1e-6)
    np.testing.assert_array_equal(jax.random.key_data(new_key), jax.random.key_data(ref_key))
    assert len({row.tobytes() for row in np.asarray(masks).reshape(4, -1)}) == 4  # no microbatch reuses another's bits
    parallel.shutdown()
