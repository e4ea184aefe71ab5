"""The benchmark clients (docs/benchmarks.md), and what several share. The
HTTP clients (``bench.serving``) import no torch: nothing here does at import."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


SOURCE_SUFFIXES = (".py", ".c", ".h", ".json")  # code, and the kernels' tuned tables


@functools.cache
def source_fingerprint(root: Path | None = None) -> str:
    """Twelve hex digits of a hash over the sources under ``root`` (this
    radixserve package by default): their paths and bytes, the tuned tables
    included. Recorded with a benchmark's figures, it tells which tree ran
    each of an A/B's sides, also for two copies of the code side by side
    that no git metadata describes (a ``git archive`` of the tree before)."""
    root = Path(__file__).resolve().parent.parent if root is None else Path(root)
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts and path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]
