"""Plans as files: they round-trip exactly, run to the same numbers, and a plan that
does not fit the step or the cluster, or a broken file, is refused with a reason."""

import json
import random
from pathlib import Path
from dataclasses import replace

import pytest

import hetpar
from hetpar.errors import PlanError
from hetpar.plan.file import PLAN_VERSION, load_plan, plan_from_dict, plan_to_dict, save_plan
from hetpar.plan.costs import estimate_plan, priced
from models import gpt, mlp
from parity import run_parity, with_grads
from solver.pipeline_sim import StageTimes, pipeline_time, simulate

TWO_TYPES = {"A100": 4, "V100": 4}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-stage, 4-microbatch GPT plan, made by parallelize and saved."""
    w = gpt.setup(batch_size=16)
    step = hetpar.parallelize(with_grads(w.loss_fn), cluster=hetpar.Cluster.virtual(TWO_TYPES), num_microbatches=4, num_layers=4)
    step(w.state, w.batch)
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    save_plan(step.plan, path)
    return w, step.plan, path


def test_plan_round_trips_exactly(saved):
    _, plan, path = saved
    assert load_plan(path) == plan
    assert plan.program is not None and plan.cluster_groups and plan.stages[0].forward_s > 0


def test_a_loaded_plan_computes_the_same_numbers(saved):
    w, plan, path = saved
    used = run_parity(w, None, plan=str(path))  # no cluster: the plan's own, on this process's devices
    assert used == plan


def test_a_plan_for_another_model_is_refused(saved):
    _, _, path = saved
    other = gpt.setup(batch_size=16, config=gpt.GPTConfig(n_layers=3))
    step = hetpar.parallelize(with_grads(other.loss_fn), plan=str(path))
    with pytest.raises(PlanError, match="different step: the plan's step takes"):
        step(other.state, other.batch)


def test_a_plan_for_another_cluster_is_refused(saved):
    w, _, path = saved
    step = hetpar.parallelize(with_grads(w.loss_fn), plan=str(path), cluster=hetpar.Cluster.virtual({"H100": 8}))
    with pytest.raises(PlanError, match=r"made for a cluster of 4xA100 \+ 4xV100; this cluster is 8xH100"):
        step(w.state, w.batch)


def _broken(path, edit):
    raw = json.loads(path.read_text())
    edit(raw)
    return raw


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.update(version=99), "version 99"),
        (lambda r: r["stages"][0].update(device_type="TPUv9"), "unknown device type 'TPUv9'"),
        (lambda r: r.update(num_microbatches=-2), r"num_microbatches: Input should be greater than or equal to 1 \(got -2\)"),
        (lambda r: r["cluster_groups"][0].update(devices=-4), r"cluster_groups\[0\]\.devices: .*\(got -4\)"),
        (lambda r: r["stages"][1].update(layer_start=r["stages"][1]["layer_start"] + 1), r"layer_end \d+ must be after layer_start|should start at layer"),
        (lambda r: r["stages"][0].pop("device_ids"), r"stages\[0\]\.device_ids: Field required"),
        (lambda r: r.update(schedule="zigzag"), "unknown schedule 'zigzag'; use one of gpipe, 1f1b, interleaved"),
        (lambda r: r["stages"][1].update(device_ids=[0]), "two stages share a device"),
    ],
)
def test_a_broken_plan_file_names_the_mistake(saved, tmp_path, edit, message):
    _, _, path = saved
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_broken(path, edit)))
    with pytest.raises(PlanError, match=message):
        load_plan(bad)


def test_a_truncated_plan_file_says_so(saved, tmp_path):
    _, _, path = saved
    bad = tmp_path / "cut.json"
    bad.write_text(path.read_text()[:200])
    with pytest.raises(PlanError, match="not valid JSON.*cut short"):
        load_plan(bad)


def test_plan_files_are_plain_json(saved):
    _, plan, _ = saved
    raw = plan_to_dict(plan)
    assert raw["version"] == PLAN_VERSION and json.loads(json.dumps(raw)) == raw


def test_the_step_time_of_a_plan_is_its_simulated_schedule(saved):
    _, plan, _ = saved
    # The planning pass priced the plan with the estimator; loading prices it again.
    assert plan.predicted_step_time_s == estimate_plan(plan).step_s > 0
    assert plan_from_dict(plan_to_dict(plan)).predicted_step_time_s == plan.predicted_step_time_s
    for schedule in ("gpipe", "1f1b"):
        p = priced(replace(plan, schedule=schedule))
        assert p.predicted_step_time_s == simulate([s.times for s in p.stages], p.num_microbatches, schedule).step_s


def test_an_edited_figure_in_a_plan_file_changes_nothing(saved, tmp_path):
    """Predicted figures in a file are a cache of the estimator's: a view prices the
    plan again from its cost inputs and decisions."""
    _, plan, _ = saved
    raw = plan_to_dict(plan)
    assert raw["estimator_version"] >= 1 and raw["cost_inputs"]["layers"]
    raw["predicted_step_time_s"] = 123.0
    raw["stages"][0]["forward_s"] = 7.0
    raw["stages"][0]["memory_bytes"] = 1
    loaded = plan_from_dict(raw)
    assert loaded.predicted_step_time_s == plan.predicted_step_time_s
    assert loaded.stages[0].forward_s == plan.stages[0].forward_s and loaded.stages[0].memory_bytes == plan.stages[0].memory_bytes


def test_a_plan_without_cost_inputs_is_shown_unpriced(saved):
    _, plan, _ = saved
    raw = plan_to_dict(plan)
    del raw["cost_inputs"]
    loaded = plan_from_dict(raw)
    assert loaded.predicted_step_time_s == 0 and all(s.forward_s == 0 and s.memory_bytes == 0 for s in loaded.stages)


def test_a_broken_cost_input_is_named(saved):
    _, plan, _ = saved
    raw = plan_to_dict(plan)
    raw["cost_inputs"]["layers"][1]["flops"] = "many"
    with pytest.raises(PlanError, match=r"cost_inputs\.layers\.1\.flops"):
        plan_from_dict(raw)


def test_gpipe_closed_form_matches_the_simulation():
    for trial in range(200):
        rnd = random.Random(trial)
        stages = [
            StageTimes(rnd.uniform(0.2, 2), rnd.uniform(0.2, 4), rnd.choice([0, 0.1, 3]), rnd.uniform(0, 1), rnd.uniform(0, 1))
            for _ in range(rnd.randint(1, 6))
        ]
        m = rnd.randint(1, 24)
        simulated = simulate(stages, m, "gpipe").step_s
        closed = pipeline_time(stages, m, "gpipe")
        # Exact up to the tail: the closed form adds the slowest stage's sync and
        # optimizer to the end of the pipeline; a stage that drains earlier may hide them.
        assert simulated <= closed + 1e-9 and closed - simulated <= max(s.sync_s + s.optimizer_s for s in stages) + 1e-9


def test_one_f_one_b_closed_form_is_close_on_balanced_pipelines():
    for trial in range(100):
        rnd = random.Random(trial)
        stages = [StageTimes(f := rnd.uniform(0.95, 1.05), 2 * f, 0.01) for _ in range(rnd.randint(2, 6))]
        m = rnd.randint(4, 32)
        simulated = simulate(stages, m, "1f1b").step_s
        assert pipeline_time(stages, m, "1f1b") == pytest.approx(simulated, rel=0.02)


def test_one_f_one_b_keeps_fewer_microbatches_in_flight():
    stages = [StageTimes(1.0, 2.0) for _ in range(4)]

    def peak_in_flight(schedule):
        sim = simulate(stages, 8, schedule)
        live, peak = 0, 0
        for e in sorted((e for e in sim.events if e.lane == "stage 0"), key=lambda e: e.start_s):
            live += 1 if e.kind == "forward" else -1
            peak = max(peak, live)
        return peak

    assert peak_in_flight("gpipe") == 8 and peak_in_flight("1f1b") == 4


def test_mlp_plan_round_trips_with_three_stages(tmp_path):
    w = mlp.setup(batch_size=16, depth=4)
    step = hetpar.parallelize(w.step, cluster=hetpar.Cluster.virtual({"H100": 2, "A100": 2, "V100": 4}), num_microbatches=2, num_stages=3, num_layers=4)
    step(w.state, w.batch)
    save_plan(step.plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == step.plan and step.plan.num_stages == 3


def test_plans_predict_memory_by_schedule():
    w = gpt.setup(batch_size=16)
    cluster = hetpar.Cluster.from_file(str(Path(__file__).parents[1] / "examples" / "clusters" / "virtual_8.yaml"))
    memory = {}
    for schedule in ("gpipe", "1f1b"):
        plan = hetpar.make_plan(w.step, (w.state, w.batch), cluster, num_microbatches=8, num_stages=2, num_layers=4, schedule=schedule)
        assert all(0 < s.memory_bytes < s.memory_capacity for s in plan.stages)
        memory[schedule] = plan.stages[0].memory_bytes
    assert memory["1f1b"] < memory["gpipe"]  # the first stage keeps 2 microbatches, not 8


def test_a_model_that_fits_no_memory_is_refused_with_the_numbers(tmp_path):
    import jax

    config = gpt.GPTConfig(n_layers=4, d_model=1024, n_heads=16, seq_len=2048, vocab_size=32000)
    built = {}

    def build():
        w = gpt.setup(batch_size=256, config=config)
        built["step"] = w.step
        return w.state, w.batch

    args = jax.eval_shape(build)  # abstract: nothing is allocated here
    (tmp_path / "c.yaml").write_text("groups:\n  - name: l4\n    device: L4\n    nodes: 1\n    devices_per_node: 2\n")
    cluster = hetpar.Cluster.from_file(str(tmp_path / "c.yaml"))
    with pytest.raises(PlanError, match=r"does not fit in memory: stage \d needs .* GiB per L4, which has 24 GiB.*1f1b"):
        hetpar.make_plan(built["step"], args, cluster, num_microbatches=2, num_stages=2)
