"""Layer costs of a decoder-only transformer that exists only on paper.

The planner's benchmarks plan models far larger than this machine could trace, so
their costs come from the standard counts: per sequence of `s` tokens and hidden
size `h`, a block's forward is 2 x (its parameters) x s FLOPs for the matmuls plus
4 s^2 h for attention scores; the backward is twice the forward. Embedding goes with
the first layer, the output projection and loss with the last.

Activations kept for the backward follow Korthikanti et al. (2022, "Reducing
Activation Recomputation in Large Transformer Models", Sec. 4), with sequence
parallelism (everything split over tensor-parallel devices): per layer and sequence,
s h (34 + 5 a s / h) bytes at 2 bytes a value, of which 5 a s^2 is the attention's
score-sized values (softmax output, dropout mask and output). Two things remove that
term: a fused attention kernel (`attention="flash"`: FlashAttention keeps only a
row statistic per query, never the s x s matrix) and Korthikanti's selective
recomputation (`selective_recompute`: the attention core is rerun in the backward,
adding its 4 s^2 h forward FLOPs to the backward). Full recomputation is a plan's
choice (a stage's `remat="full"`); with `Problem.layer_checkpoints` it keeps each
layer's input, 2 s h bytes per layer, as Megatron's does.
"""

from __future__ import annotations

from dataclasses import dataclass

from solver.planner.problem import LayerCost

ATTENTION_KINDS = ("naive", "flash")  # naive keeps the s x s scores for the backward; flash (fused) does not


