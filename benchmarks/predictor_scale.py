"""Predicted vs published throughput of large training runs, priced by the one estimator
(`solver.cost.estimate`) as hand-fixed plans: each row's published TP/PP/DP,
microbatch, global batch, schedule, recomputation and ZeRO stage, layers split evenly
as Megatron splits them, the paper-form transformer's costs (`solver.transformer`).

Rows: published figures only, with their source beside them. What a source does not
state is marked `assumed` in the row and printed.
- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (SC'21), Table 1 (weak scaling, 1.7B to 1T on Selene's
  A100 80GB, sequence 2048, vocabulary 51200): heads, hidden, layers, TP, PP, GPUs,
  global batch and achieved TFLOP/s per GPU, counted as the paper's Eq. (3) with
  activation recomputation (4 forwards per layer). Assumed: microbatch 1, full
  recomputation (the counted FLOPs include it), the non-interleaved 1F1B schedule.
  Megatron's runs of 2021-2022 (these, MT-NLG, BLOOM) are priced without sequence
  parallelism (norms and dropouts whole on every tensor-parallel device) and with
  unfused attention.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Tables 3 and 4 (A100 80GB, sequence 2048, vocabulary 51200, TP 8, DP 1,
  22B / 175B / 530B / 1T, iteration times with full recomputation and with selective
  recomputation and sequence parallelism ("present work"). Assumed: microbatch 1,
  1F1B, the full-recomputation baseline without sequence parallelism.
- Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B",
  Sec. 2.4 / 3 (DGX A100 80GB nodes on Selene): 105 layers, hidden 20480, 128 heads, sequence 2048, global batch 1920,
  TP 8, PP 35, on 280 / 350 / 420 DGX A100 80GB nodes: 60.1 / 50.2 / 44.4 s per
  iteration (126 / 121 / 113 TFLOP/s per GPU). Vocabulary 50272 and full
  recomputation as restated by llm-analysis (github.com/cli99/llm-analysis,
  examples/megatron-turing-nlg). Assumed: microbatch 1, 1F1B, no ZeRO. The figures
  are the paper's own (Eq. 3 of Narayanan et al., with recomputation: 60.1 s at 280
  nodes is 126 TFLOP/s per GPU under that count), but they come from a different
  software stack: Megatron's tensor parallelism under DeepSpeed's pipeline engine.
  For the same model, TP 8 / PP 35 and Selene, a microbatch slot (one forward and
  backward on one stage) took 60.1 s / (240 + 34) = 0.219 s here, against 0.172 s in
  Narayanan et al.'s Megatron run (dp 9, 280 microbatches) and 0.156 s in Korthikanti
  et al.'s (dp 1, 280 microbatches): the data-parallel all-reduce (0.3 s a step) and
  the bubble (priced) account for none of that, so these rows carry the engine's
  cost per microbatch (`Constants.deepspeed_s`, below).
- BigScience BLOOM-176B (train/tr11-176B-ml/chronicles.md in
  github.com/bigscience-workshop/bigscience, 2022-03-18 and 2022-03-30; BLOOM paper
  Sec. 3.4 for ZeRO stage 1): 384 A100 80GB, 70 layers, hidden 14336, 112 heads,
  sequence 2048, global batch 2048, microbatch 2, TP 4, PP 12, DP 8, 105.22 s per
  iteration = 149.02 TFLOP/s per GPU under Megatron's count with recomputation and the
  vocabulary padded to 250880. Fabric: Jean Zay's 4 x 100 Gb/s Omni-Path per node of 8.
  Megatron-DeepSpeed, so DeepSpeed's pipeline engine as in MT-NLG. Assumed: 1F1B.
- Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: Llama 3 405B (126 layers,
  hidden 16384, FFN 53248, 128 heads, 8 KV heads, vocabulary 128256, SwiGLU) on 8192
  and 16384 H100 80GB, TP 8, PP 16, DP 64 / 128, sequence 8192, 32 / 16 sequences per
  data-parallel group: 430 / 400 TFLOP/s per GPU. Fabric: 400 Gb/s RoCE per GPU.
  Assumed: microbatch 1, the interleaved schedule with 4 chunks, fused (flash)
  attention, full recomputation (without any, 8 layers of 8K-token activations on each
  of 16 stages do not fit 80 GB under Korthikanti's count), ZeRO-1-like sharding,
  TFLOP/s counted as 3 forwards (model FLOPs), data-parallel gradient reduction
  overlapped with the backward.

Cluster figures come from hetpar's device catalog (peaks, memory, bandwidth, NVLink);
Selene's fabric is 8 x 200 Gb/s HDR InfiniBand per DGX node (25 GB/s per GPU).
Every configuration is checked against its device's memory less the one fragmentation
headroom (`solver.memory.FRAGMENTATION_HEADROOM`); a row that does not fit is
reported as such.

Calibration: four constants, fitted on the rows marked `fit` (at most half), by least
squares on the log of the step-time ratio: the A100's and the H100's sustained
fraction of bf16 peak for large matmuls, the matmul size that reaches half of it
(`solver.efficiency`), and DeepSpeed's pipeline engine's fixed cost per microbatch
per stage (charged as a per-layer launch cost on the rows run by that engine, MT-NLG
and BLOOM; fitted on MT-NLG's 280-node row alone, so MT-NLG's other two rows and
BLOOM check it). The fraction of memory bandwidth the memory-bound operators reach is
fixed at 0.7, no longer fitted. The other rows are held out. How well the engine
constant is pinned down: fitted on BLOOM instead of MT-NLG's 280-node row it comes
out 61 ms instead of 49 ms, MT-NLG's three rows are then predicted 3-7% slow and the
held-out error is 3.2% median, 7.9% at most. It is the model's reading of the gap
between the two software stacks (an interpreter stepping through each microbatch's
instructions, blocking point-to-point calls), not a measurement of DeepSpeed.

Prints one line per row (published and predicted TFLOP/s per GPU under the source's
own count, so their ratio is the step-time ratio; predicted memory against the
device's), then
RESULT median_abs_err=<x> max_abs_err=<y> held_out_rows=<n> fitted_constants=<k> trend_ok=<0|1>
(errors of TFLOP/s per GPU as a fraction of the published, over held-out rows;
trend_ok: per GPU kind, the Spearman correlation of predicted and published TFLOP/s
over all its rows is at least 0.8).
Run: .venv/bin/python benchmarks/predictor_scale.py [--quick]  (--quick: no fit,
the constants below).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field

import numpy as np

from hetpar.cluster.catalog import device_type
from solver.collectives import LinkCost
from solver.cost.estimate import Decisions, PlanCost, StageDecision, estimate
from solver.cost.problem import DeviceKind, Problem
from solver.memory import FRAGMENTATION_HEADROOM
from solver.planner.manual import even_cuts
from solver.transformer import Transformer

SELENE_IB = LinkCost(25e9, 5e-6)  # per GPU: 8 x 200 Gb/s HDR per DGX A100 node
JEAN_ZAY_OPA = LinkCost(6.25e9, 5e-6)  # per GPU: 4 x 100 Gb/s Omni-Path per node of 8
META_ROCE = LinkCost(50e9, 5e-6)  # per GPU: 400 Gb/s RoCE
LAYER_OVERHEAD_S = 50e-6  # kernel launches of one layer's forward and backward (fixed, not fitted)


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200, **kw) -> Transformer:
    """A GPT of Megatron's 2021-2022 runs: sequence 2048, unfused attention, no sequence parallelism."""
    return Transformer(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=vocab, sequence_parallel=False, **kw)


