"""The published runs benchmarks/predictor_scale.py prices: enough of them, from
enough sources, at most half fitted, and every one fits its devices' memory under the
estimator (a configuration that trained must not be refused)."""

from __future__ import annotations

import pytest

from benchmarks import predictor_scale as scale


def test_the_table_is_wide_enough_and_fits_on_at_most_half():
    rows = scale.ROWS
    sources = {r.source.split(",")[0].split(" (")[0] for r in rows}
    assert len(rows) >= 12 and len(sources) >= 4
    assert {r.device for r in rows} >= {"A100-80GB", "H100"}
    assert 2 * sum(r.fit for r in rows) <= len(rows)
    params = [r.model.num_params() for r in rows]
    assert min(params) < 2e9 and max(params) > 9e11


@pytest.mark.parametrize("row", scale.ROWS, ids=lambda r: r.name)
def test_every_published_configuration_fits(row):
    cost = scale.predict(row, scale.Constants(), simulate=False)
    assert cost.fits, f"{row.name}: {cost.peak_memory_bytes / 2**30:.1f} GiB of {cost.stages[0].capacity / 2**30:.1f}"


def test_a_configuration_published_as_too_large_does_not_fit():
    """The 1T model at TP 8 / PP 64 without any recomputation: by Korthikanti et al.'s
    count the first stage's 64 microbatches in flight keep 2 layers x 64 x
    s h (34 + 5 a s / h) / 8 = 82 GB of activations, past an 80 GB A100."""
    row = next(r for r in scale.ROWS if r.name == "Korthikanti 1T full")
    from dataclasses import replace

    assert not scale.predict(replace(row, remat=""), scale.Constants(), simulate=False).fits


def test_the_pipeline_engine_cost_falls_on_deepspeed_rows_only():
    """`deepspeed_s` is charged once per microbatch per stage on rows DeepSpeed's
    pipeline engine ran, and leaves Megatron's rows as they were."""
    from dataclasses import replace

    without, with_ = scale.Constants(deepspeed_s=1e-9), scale.Constants(deepspeed_s=0.05)
    mtnlg = next(r for r in scale.ROWS if r.name.startswith("MT-NLG"))
    megatron = next(r for r in scale.ROWS if r.name == "Narayanan 529.6B")
    assert mtnlg.stack == "deepspeed" and megatron.stack == "megatron"
    assert scale.predict(megatron, with_, simulate=False).step_s == scale.predict(megatron, without, simulate=False).step_s
    slow, fast = scale.predict(mtnlg, with_, simulate=False), scale.predict(mtnlg, without, simulate=False)
    m = slow.decisions.num_microbatches
    # Every stage's forward plus backward grows by the engine's cost (its layers hold it all).
    for a, b in zip(slow.stages, fast.stages):
        assert abs((a.forward_s + a.backward_s) - (b.forward_s + b.backward_s) - 0.05) < 1e-6
    # and the 1F1B step by that much per slot: microbatches plus the bubble's stages - 1.
    assert abs(slow.step_s - fast.step_s - 0.05 * (m + mtnlg.pp - 1)) < 0.05 * mtnlg.pp
    assert scale.predict(replace(mtnlg, stack="megatron"), with_, simulate=False).step_s == pytest.approx(fast.step_s, rel=1e-6)
