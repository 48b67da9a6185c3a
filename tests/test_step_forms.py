"""Steps in the forms users write them: any state pytree, markers, nnx, refusals."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hetpar
from parity import assert_close

CLUSTER = {"A100": 4, "V100": 4}


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = nn.relu(nn.Dense(16, name=f"Block_{i}")(x))
        return nn.Dense(4, name="head")(x)


def _data(batch=16):
    x = jax.random.normal(jax.random.key(1), (batch, 8))
    y = jax.random.normal(jax.random.key(2), (batch, 4))
    return {"x": x, "y": y}


def _compare(step, state, batch, steps=3, **options):
    reference = jax.jit(step)
    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(CLUSTER), **options)
    ref_state = par_state = state
    for i in range(steps):
        ref_state, ref_out = reference(ref_state, batch)
        par_state, par_out = parallel(par_state, batch)
        assert_close(par_out, ref_out, f"outputs, step {i}")
        assert_close(par_state, ref_state, f"state after step {i}")
    return parallel


def test_tuple_state_with_plain_optax():
    net, tx = _Net(), optax.sgd(0.1, momentum=0.9)
    batch = _data()
    params = net.init(jax.random.key(0), batch["x"])

    def step(state, batch):
        params, opt_state = state
        def loss_fn(p):
            return jnp.mean((net.apply(p, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    _compare(step, (params, tx.init(params)), batch, num_stages=2, num_microbatches=4, num_layers=4)


def test_nnx_split_state():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(3)])
            self.head = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            for block in self.blocks:
                x = jax.nn.tanh(block(x))
            return self.head(x)

    graphdef, params = nnx.split(Model(nnx.Rngs(0)))
    tx = optax.adam(1e-2, eps=1e-3)
    batch = _data()

    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    _compare(step, (params, tx.init(params)), batch, num_stages=2, num_microbatches=2)


def test_metrics_sum_and_max_combine():
    net = _Net()
    batch = _data()
    params = net.init(jax.random.key(0), batch["x"])

    def step(params, batch):
        def loss_fn(p):
            err = (net.apply(p, batch["x"]) - batch["y"]) ** 2
            return jnp.mean(err), (jnp.sum(err), jnp.max(err), jnp.min(err))

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), (loss, metrics)

    _compare(step, params, batch, num_stages=2, num_microbatches=4, num_layers=4)


def test_markers_average_over_microbatches():
    net = _Net()
    batch = _data()
    params = net.init(jax.random.key(0), batch["x"])

    def loss_fn(p, batch):
        return jnp.mean((net.apply(p, batch["x"]) - batch["y"]) ** 2)

    def marked(params, batch):
        loss, grads = hetpar.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    def plain(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    parallel = hetpar.parallelize(marked, cluster=hetpar.Cluster.virtual(CLUSTER), num_stages=2, num_microbatches=4, num_layers=4)
    ref_state, ref_loss = jax.jit(plain)(params, batch)
    par_state, par_loss = parallel(params, batch)
    assert_close(par_loss, ref_loss, "marked loss")
    assert_close(par_state, ref_state, "marked update")
    assert_close(jax.jit(marked)(params, batch), (ref_state, ref_loss), "marker is the identity outside hetpar")


def test_markers_weigh_uneven_replicas_by_their_share():
    net = _Net()
    batch = _data()
    params = net.init(jax.random.key(0), batch["x"])

    def loss_fn(p, batch):
        return jnp.mean((net.apply(p, batch["x"]) - batch["y"]) ** 2)

    def marked(params, batch):
        loss, grads = hetpar.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    def plain(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    cluster = hetpar.Cluster.virtual({"H100": 4, "V100": 4})
    parallel = hetpar.parallelize(marked, cluster=cluster, num_replicas=2, num_microbatches=2, num_layers=2)
    par_state, par_loss = parallel(params, batch)
    assert len(set(parallel.plan.replica_batch)) == 2  # uneven shares
    ref_state, ref_loss = jax.jit(plain)(params, batch)
    assert_close(par_loss, ref_loss, "marked loss over uneven replicas")
    assert_close(par_state, ref_state, "marked update over uneven replicas")


def test_batch_statistics_are_refused_with_the_fix():
    def step(w, batch):
        def loss_fn(w):
            h = batch["x"] @ w
            h = (h - h.mean(axis=0)) / (h.std(axis=0) + 1e-5)  # batch norm: mixes examples
            return jnp.mean(h**2)

        loss, g = jax.value_and_grad(loss_fn)(w)
        return w - 0.1 * g, loss

    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(CLUSTER), num_microbatches=2)
    with pytest.raises(hetpar.UnsupportedStepError, match="hetpar.value_and_grad"):
        parallel(jnp.ones((8, 4)), _data())


def test_batch_statistics_run_with_markers():
    def loss_fn(w, batch):
        h = batch["x"] @ w
        h = (h - h.mean(axis=0)) / (h.std(axis=0) + 1e-5)
        return jnp.mean(h**2)

    def step(w, batch):
        loss, g = hetpar.value_and_grad(loss_fn)(w, batch)
        return w - 0.1 * g, loss

    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(CLUSTER), num_microbatches=2)
    w = jax.random.normal(jax.random.key(3), (8, 4))
    batch = _data()
    new_w, loss = parallel(w, batch)
    halves = [jax.tree.map(lambda a: a[i * 8 : (i + 1) * 8], batch) for i in range(2)]
    parts = [jax.jit(jax.value_and_grad(loss_fn))(w, h) for h in halves]
    expected_loss = np.mean([float(loss) for loss, _ in parts])
    expected_w = w - 0.1 * (parts[0][1] + parts[1][1]) / 2
    assert_close(loss, expected_loss, "per-microbatch mean loss")
    assert_close(new_w, expected_w, "per-microbatch mean gradient")


def _batch_statistics_loss(w, batch):
    h = batch["x"] @ w
    return jnp.mean(((h - h.mean(axis=0)) / (h.std(axis=0) + 1e-5)) ** 2)


def _marked_step(w, batch):
    """A step whose microbatch work mixes examples: batch statistics under `hetpar.value_and_grad`."""
    loss, g = hetpar.value_and_grad(_batch_statistics_loss)(w, batch)
    return w - 0.1 * g, loss


def _plain_step(w, batch):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(w)
    return w - 0.1 * g, loss


def test_a_step_whose_microbatch_mixes_examples_gets_no_replicas_or_mixed_kind_stage():
    """Pipelines side by side each run a share of every microbatch, and a mixed-kind
    stage's parts their rows of it; batch statistics under `hetpar.value_and_grad`
    are taken over the whole microbatch, so the planner may choose neither there
    (a replica plan would take them over each share: a different loss; the runtime
    refuses a mixed stage: a value without a batch axis crossing into it), while a
    plain step's planning may."""
    from hetpar.pipeline import search_options
    from hetpar.options import StageOption
    from hetpar.trace.traced_step import trace_step

    args = (jnp.ones((8, 4)), _data())
    marked_options = search_options(trace_step(_marked_step, args, 1, 2), StageOption())
    plain_options = search_options(trace_step(_plain_step, args, 1, 2), StageOption())
    assert not marked_options.allow_mixed and not marked_options.allow_replicas
    assert plain_options.allow_mixed and plain_options.allow_replicas


