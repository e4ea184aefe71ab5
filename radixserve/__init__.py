"""radixserve: an LLM inference and serving engine (continuous batching, a
radix KV cache over a paged pool, our own kernels)."""

import os

__version__ = "0.1.0"

# Triton 3.10 stops contracting a * b + c into one FMA unless told to (3.9
# warns that it will). Our kernels were checked and tuned with contraction on,
# as Triton has always compiled them; a user's own setting is kept.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def __getattr__(name: str):
    # Lazy: importing radixserve must not load torch-heavy modules.
    if name == "Engine":
        from radixserve.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
