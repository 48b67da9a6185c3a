"""The paper-form transformer's memory against Korthikanti et al. (2022)'s activation
formulas: s b h (34 + 5 a s / h) per layer kept for the backward (sequence parallel:
all of it split t ways), 34 s b h with the score-sized values gone (fused attention or
selective recomputation), 2 s b h per layer under full recomputation, on every stage."""

from __future__ import annotations

import pytest

from solver.collectives import LinkCost
from solver.cost.estimate import Decisions, StageDecision, estimate
from solver.cost.problem import DeviceKind, Problem
from solver.transformer import Transformer

GIB = 2**30
KIND = DeviceKind("gpu", 64, 8, 1e14, 10_000 * GIB, 2e12, LinkCost(200e9, 2e-6), LinkCost(25e9, 5e-6))
S, H, A, L = 2048, 4096, 32, 8
MODEL = Transformer(layers=L, hidden=H, heads=A, seq=S, vocab=32000)


def _activations(model: Transformer, b: int, tp: int, remat: str = "", pp: int = 1, m: int = 1, checkpoints=True) -> list:
    problem = Problem(model.layer_costs(), (KIND,), b * m, layer_checkpoints=checkpoints)
    per = L // pp
    stages = tuple(StageDecision("gpu", 1, tp, p * per, (p + 1) * per, remat=remat) for p in range(pp))
    cost = estimate(problem, Decisions(stages, m, "1f1b", (b * m,)))
    return [c.memory.activations for c in cost.stages], cost


@pytest.mark.parametrize("attention, selective, per_layer", [
    ("naive", False, lambda b: S * b * H * (34 + 5 * A * S / H)),
    ("flash", False, lambda b: 34 * S * b * H),
    ("naive", True, lambda b: 34 * S * b * H),
])
def test_no_recomputation_keeps_korthikantis_bytes(attention, selective, per_layer):
    model = Transformer(layers=L, hidden=H, heads=A, seq=S, vocab=32000, attention=attention, selective_recompute=selective)
    b, t = 2, 4
    assert model.saved_per_layer() == per_layer(1)
    (got,), _ = _activations(model, b, t)
    layers = model.layer_costs()
    logits = S * model.vocab * 4 * b / t
    working = 2 * max(x.largest_bytes for x in layers) * b / t
    assert got == pytest.approx(L * per_layer(b) / t + logits + working)


def test_fused_attention_keeps_no_scores_and_streams_less():
    flash = Transformer(layers=L, hidden=H, heads=A, seq=S, vocab=32000, attention="flash")
    (naive_mem,), naive = _activations(MODEL, 1, 1)
    (flash_mem,), fused = _activations(flash, 1, 1)
    assert naive_mem - flash_mem >= L * 5 * A * S * S  # at least the score-sized values
    # the same matmuls; what the unfused softmax and dropout stream through memory is gone
    assert fused.model_flops == naive.model_flops and fused.step_s < naive.step_s
    fwd, bwd = MODEL.elementwise_bytes()
    ffwd, fbwd = flash.elementwise_bytes()
    assert fwd - ffwd == pytest.approx(S * (4 * A * S * 2 + A * S)) and bwd - fbwd == pytest.approx(2 * (fwd - ffwd))


def test_selective_recomputation_trades_the_scores_for_the_core_rerun():
    selective = Transformer(layers=L, hidden=H, heads=A, seq=S, vocab=32000, selective_recompute=True)
    (plain_mem,), plain = _activations(MODEL, 1, 1)
    (sel_mem,), sel = _activations(selective, 1, 1)
    assert sel_mem < plain_mem and sel.stages[0].backward_s > plain.stages[0].backward_s
    assert sel.stages[0].forward_s == pytest.approx(plain.stages[0].forward_s)
    assert sel.model_flops == plain.model_flops  # the rerun is not the model's work


def test_full_recomputation_keeps_each_layers_input_on_every_stage_the_last_included():
    b, t = 2, 8
    (kept,), cost = _activations(MODEL, b, t, remat="full")
    (plain,), _ = _activations(MODEL, b, t)
    layers = MODEL.layer_costs()
    inputs = sum(x.input_bytes for x in layers) * b / t  # 2 s b h per layer (the first's: token ids)
    one_layer = max(x.saved_bytes + 2 * x.largest_bytes for x in layers) * b / t
    assert kept == pytest.approx(inputs + one_layer)
    assert kept < plain / 3
    assert inputs == pytest.approx(((L - 1) * 2 * S * b * H + 4 * S * b) / t)
    # the stage's backward reruns its forward
    assert cost.stages[0].backward_s > _activations(MODEL, b, t)[1].stages[0].backward_s


def test_full_recomputation_holds_every_microbatch_in_flight():
    """1F1B: the first of four stages holds four microbatches' checkpoints, the last one."""
    mems, _ = _activations(MODEL, 1, 1, remat="full", pp=4, m=8)
    layers = MODEL.layer_costs()
    per = L // 4

    def expect(p: int, held: int) -> float:
        chunk = layers[p * per:(p + 1) * per]
        return held * sum(x.input_bytes for x in chunk) + max(x.saved_bytes + 2 * x.largest_bytes for x in chunk)

    assert mems[0] == pytest.approx(expect(0, 4))
    assert mems[3] == pytest.approx(expect(3, 1))


def test_hetpar_runtime_recomputation_reruns_the_stage():
    """Without layer checkpoints (hetpar's runtime) the last stage's program holds as
    much with recomputation as without (it reruns the whole stage at once)."""
    (kept,), _ = _activations(MODEL, 1, 1, remat="full", checkpoints=False)
    (plain,), _ = _activations(MODEL, 1, 1, checkpoints=False)
    assert kept == pytest.approx(plain)


def test_unknown_attention_kind_is_named():
    with pytest.raises(ValueError, match="flash"):
        Transformer(layers=1, hidden=8, heads=1, seq=4, vocab=4, attention="fast")


def test_without_sequence_parallelism_norms_and_dropouts_run_whole_on_every_device():
    replicated = Transformer(layers=L, hidden=H, heads=A, seq=S, vocab=32000, sequence_parallel=False)
    assert 0 < replicated.elementwise_split() < 1 and MODEL.elementwise_split() == 1
    for tp, slower in ((1, False), (8, True)):
        sp = _activations(MODEL, 1, tp)[1].stages[0].forward_s
        whole = _activations(replicated, 1, tp)[1].stages[0].forward_s
        assert (whole > sp * 1.001) == slower and whole >= sp
