"""Weights as ``(hf_name, tensor)`` streams: from safetensors files, or random.

Model classes consume these through ``load_weights(weights)``; streaming one
tensor at a time keeps peak host memory near the size of the largest tensor.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator

import torch
from safetensors import safe_open

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    """The ``*.safetensors`` files holding a checkpoint's weights, in order.

    A sharded checkpoint's index decides which files belong to it (so stray
    extra files such as ``consolidated.safetensors`` are ignored).
    """
    index_path = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(_no_weights_message(folder))
    return [os.path.join(folder, n) for n in names]


def _no_weights_message(folder: str) -> str:
    found = sorted(os.listdir(folder))
    others = [n for n in found if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".gguf"))]
    hint = (
        f" It has {', '.join(others)}: only .safetensors weights are supported"
        " (pass a .gguf file itself as the model path)."
        if others
        else ""
    )
    listing = ", ".join(found[:20]) + (" ..." if len(found) > 20 else "")
    return f"no *.safetensors weights in {folder} (found: {listing or 'nothing'}).{hint}"


def iter_safetensors(
    folder: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every ``(name, tensor)`` of the checkpoint in ``folder``.

    Tensors are read onto ``device`` and cast to ``dtype`` when one is given;
    otherwise they keep their stored dtype.
    """
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device=str(device)) as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor if dtype is None else tensor.to(dtype)


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Give every parameter of ``model`` reproducible random values, in place.

    Matrices and embeddings get N(0, std); norm weights get 1 + N(0, std) so
    activations keep their scale through many layers; biases get N(0, std).
    Values are generated on each parameter's own device, so nothing crosses
    the host-device link.

    Each parameter draws from a generator seeded by ``seed`` and its name,
    so its values do not depend on which other parameters the model holds:
    a pipeline stage's layers (``model.layers.{i}``, i global) get the
    values they have in the whole model. A tensor-parallel shard (a
    parameter with ``checkpoint_shards``, see ``layers/linear.py``) draws
    the whole checkpoint tensor and keeps its part through its
    ``weight_loader``: every tp and pp size gets the same model.
    """
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(seed << 32 | zlib.crc32(name.encode()))
        shards = getattr(param, "checkpoint_shards", None)
        if shards is None:
            _fill(param, name, std, gen)
            continue
        # The checkpoint tensors of a merged parameter are stacked along dim 0,
        # as the parameter stacks them at tp 1: one draw gives the same values.
        full_shape = (sum(shape[0] for _, shape in shards), *shards[0][1][1:])
        full = _fill(torch.empty(full_shape, dtype=param.dtype, device=param.device), name, std, gen)
        for (shard_id, _), part in zip(shards, full.split([shape[0] for _, shape in shards])):
            param.weight_loader(param, part, shard_id)


def _fill(tensor: torch.Tensor, name: str, std: float, gen: torch.Generator) -> torch.Tensor:
    tensor.normal_(0.0, std, generator=gen)
    if _is_norm_weight(name, tensor):
        tensor.add_(1.0)
    return tensor


def _is_norm_weight(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 1 and "norm" in name and name.endswith("weight")
