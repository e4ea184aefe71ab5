"""Where radixserve keeps what it builds once per machine (converted GGUF
models, CPU kernels): ``$RADIXSERVE_CACHE_DIR`` or ``~/.cache/radixserve``."""

from __future__ import annotations

import os

CACHE_ENV = "RADIXSERVE_CACHE_DIR"


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")