@dataclass(frozen=True)
class Row:
    name: str
    model: Transformer
    gpus: int
    batch: int  # global, sequences
    tp: int
    pp: int
    microbatch: int
    published_tflops: float  # per GPU, under `count`
    count: str  # "recompute": 4 forwards per layer (Narayanan et al.'s Eq. 3); "model": 3 forwards
    source: str
    device: str = "A100-80GB"
    inter: LinkCost = SELENE_IB
    remat: str = "full"  # "full" (Megatron's activation checkpointing) or "" (none, or selective in the model)
    schedule: str = "1f1b"
    chunks: int = 1
    zero: int = 0
    overlap: bool = False  # the data-parallel gradient reduction overlaps the backward
    fit: bool = False
    assumed: str = ""
    stack: str = "megatron"  # "deepspeed": DeepSpeed's pipeline engine runs the pipeline (MT-NLG, BLOOM)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def config(self) -> str:
        schedule = f"{self.schedule}x{self.chunks}" if self.chunks > 1 else self.schedule
        remat = " remat" if self.remat else (" sel" if self.model.selective_recompute else "")
        return f"tp{self.tp} pp{self.pp} dp{self.dp} mb{self.microbatch} {schedule}{remat}" + (f" z{self.zero}" if self.zero else "")


def counted_flops(row: Row) -> float:
    """FLOPs per step as the row's source counts them: forwards of every layer, times 3
    (model FLOPs) or 4 (with recomputation; the output layer is never recomputed)."""
    layers = row.model.layer_costs()
    forward = sum(x.forward_flops for x in layers)
    head = 2 * row.model.seq * row.model.hidden * row.model.vocab
    per_sequence = 3 * forward if row.count == "model" else 4 * (forward - head) + 3 * head
    return per_sequence * row.batch


