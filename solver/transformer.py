"""Layer costs of a decoder-only transformer that exists only on paper.

The planner's benchmarks plan models far larger than this machine could trace, so
their costs come from the standard counts: per sequence of `s` tokens and hidden
size `h`, a block's forward is 2 x (its parameters) x s FLOPs for the matmuls plus
4 s^2 h for attention scores; the backward is twice the forward. Activations kept
for the backward follow Korthikanti et al. (2022), with sequence parallelism
(everything split over tensor-parallel devices). Embedding goes with the first
layer, the output projection and loss with the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from solver.planner.problem import LayerCost


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

    def layer_costs(self) -> tuple[LayerCost, ...]:
        s, h, a, v, w = self.seq, self.hidden, self.heads, self.vocab, self.bytes_per_value
        fwd = 2 * self.block_params() * s + 4 * s * s * h
        saved = s * h * (34 + 5 * a * s / h) / 2 * w  # the paper counts bytes at 2 per value
        hidden_bytes = s * h * w
        # Matmuls per forward: fused QKV, scores, context, output projection, and the MLP's.
        matmuls = 4 + (3 if self.gated else 2)
        block = LayerCost(3 * fwd, fwd, self.block_params() * w, saved, hidden_bytes, tp_bytes=2 * hidden_bytes, matmuls=matmuls)
        out = [block] * self.layers
        embed = v * h * w
        head_fwd = 2 * s * h * v
        out[0] = LayerCost(block.flops, block.forward_flops, block.param_bytes + embed, saved, s * 4, block.tp_bytes, matmuls=matmuls)
        out[-1] = LayerCost(block.flops + 3 * head_fwd, block.forward_flops + head_fwd, block.param_bytes + embed,
                            saved + s * v * 4, hidden_bytes, block.tp_bytes, matmuls=matmuls + 1)
        return tuple(out)


GPT3_175B = Transformer(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
LLAMA_140B = Transformer(layers=80, hidden=10240, heads=80, seq=4096, vocab=32000, ffn=49152, gated=True, kv_heads=8)