@dataclass(frozen=True)
class Transformer:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int | None = None  # default 4h
    gated: bool = False  # SwiGLU: three ffn matrices instead of two
    kv_heads: int | None = None  # grouped-query attention
    bytes_per_value: int = 2  # bf16 weights and activations
    attention: str = "naive"  # ATTENTION_KINDS
    selective_recompute: bool = False  # Korthikanti's: the attention core's score-sized values rerun, not kept
    # Korthikanti's sequence parallelism: norms, dropouts and residual adds split over the tensor-parallel
    # devices along the sequence; False: each device runs them whole (their time; the activation count
    # here assumes it either way)
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention is one of {ATTENTION_KINDS}, got {self.attention!r}: "
                             "'flash' for a fused kernel that keeps no s x s scores, 'naive' for one that does")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    def block_params(self) -> int:
        h, kv = self.hidden, (self.kv_heads or self.heads)
        attention = 2 * h * h + 2 * h * (h * kv // self.heads)
        mlp = (3 if self.gated else 2) * h * self.ffn_size
        return attention + mlp + 2 * h

    def num_params(self) -> int:
        return self.layers * self.block_params() + 2 * self.vocab * self.hidden

    @property
    def keeps_scores(self) -> bool:
        """Whether a layer keeps its s x s attention values for the backward."""
        return self.attention == "naive" and not self.selective_recompute

    def saved_per_layer(self) -> float:
        """Bytes one layer keeps for its backward per sequence (Korthikanti et al.'s
        count at 2 bytes a value, before any tensor-parallel split):
        s h (34 + 5 a s / h), or 34 s h without the score-sized values."""
        s, h, a = self.seq, self.hidden, self.heads
        per_value = self.bytes_per_value / 2  # the paper counts at 2 bytes a value
        return s * h * (34 + (5 * a * s / h if self.keeps_scores else 0.0)) * per_value

    def elementwise_bytes(self) -> tuple[float, float]:
        """Bytes a layer's memory-bound operators move per sequence, forward and
        backward, with Megatron's fused kernels (scale-mask-softmax, bias-GeLU,
        bias-dropout-add): per token, two layer norms (read and write h values each),
        bias-GeLU (read and write the ffn width), two bias-dropout-adds (read two h,
        write one, a byte of mask per value): 2 x 2h + 2 ffn + 2 x 3h values (3 ffn
        gated) plus 2h mask bytes, 18h values for ffn = 4h; unfused attention adds its
        softmax (read the scores, write the probabilities) and dropout (read, write, a
        mask byte): 4 a s values + a s bytes per token. The backward moves about twice
        as much (each operator reads its input and the incoming gradient, writes one);
        selective recomputation reruns the softmax and dropout in it."""
        s, w = self.seq, self.bytes_per_value
        forward = s * (self._hidden_sized_bytes() + self.ffn_size * (3 if self.gated else 2) * w + self._attention_bytes())
        rerun = s * self._attention_bytes() if self.selective_recompute else 0.0
        return forward, 2 * forward + rerun

    def _hidden_sized_bytes(self) -> float:
        """Per token: two norms (read, write h), two bias-dropout-adds (read 2h, write h, a mask byte per value)."""
        return (2 * 2 * self.hidden + 2 * 3 * self.hidden) * self.bytes_per_value + 2 * self.hidden

    def _attention_bytes(self) -> float:
        """Per token: unfused softmax and dropout, 4 a s values and a s mask bytes."""
        a, s = self.heads, self.seq
        return (4 * a * s * self.bytes_per_value + a * s) if self.attention == "naive" else 0.0

    def elementwise_split(self) -> float:
        """The share of the elementwise bytes tensor parallelism splits: all under
        sequence parallelism; else only the ffn's and the attention heads'."""
        if self.sequence_parallel:
            return 1.0
        fwd, _ = self.elementwise_bytes()
        return 1.0 - self.seq * self._hidden_sized_bytes() / fwd

    def layer_costs(self) -> tuple[LayerCost, ...]:
        s, h, a, v, w = self.seq, self.hidden, self.heads, self.vocab, self.bytes_per_value
        core = 4 * s * s * h  # the attention's two score-sized matmuls, forward
        fwd = 2 * self.block_params() * s + core
        rerun = core if self.selective_recompute else 0.0  # Korthikanti: the core forward again, in the backward
        elementwise, bwd_elementwise = self.elementwise_bytes()
        split = self.elementwise_split()
        saved = self.saved_per_layer()
        hidden_bytes = s * h * w
        # the largest buffer a backward holds: the scores (a s^2 values) or the MLP's intermediate
        largest = max(self.ffn_size * s * w, a * s * s * w if self.attention == "naive" else 0.0)
        # Matmuls per forward: fused QKV, scores, context, output projection, and the MLP's.
        matmuls = 4 + (3 if self.gated else 2)
        block = LayerCost(3 * fwd, fwd, self.block_params() * w, saved, hidden_bytes, tp_bytes=2 * hidden_bytes,
                          matmuls=matmuls, largest_bytes=largest, recompute_flops=rerun, elementwise_bytes=elementwise, backward_elementwise_bytes=bwd_elementwise,
                          elementwise_split=split)
        out = [block] * self.layers
        embed = v * h * w
        head_fwd = 2 * s * h * v
        logits = s * v * 4  # fp32 logits for the loss
        out[0] = LayerCost(block.flops, block.forward_flops, block.param_bytes + embed, saved, s * 4, block.tp_bytes,
                           matmuls=matmuls, largest_bytes=largest, recompute_flops=rerun, elementwise_bytes=elementwise, backward_elementwise_bytes=bwd_elementwise,
                          elementwise_split=split)
        out[-1] = LayerCost(block.flops + 3 * head_fwd, block.forward_flops + head_fwd, block.param_bytes + embed,
                            saved + logits, hidden_bytes, block.tp_bytes, matmuls=matmuls + 1,
                            largest_bytes=max(largest, logits), recompute_flops=rerun, elementwise_bytes=elementwise, backward_elementwise_bytes=bwd_elementwise,
                          elementwise_split=split)
        return tuple(out)


GPT3_175B = Transformer(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
LLAMA_140B = Transformer(layers=80, hidden=10240, heads=80, seq=4096, vocab=32000, ffn=49152, gated=True, kv_heads=8)