def from_step(row_model: Transformer, batch: int, gpus: int, step_s: float, count: str) -> float:
    """TFLOP/s per GPU of a published step time, under the source's count."""
    probe = Row("", row_model, gpus, batch, 1, 1, 1, 0.0, count, "")
    return counted_flops(probe) / step_s / gpus / 1e12


NARAYANAN = "Narayanan et al. 2021, Table 1"
KORTHIKANTI = "Korthikanti et al. 2022, Tables 3-4"
MT_NLG_SRC = "Smith et al. 2022, Sec. 2.4"
MT_NLG = gpt(105, 20480, 128, vocab=50272)
BLOOM = gpt(70, 14336, 112, vocab=250880)
LLAMA3_405B = Transformer(layers=126, hidden=16384, heads=128, seq=8192, vocab=128256, ffn=53248, gated=True, kv_heads=8,
                          attention="flash")
K22, K175, K530, K1T = gpt(48, 6144, 64), gpt(96, 12288, 96), gpt(105, 20480, 128), gpt(128, 25600, 160)
SEL = dict(selective_recompute=True, sequence_parallel=True)  # "present work": both of Korthikanti's techniques
N_ASSUMED = "microbatch 1, full recomputation, 1F1B"
K_ASSUMED = "microbatch 1, 1F1B, full-recomputation rows without sequence parallelism"
LLAMA_ASSUMED = "microbatch 1, interleaved x4, full recomputation, ZeRO-1, flash, model-FLOP count"


def _k(name: str, model: Transformer, gpus: int, batch: int, pp: int, step_s: float, selective: bool, fit: bool = False) -> Row:
    if selective:
        model = Transformer(**{**model.__dict__, **SEL})
    return Row(f"Korthikanti {name} {'selective' if selective else 'full'}", model, gpus, batch, 8, pp, 1,
               from_step(model, batch, gpus, step_s, "model"), "model", f"{KORTHIKANTI} ({step_s} s)",
               remat="" if selective else "full", fit=fit, assumed=K_ASSUMED)


ROWS: tuple[Row, ...] = (
    Row("Narayanan 1.7B", gpt(24, 2304, 24), 32, 512, 1, 1, 1, 137, "recompute", NARAYANAN, fit=True, assumed=N_ASSUMED),
    Row("Narayanan 3.6B", gpt(30, 3072, 32), 64, 512, 2, 1, 1, 138, "recompute", NARAYANAN, assumed=N_ASSUMED),
    Row("Narayanan 7.5B", gpt(36, 4096, 32), 128, 512, 4, 1, 1, 142, "recompute", NARAYANAN, fit=True, assumed=N_ASSUMED),
    Row("Narayanan 18.4B", gpt(40, 6144, 48), 256, 1024, 8, 1, 1, 135, "recompute", NARAYANAN, assumed=N_ASSUMED),
    Row("Narayanan 39.1B", gpt(48, 8192, 64), 512, 1536, 8, 2, 1, 138, "recompute", NARAYANAN, fit=True, assumed=N_ASSUMED),
    Row("Narayanan 76.1B", gpt(60, 10240, 80), 1024, 1792, 8, 4, 1, 140, "recompute", NARAYANAN, assumed=N_ASSUMED),
    Row("Narayanan 145.6B", gpt(80, 12288, 96), 1536, 2304, 8, 8, 1, 148, "recompute", NARAYANAN, fit=True, assumed=N_ASSUMED),
    Row("Narayanan 310.1B", gpt(96, 16384, 128), 1920, 2160, 8, 16, 1, 155, "recompute", NARAYANAN, assumed=N_ASSUMED),
    Row("Narayanan 529.6B", gpt(105, 20480, 128), 2520, 2520, 8, 35, 1, 163, "recompute", NARAYANAN, assumed=N_ASSUMED),
    Row("Narayanan 1008B", gpt(128, 25600, 160), 3072, 3072, 8, 64, 1, 163, "recompute", NARAYANAN, fit=True, assumed=N_ASSUMED),
    _k("22B", K22, 8, 4, 1, 1.42, False),
    _k("22B", K22, 8, 4, 1, 1.10, True, fit=True),
    _k("175B", K175, 64, 64, 8, 18.13, False),
    _k("175B", K175, 64, 64, 8, 13.75, True),
    _k("530B", K530, 280, 280, 35, 49.05, False, fit=True),
    _k("530B", K530, 280, 280, 35, 37.83, True),
    _k("1T", K1T, 512, 512, 64, 94.42, False),
    _k("1T", K1T, 512, 512, 64, 71.49, True, fit=True),
    Row("MT-NLG 530B, 280 nodes", MT_NLG, 2240, 1920, 8, 35, 1, from_step(MT_NLG, 1920, 2240, 60.1, "recompute"), "recompute",
        f"{MT_NLG_SRC} (60.1 s)", fit=True, assumed="microbatch 1, 1F1B", stack="deepspeed"),
    Row("MT-NLG 530B, 350 nodes", MT_NLG, 2800, 1920, 8, 35, 1, from_step(MT_NLG, 1920, 2800, 50.2, "recompute"), "recompute",
        f"{MT_NLG_SRC} (50.2 s)", assumed="microbatch 1, 1F1B", stack="deepspeed"),
    Row("MT-NLG 530B, 420 nodes", MT_NLG, 3360, 1920, 8, 35, 1, from_step(MT_NLG, 1920, 3360, 44.4, "recompute"), "recompute",
        f"{MT_NLG_SRC} (44.4 s)", assumed="microbatch 1, 1F1B", stack="deepspeed"),
    Row("BLOOM 176B, 384 GPUs", BLOOM, 384, 2048, 4, 12, 2, from_step(BLOOM, 2048, 384, 105.22, "recompute"), "recompute",
        "BigScience tr11 chronicles (105.22 s)", inter=JEAN_ZAY_OPA, zero=1, assumed="1F1B", stack="deepspeed"),
    Row("Llama 3 405B, 8192 H100", LLAMA3_405B, 8192, 64 * 32, 8, 16, 1, 430, "model", "Dubey et al. 2024, Table 4",
        device="H100", inter=META_ROCE, schedule="interleaved", chunks=4, zero=1, overlap=True, fit=True, assumed=LLAMA_ASSUMED),
    Row("Llama 3 405B, 16384 H100", LLAMA3_405B, 16384, 128 * 16, 8, 16, 1, 400, "model", "Dubey et al. 2024, Table 4",
        device="H100", inter=META_ROCE, schedule="interleaved", chunks=4, zero=1, overlap=True, assumed=LLAMA_ASSUMED),
)


