"""radixserve: an LLM inference and serving engine (continuous batching, a
radix KV cache over a paged pool, our own kernels)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing radixserve must not load torch-heavy modules.
    if name == "Engine":
        from radixserve.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
