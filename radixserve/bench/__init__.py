"""The benchmark clients (docs/benchmarks.md), and what several share. The
HTTP clients (``bench.serving``) import no torch: nothing here does at import."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
