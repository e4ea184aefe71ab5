"""Random LoRA adapters in PEFT's folder format (``adapter_config.json`` and
``adapter_model.safetensors``) for a model's shapes, dummy models included:
the benchmarks' adapters (W8, ``bench.one_batch --lora-adapters``), where
no trained adapter of that model is at hand.

    python -m radixserve.bench.lora_adapters --model-path llama-3.1-8b --count 8 --rank 16 --dest adapters

writes ``adapters/lora0`` .. ``lora7`` and prints their
``--lora-paths`` entries (``lora0=adapters/lora0 ...``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from radixserve.lora.options import SUPPORTED_MODULES


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of each PEFT module of a Llama-family layer (``config``: a ModelConfig)."""
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def write_random_adapter(folder: str, config, rank: int, *, alpha: float | None = None,
                         modules: tuple[str, ...] = SUPPORTED_MODULES, seed: int = 0, b_std: float = 0.01,
                         dtype: torch.dtype = torch.bfloat16) -> str:
    """Write one adapter of ``rank`` on ``modules`` of every layer into
    ``folder``. A is scaled so that ``x @ A.T`` keeps ``x``'s size and B's
    entries have ``b_std``: small by default, so a model's outputs move but
    stay finite. Returns ``folder``."""
    shapes = module_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for module in modules:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            weights[f"{name}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in**0.5).to(dtype)
            weights[f"{name}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * b_std).to(dtype)
    os.makedirs(folder, exist_ok=True)
    save_file(weights, os.path.join(folder, "adapter_model.safetensors"))
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
                   "lora_dropout": 0.0, "target_modules": sorted(modules), "bias": "none", "use_rslora": False,
                   "fan_in_fan_out": False, "base_model_name_or_path": None}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(peft_config, f, indent=1)
    return folder


def write_random_adapters(dest: str, config, count: int, rank: int, **kw) -> dict[str, str]:
    """``count`` adapters ``lora0``.. under ``dest`` (seeds 0..): ``{name: folder}``."""
    return {f"lora{i}": write_random_adapter(os.path.join(dest, f"lora{i}"), config, rank, seed=i, **kw)
            for i in range(count)}


def spread(manager, batch_size: int, count: int) -> tuple[list[str], list[int]] | None:
    """A static batch's adapters (``bench.one_batch``): request ``i`` takes
    ``lora{i % count}`` (written by :func:`write_random_adapters`) in slot
    ``i % count``, as ``ModelWorkerBatch.lora_ids`` and ``lora_slots``; None for no adapter."""
    if not count:
        return None
    slots = [i % count for i in range(batch_size)]
    return [manager.resolve(f"lora{s}") for s in slots], slots


def server_options(model_config, counts: list[int], rank: int) -> dict:
    """ServerArgs options that serve ``max(counts)`` random adapters of
    ``rank`` (``bench.one_batch --lora-adapters``), written to a temporary
    folder removed at exit."""
    import atexit
    import shutil
    import tempfile

    count = max(1, max(counts))
    folder = tempfile.mkdtemp(prefix="lora-adapters-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    paths = write_random_adapters(folder, model_config, count, rank)
    return dict(enable_lora=True, lora_paths=[f"{n}={p}" for n, p in paths.items()], max_loras_per_batch=count)


def main(argv: list[str] | None = None) -> None:
    from radixserve.model_loader import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="HF folder or dummy name")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--modules", nargs="+", default=list(SUPPORTED_MODULES), choices=SUPPORTED_MODULES)
    p.add_argument("--dest", required=True)
    args = p.parse_args(argv)
    config = resolve_model(args.model_path)
    paths = write_random_adapters(args.dest, config, args.count, args.rank, modules=tuple(args.modules))
    print(" ".join(f"{name}={path}" for name, path in paths.items()))


if __name__ == "__main__":
    main()
