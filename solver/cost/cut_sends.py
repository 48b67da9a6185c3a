"""Seconds to move one microbatch's activation across each cut of a pipeline, between
two stages (`StageCosts.sends`).

What crosses a cut depends on the two stages only through their kinds (the link
between them), the data-parallel slices sending side by side (`streams`) and how
many of them share a node's link (`flows`), and the microbatch: stages alike in
those send alike, so each such send is priced once, however many stage shapes ask
(the search asks for hundreds of pairs, half of them alike). Where both stages are one
host's cores the measured copies (`MeasuredLayer` points' `send_s`) depend on the
receiving stage itself, priced per pair.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from solver.cost.stage_config import StageConfig

StageCosts = Any  # solver.cost.stage_costs.StageCosts, which builds on this module (so not imported here)
INF = float("inf")


class CutSends:
    """The sends of one problem's stage pairs, cached per pair and per alike send."""

    def __init__(self, costs: StageCosts):
        self.costs = costs
        self.sends = lru_cache(maxsize=None)(self._sends_uncached)
        self._link_sends = lru_cache(maxsize=None)(self._link_sends_uncached)

    def least_between(self, configs: Sequence[StageConfig], b: int) -> np.ndarray:
        """[a, c]: the least of `sends(a, c, b)` over the cuts between layers (none
        before the first or after the last) for every ordered pair of `configs`: what
        every cut between two stages costs at the least, for the planner's bounds. One
        array pass (they price every pair of a microbatch size's layouts: thousands, a
        Python call each cost a solve on 64 GPUs of three kinds some 5%), each link
        priced once; the time only grows with the bytes (each operation rounds
        monotonically), so a link's least is the least input's. Pairs of two hosts'
        cores, whose measured copies replace the link's time, are read from their sends."""
        kinds, inputs = self.costs.kinds, self.costs.inputs
        count = len(configs)
        if len(inputs) < 2:
            return np.zeros((count, count))
        dp, tp = np.array([c.dp for c in configs]), np.array([c.tp for c in configs])
        streams = np.minimum(dp[:, None], dp[None, :])
        per_node = np.array([kinds[c.kind].devices_per_node for c in configs]) // tp
        flows = np.minimum(streams, np.maximum(1, per_node)[:, None])
        names = sorted({c.kind for c in configs})
        kind = np.array([names.index(c.kind) for c in configs])
        # each pair's link, its sender's kind, receiver's kind and flows as one number: each distinct one priced once
        span = int(flows.max()) + 1
        keys, where = np.unique((kind[:, None] * len(names) + kind[None, :]) * span + flows, return_inverse=True)
        links = [self.costs.problem.link(names[k // span // len(names)], names[k // span % len(names)]).per_flow(k % span)
                 for k in keys.tolist()]
        latency = np.array([link.latency for link in links])[where].reshape(count, count)
        bandwidth = np.array([link.bandwidth for link in links])[where].reshape(count, count)
        out = latency + inputs[1:].min() * b / streams / bandwidth
        shared = np.array([kinds[c.kind].shared_host for c in configs])
        for a, c in zip(*np.nonzero(shared[:, None] & shared[None, :])):
            out[a, c] = self.sends(configs[a], configs[c], b)[1 : len(inputs)].min()
        return out

    def _sends_uncached(self, a: StageConfig, c: StageConfig, b: int) -> np.ndarray:
        """Per cut before layer j, from stage `a` to the next stage `c` (read-only; INF after the last layer)."""
        kinds = self.costs.kinds
        streams = min(a.dp, c.dp)
        # The slices of a node send side by side: a shared NIC (or host memory) is divided among them.
        flows = min(streams, max(1, kinds[a.kind].devices_per_node // a.tp))
        if not (kinds[a.kind].shared_host and kinds[c.kind].shared_host):
            return self._link_sends(a.kind, c.kind, flows, streams, b)
        # One host's cores do the copy: what the profile measured it costs the host to hand
        # layer j its input on the receiving stage's mesh (a copy per shard and a dispatch,
        # `MeasuredLayer` points' `send_s`) where it measured one, the link's bytes elsewhere.
        out = self._link_sends(a.kind, c.kind, flows, streams, b)[:-1].copy()
        for layer, price in self.costs.measured(c, b / c.dp).items():
            if price.send_s > 0:
                out[layer] = price.send_s
        out = np.concatenate([out, [INF]])  # no cut after the last layer
        out.setflags(write=False)
        return out

    def _link_sends_uncached(self, a_kind: str, c_kind: str, flows: int, streams: int, b: int) -> np.ndarray:
        """The link's time for each cut's bytes: `streams` slices' parts, `flows` of them on one node's link."""
        costs = self.costs
        link = costs.problem.link(a_kind, c_kind).per_flow(flows)
        out = np.concatenate([link.latency + costs.inputs * b / streams / link.bandwidth, [INF]])  # no cut after the last layer
        out.setflags(write=False)
        return out