def test_replicas_set_by_hand_on_a_step_whose_microbatch_mixes_examples_are_warned_of(caplog):
    """The planner keeps a `hetpar.value_and_grad` step to one pipeline (above); a user
    who asks for replicas gets them, each taking batch statistics over its own share of
    every microbatch (here a loss that differs from the per-microbatch one), and a
    warning that says so. A plain step's replicas compute what it does: no warning."""
    batch, w = _data(), jax.random.normal(jax.random.key(3), (8, 4))
    cluster = hetpar.Cluster.virtual(CLUSTER)
    with caplog.at_level(logging.WARNING, logger="hetpar.pipeline"):
        _, loss = hetpar.parallelize(_marked_step, cluster=cluster, num_microbatches=2, num_replicas=2)(w, batch)
    assert any("num_replicas=2 on a hetpar.value_and_grad step" in r.getMessage() for r in caplog.records)
    halves = [jax.tree.map(lambda a: a[i * 8 : (i + 1) * 8], batch) for i in range(2)]
    per_microbatch = np.mean([float(_batch_statistics_loss(w, h)) for h in halves])
    assert abs(float(loss) - per_microbatch) > 1e-6  # what the warning is about
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hetpar.pipeline"):
        hetpar.parallelize(_plain_step, cluster=cluster, num_microbatches=2, num_replicas=2)(w, batch)
    assert not any("num_replicas" in r.getMessage() for r in caplog.records)


def test_plans_are_cached_by_argument_shapes():
    net = _Net()
    batch = _data(16)
    params = net.init(jax.random.key(0), batch["x"])

    def step(params, batch):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((net.apply(p, batch["x"]) - batch["y"]) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss

    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.virtual(CLUSTER), num_microbatches=2)
    parallel(params, batch)
    parallel(params, _data(16))
    assert parallel.cache_size() == 1
    parallel(params, _data(32))
    assert parallel.cache_size() == 2


def test_cluster_from_file_runs_on_this_process_devices(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "groups:\n"
        "  - {name: fast, device: H100, nodes: 1, devices_per_node: 4}\n"
        "  - {name: slow, device: V100, nodes: 1, devices_per_node: 4}\n"
        "links:\n"
        "  - {between: [fast, slow], bandwidth: 12.5e9, latency: 1e-5}\n"
    )
    net = _Net()
    batch = _data()
    params = net.init(jax.random.key(0), batch["x"])

    def step(params, batch):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((net.apply(p, batch["x"]) - batch["y"]) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss

    parallel = hetpar.parallelize(step, cluster=hetpar.Cluster.from_file(str(path)), num_microbatches=2, num_stages=2, num_layers=4)
    ref = jax.jit(step)(params, batch)
    assert_close(parallel(params, batch), ref, "cluster-file plan")
    assert [s.device_type for s in parallel.plan.stages] == ["H100", "V100"]
