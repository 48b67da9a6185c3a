"""The predictor: profiles round-trip, estimates follow the schedule and the hardware."""

from dataclasses import replace

import jax
import pytest

import hetpar
from hetpar.predict.calibrate import LayerSample, fit_scales
from hetpar.predict.compute import ComputeModel
from hetpar.predict.memory import in_flight, stage_memory
from hetpar.predict.profile import DeviceProfile, LayerWorkload, Profile, fit_affine, measure, profile_local
from hetpar.predict.timing import steady_times
from hetpar.predict.step import predict_step
from models import gpt


def test_affine_fit_recovers_rate_and_overhead():
    samples = [(f, 1e-4 + f / 5e10) for f in (1e6, 1e7, 1e8, 1e9)]
    rate, t0 = fit_affine(samples)
    assert rate == pytest.approx(5e10, rel=1e-6) and t0 == pytest.approx(1e-4, rel=1e-6)


def test_profile_measures_and_round_trips(tmp_path):
    profile = Profile({"cpu": measure(jax.devices()[:2], "cpu", sizes=(32, 64, 128))})
    entry = profile.devices["cpu"]
    assert entry.compute.calibrated and entry.compute.matmul_flops > 0 and entry.mesh_size == 2
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


def test_a_device_profile_grows_its_work_until_it_is_well_above_a_launch(monkeypatch, caplog):
    """A fast accelerator runs the default sizes within a launch (an H100: a 1024^3
    matmul and a 16 MiB copy in about 80 us), and rates fitted to launches are noise:
    the sizes double while the largest takes under `_ABOVE_LAUNCH` launches, up to a cap."""
    from hetpar.predict import profile as device_profile

    def matmul_sizes(above: float) -> list[int]:
        monkeypatch.setattr(device_profile, "_ABOVE_LAUNCH", above)
        flops = [f for f, _ in measure(jax.devices()[:1], "cpu", sizes=(32, 64)).matmul_samples]
        return [round((f / 2) ** (1 / 3)) for f in flops]

    monkeypatch.setattr(device_profile, "_LARGEST_MATMUL", 256)
    monkeypatch.setattr(device_profile, "_LARGEST_COPY", 1 << 23)
    with caplog.at_level("INFO", logger="hetpar.profile"):
        assert matmul_sizes(above=1e9) == [32, 64, 128, 256]  # never enough: up to the cap
    assert "copy of 32 MiB per device" in caplog.text
    assert matmul_sizes(above=0) == [32, 64]  # every timing is enough: the sizes asked for


def _samples(launch, matmul, vector, kernel, transpose):
    rows = [(3e-4, 2e-3, 1e-3, 40, 1e-4), (3e-4, 8e-3, 3e-3, 90, 4e-4), (4e-4, 0.0, 2e-3, 30, 0.0), (3e-4, 1e-2, 1e-3, 20, 2e-4),
            (5e-4, 0.0, 1e-4, 8, 0.0), (2e-4, 0.0, 2e-3, 40, 5e-4)]
    return [
        LayerSample(f"p{i}", launch * a + matmul * b + vector * c + kernel * k + transpose * t, a, b, c, k, t)
        for i, (a, b, c, k, t) in enumerate(rows)
    ]


def test_calibration_recovers_known_corrections():
    fitted = fit_scales(_samples(0.8, 1.3, 0.5, 2e-5, 4.5))
    assert fitted == pytest.approx((0.8, 1.3, 0.5, 2e-5, 4.5), rel=1e-6)


def test_calibration_never_goes_negative():
    samples = _samples(1.0, 1.0, 1.0, 0.0, 1.0)
    samples[1] = LayerSample("odd", 1e-4, 3e-4, 8e-3, 3e-3, 90, 4e-4)  # faster than its own launch: noise
    assert all(v >= 0 for v in fit_scales(samples))