@dataclass
class Constants:
    """The fitted constants (at most four, `names`) and the fixed ones."""

    a100: float = 0.74  # A100 sustained fraction of bf16 peak, large matmuls
    h100: float = 0.88  # H100's
    half_flops: float = 5e9  # a matmul of this many FLOPs runs at half the sustained rate (both kinds)
    # DeepSpeed's pipeline engine's fixed cost per microbatch per stage (forward and backward
    # together), seconds: its instruction interpreter and blocking point-to-point calls.
    deepspeed_s: float = 0.05  # (the defaults: the fit's start and --quick's values, its result rounded)
    bandwidth: float = 0.7  # fraction of memory bandwidth memory-bound operators reach (both kinds); fixed, not fitted
    names: tuple[str, ...] = field(default=("a100", "h100", "half_flops", "deepspeed_s"), repr=False)

    def vector(self) -> np.ndarray:
        return np.log([getattr(self, n) for n in self.names])

    @classmethod
    def of(cls, v: np.ndarray) -> "Constants":
        return cls(**dict(zip(cls().names, np.exp(v))))


def kind_of(row: Row, c: Constants) -> DeviceKind:
    spec = device_type(row.device)
    peak = spec.matmul_flops("bfloat16")
    efficiency = c.h100 if row.device.startswith("H100") else c.a100
    nvlink = LinkCost(spec.intra_node_link.bandwidth, spec.intra_node_link.latency)
    overhead = LAYER_OVERHEAD_S
    if row.stack == "deepspeed":
        # The engine's cost per microbatch and stage, spread over the layers of the fullest
        # stage: a layer's overhead falls 1/3 on its forward, 2/3 on its backward, and once
        # more 1/3 on the recomputed forward.
        passes = 4 / 3 if row.remat == "full" else 1.0
        overhead += c.deepspeed_s / (-(-row.model.layers // (row.pp * row.chunks)) * passes)
    return DeviceKind(row.device, row.gpus, 8, peak * efficiency, spec.memory_bytes, spec.memory_bandwidth * c.bandwidth,
                      nvlink, row.inter, overhead, peak, c.half_flops)


def predict(row: Row, c: Constants, simulate: bool = True) -> PlanCost:
    problem = Problem(row.model.layer_costs(), (kind_of(row, c),), row.batch, tokens_per_example=row.model.seq,
                      state_factor=8.0,  # bf16 parameters and gradients, fp32 master copy and Adam moments: 16 bytes a parameter
                      memory_reserve=FRAGMENTATION_HEADROOM, layer_checkpoints=True, overlap_comm=row.overlap)
    stages = row.pp * row.chunks
    n = len(problem.layers)
    cuts = even_cuts(n, stages)
    bounds = list(zip([0, *cuts], [*cuts, n]))
    b = row.microbatch * row.dp
    decisions = Decisions(tuple(StageDecision(row.device, row.dp, row.tp, i, j, row.remat, row.zero) for i, j in bounds),
                          row.batch // b, row.schedule, (row.batch,), row.chunks)
    return estimate(problem, decisions, simulate_step=simulate)


def predicted_tflops(row: Row, cost: PlanCost) -> float:
    return counted_flops(row) / cost.step_s / row.gpus / 1e12


def fit(rows: list[Row], start: Constants) -> Constants:
    from scipy.optimize import minimize

    def loss(v: np.ndarray) -> float:
        c = Constants.of(v)
        if not (0.05 < c.a100 <= 1 and 0.05 < c.h100 <= 1 and 1e-5 < c.deepspeed_s < 1 and 1e6 < c.half_flops < 1e13):
            return 1e9
        return sum(np.log(predicted_tflops(r, predict(r, c, simulate=False)) / r.published_tflops) ** 2 for r in rows)

    result = minimize(loss, start.vector(), method="Nelder-Mead", options={"maxfev": 160, "xatol": 1e-3, "fatol": 1e-6})
    return Constants.of(result.x)


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 2 else 1.0


def main() -> None:
    fitted_rows = [r for r in ROWS if r.fit]
    assert 2 * len(fitted_rows) <= len(ROWS), "fit on at most half of the rows"
    c = Constants() if "--quick" in sys.argv else fit(fitted_rows, Constants())
    catalog = Constants(device_type("A100-80GB").efficiency, device_type("H100").efficiency,
                        device_type("A100-80GB").matmul_half_flops, 0.0, 1.0)
    held, by_kind, overflows, unfitted = [], {}, [], []
    print(f"{'row':34s} {'config':34s} {'pub':>5s} {'pred':>5s} {'err':>7s} {'mem GiB':>8s} {'cap':>5s}  source [assumed]")
    for row in ROWS:
        cost = predict(row, c)
        pred = predicted_tflops(row, cost)
        err = pred / row.published_tflops - 1
        memory, capacity = cost.peak_memory_bytes / 2**30, cost.stages[0].capacity / 2**30
        if not cost.fits:
            overflows.append(row.name)
        if not row.fit:
            held.append(abs(err))
            unfitted.append(abs(predicted_tflops(row, predict(row, catalog, simulate=False)) / row.published_tflops - 1))
        by_kind.setdefault(row.device[:4], []).append((row.published_tflops, pred))
        print(f"{row.name:34s} {row.config():34s} {row.published_tflops:5.0f} {pred:5.0f} {err:+7.1%} {memory:8.1f} "
              f"{capacity:5.1f}{'' if cost.fits else ' OOM'}{' fit' if row.fit else '    '}  {row.source} [{row.assumed}]")
    trends = {k: spearman([p for p, _ in v], [q for _, q in v]) for k, v in by_kind.items()}
    print(f"fitted on {len(fitted_rows)} of {len(ROWS)} rows: A100 {c.a100:.3f} and H100 {c.h100:.3f} of bf16 peak, "
          f"half-rate matmul {c.half_flops:.3g} FLOPs, DeepSpeed's pipeline engine {c.deepspeed_s * 1e3:.1f} ms a microbatch "
          f"a stage; memory-bound operators at {c.bandwidth:.2f} of bandwidth (fixed)")
    print("Spearman (predicted vs published TFLOP/s per GPU) by kind: " + ", ".join(f"{k} {v:.2f} over {len(by_kind[k])} rows"
                                                                         for k, v in trends.items()))
    print(f"with the catalog's constants instead (efficiency, half-rate size, full bandwidth), held-out error: median "
          f"{statistics.median(unfitted):.3f}, max {max(unfitted):.3f}")
    print(f"memory: {len(ROWS) - len(overflows)} of {len(ROWS)} published configurations fit"
          + (f"; overflow: {', '.join(overflows)}" if overflows else ""))
    trend_ok = int(all(v >= 0.8 for k, v in trends.items() if len(by_kind[k]) > 2))
    print(f"RESULT median_abs_err={statistics.median(held):.3f} max_abs_err={max(held):.3f} held_out_rows={len(held)} "
          f"fitted_constants={len(c.names)} trend_ok={trend_ok}")


if __name__ == "__main__":
    main()
