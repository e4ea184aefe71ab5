"""Tokens per expert per step, as the figures of a Prometheus histogram.

The model counts on the device (``layer.ExpertLoad``); when the scheduler
reports its stats (every half second while busy), :class:`ExpertLoadHistogram`
reads the counts once, and for every (MoE layer, expert) observes the tokens
it received per forward pass since the last read. The histogram's figures are
cumulative scalars (``moe_expert_tokens_le_<bound>``, ``..._sum``,
``..._count``), so replicas add up and a report read twice counts nothing twice.
A hot expert shows as observations in the top buckets while most sit low.
"""

from __future__ import annotations

# upper bounds of the buckets: tokens one expert of one layer received per forward pass
BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREFIX = "moe_expert_tokens"


def bucket_key(bound: float) -> str:
    return f"{PREFIX}_le_{'inf' if bound == float('inf') else int(bound)}"


class ExpertLoadHistogram:
    """Cumulative histogram of tokens per expert per step (module docstring)."""

    def __init__(self):
        self.bounds = (*BUCKETS, float("inf"))
        self.buckets = [0] * len(self.bounds)  # cumulative: observations <= bound
        self.total = 0.0
        self.count = 0
        self._counts: list[list[int]] | None = None
        self._steps = 0

    def update(self, counts: list[list[int]], steps: int) -> dict[str, float]:
        """Observe what ``counts`` (per layer and expert, since start) and
        ``steps`` (forward passes since start) add to the last read; the figures."""
        previous, self._counts = self._counts, counts
        new_steps, self._steps = steps - self._steps, steps
        if new_steps > 0:
            for layer, row in enumerate(counts):
                for expert, total in enumerate(row):
                    self._observe((total - (previous[layer][expert] if previous else 0)) / new_steps)
        return self.figures()

    def _observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.buckets[i] += 1

    def figures(self) -> dict[str, float]:
        out = {bucket_key(b): n for b, n in zip(self.bounds, self.buckets)}
        out[f"{PREFIX}_sum"] = self.total
        out[f"{PREFIX}_count"] = self.count
        return out