def test_profile_times_a_models_layers_and_round_trips(tmp_path):
    from models import mlp

    w = mlp.setup(batch_size=8)
    profile = profile_local(mesh_size=2, layers=[LayerWorkload("mlp", w.step, (w.state, w.batch), num_layers=2)])
    entry = profile.devices["cpu"]
    names = {s.program for s in entry.layer_samples}
    assert {"fwd@stage0", "bwd@stage0", "fwd@stage1"} <= names  # each layer's forward and backward
    assert all(s.measured_s > 0 and s.matmul_s + s.vector_s > 0 for s in entry.layer_samples if "fwd" in s.program)
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


def test_shared_host_meshes_are_predicted_from_the_nearest_calibration(tmp_path):
    def model(rate):
        return ComputeModel("cpu", rate, 1e6, rate / 10, 1e10, 2e-5, 1e-4, calibrated=True, matmul_scale=rate / 1e10)

    two, eight = model(4e10), model(1e10)
    entry = DeviceProfile("cpu", 2, two, 1e-5, 1e9, shared_host=True, meshes=[(8, eight)])
    assert entry.model_for(2) == two and entry.model_for(8) == eight  # as calibrated, not scaled
    assert entry.model_for(1).matmul_flops == 2 * two.matmul_flops  # nearest: the 2-device calibration
    assert entry.model_for(16).matmul_flops == eight.matmul_flops / 2 and entry.model_for(16).matmul_scale == eight.matmul_scale
    assert replace(entry, shared_host=False).model_for(8) == two  # a GPU's devices do not share: one model
    Profile({"cpu": entry}).save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").devices["cpu"] == entry


def test_broken_profile_is_refused(tmp_path):
    (tmp_path / "p.json").write_text('{"version": 99, "devices": {}}')
    with pytest.raises(hetpar.HetparError, match="version 99"):
        Profile.load(tmp_path / "p.json")


def test_small_matmuls_run_below_peak():
    model = ComputeModel.from_catalog(hetpar.devices()[1])
    small, large = 1e6, 1e12
    assert small / model.op_time("dot_general", small, 0, 0) < 0.01 * model.matmul_flops
    assert large / model.op_time("dot_general", large, 0, 0) > 0.9 * model.matmul_flops


@pytest.fixture(scope="module")
def two_stage():
    w = gpt.setup(batch_size=16)
    cluster = hetpar.Cluster.virtual({"A100": 4, "V100": 4})
    step = hetpar.parallelize(w.step, cluster=cluster, num_stages=2, num_microbatches=4, num_layers=4)
    step(w.state, w.batch)
    return step, cluster, w


def test_step_prediction_splits_time_and_reports_figures(two_stage):
    step, cluster, w = two_stage
    p = predict_step(step.compiled(), step.plan, cluster, tokens=w.batch["tokens"].size)
    assert p.step_s == pytest.approx(p.compute_s + p.communication_s + p.bubble_s)
    assert p.bubble_s > 0 and p.communication_s > 0
    assert 0 < p.mfu < 1 and p.tokens_per_s > 0
    sequential = predict_step(step.compiled(), step.plan, cluster, concurrent=False)
    assert sequential.step_s > p.step_s  # stages that share cores cannot overlap
    # Data-parallel stages keep gradients as per-device partials across microbatches
    # (Program.stacked): their all-reduce is priced once per step, not per microbatch.
    stacked = [(prog, est) for prog, est in zip(step.compiled().programs, p.programs) if prog.stacked]
    assert stacked, "no stage accumulates partial gradients"
    for prog, est in stacked:
        assert est.finish_s > 0
        assert (est.communication_s == 0) == (prog.stacked == set(prog.task.reductions))


def test_activation_memory_follows_the_schedule(two_stage):
    step, cluster, _ = two_stage
    compiled, plan = step.compiled(), step.plan
    estimates = list(predict_step(compiled, plan, cluster).programs)
    capacity = {s.index: 80 * 2**30 for s in plan.stages}
    gpipe = stage_memory(compiled, plan, capacity, estimates, "gpipe")
    one_f = stage_memory(compiled, plan, capacity, estimates, "1f1b")
    remat = stage_memory(compiled, plan, capacity, estimates, "gpipe", remat="full")
    assert gpipe[0].activations > 0
    assert one_f[0].activations == gpipe[0].activations * 2 // 4  # 2 stages in flight of 4 microbatches
    assert remat[0].activations < gpipe[0].activations
    assert gpipe[0].parameters > 0 and gpipe[0].optimizer_state >= 2 * gpipe[0].parameters  # Adam's two moments
    assert all(m.fits for m in gpipe)
    assert in_flight("1f1b", 8, 3, 4) == 1 and in_flight("gpipe", 8, 3, 4) == 8


def test_steady_times_interleave_rounds_and_keep_the_least():
    """Every run takes its turn in every round (so all see the same moments of a busy
    host); per run the least; a short run repeats until the round's minimum time."""
    now, order = [0.0], []

    def scripted(name, durations):  # noqa: ANN001, ANN202
        it = iter(durations)

        def run():  # noqa: ANN202
            order.append(name)
            now[0] += next(it)
            return 0

        return run

    clock = lambda: now[0]  # noqa: E731
    runs = [scripted("a", [5, 3, 4]), scripted("b", [2, 7, 1])]
    assert steady_times(runs, repeats=1, rounds=2, warmup=1, clocks=[clock, clock], min_round_s=0) == [3, 1]
    assert order == ["a", "b", "a", "b", "a", "b"]
    short = scripted("c", [9, 1, 1, 0.5, 6])
    assert steady_times([short], repeats=1, rounds=1, warmup=1, clocks=[clock], min_round_s=2.5) == [0.5]  # 1 + 1 + 0.5


def _gpu_box(monkeypatch, kinds=("NVIDIA H100 80GB HBM3",)):
    """`Cluster.local()` on a machine with two GPUs of each of `kinds` and the host's
    CPU (JAX's devices stood in for: this machine has no GPU)."""
    from types import SimpleNamespace

    import hetpar.cluster.cluster as cluster

    gpus = [SimpleNamespace(platform="gpu", device_kind=k, id=i) for i, k in enumerate(k for k in kinds for _ in range(2))]
    cpu = SimpleNamespace(platform="cpu", device_kind="cpu", id=0)
    monkeypatch.setattr(cluster, "local_devices", lambda include_cpu=True: gpus + ([cpu] if include_cpu else []))


def test_a_profile_files_the_host_cpu_under_its_own_name_beside_named_gpus(monkeypatch):
    """`--device-type` names the accelerators; the host's CPU, profiled beside them only
    when asked, keeps its name (filed under theirs, its figures replaced the GPUs')."""
    from hetpar.errors import HetparError
    from hetpar.predict.profile import profiled_groups

    _gpu_box(monkeypatch)
    assert [(name, g.type_name, len(g.device_ids)) for name, g in profiled_groups()] == [("H100", "H100", 2)]
    assert [(name, g.type_name) for name, g in profiled_groups("H100-SXM", include_cpu=True)] == \
        [("H100-SXM", "H100"), ("cpu", "cpu")]
    _gpu_box(monkeypatch, ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"))
    assert [name for name, _ in profiled_groups(include_cpu=True)] == ["H100", "A100-80GB", "cpu"]
    with pytest.raises(HetparError, match="has 2: H100, A100-80GB; leave it out"):
        profiled_groups("H100")


def test_on_a_cpu_machine_the_device_type_names_the_cpu():
    from hetpar.predict.profile import profiled_groups

    assert [name for name, _ in profiled_groups("A100")] == ["A100"]  # the README's stand-in on CPU devices
    assert [name for name, _ in profiled_groups()] == ["cpu"]
