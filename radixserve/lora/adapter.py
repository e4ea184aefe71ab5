"""A LoRA adapter read from a PEFT folder (``adapter_config.json`` and
``adapter_model.safetensors``), into host memory, checked once.

PEFT names a weight ``...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight``:
``A`` is ``[r, in]`` and ``B`` is ``[out, r]``, and the module's output gains
``scaling * x @ A.T @ B.T`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` under rsLoRA). Only the linear layers of the
decoder's attention and dense MLP are supported (``SUPPORTED_MODULES``).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from radixserve.lora.options import SUPPORTED_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_WEIGHT_NAME = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAConfig:
    """The parts of a PEFT ``LoraConfig`` the engine uses."""

    r: int
    lora_alpha: float
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


@dataclass
class LoRAAdapter:
    """One adapter in host memory: ``weights[(layer, module)] = (A, B)``,
    whole, until the rank's LoRA manager lays its shard out as a slot holds
    it (``packed``) and drops them."""

    name: str
    path: str
    uid: str  # unique per load: the radix cache's namespace and the slot's tag
    config: LoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # emptied once packed
    packed: torch.Tensor | None = None  # laid out as a slot of this rank holds it (LoRAManager)

    @property
    def rank(self) -> int:
        return self.config.r

    def __post_init__(self) -> None:
        self.target_modules = frozenset(module for _, module in self.weights)  # kept once the weights are packed


def read_config(path: str) -> LoRAConfig:
    """The adapter's config, refusing what the engine cannot apply (DoRA,
    per-module ranks or alphas, trained biases, extra saved modules)."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} is not a PEFT LoRA adapter folder (no {CONFIG_FILE})")
    with open(file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = [key for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out")
                   if cfg.get(key)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']!r}")
    if unsupported:
        raise ValueError(f"{path!r}: LoRA options not supported: {', '.join(unsupported)}")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{path!r}: r must be a positive integer, got {r!r}")
    return LoRAConfig(r=r, lora_alpha=float(cfg.get("lora_alpha", r)), use_rslora=bool(cfg.get("use_rslora", False)))


def load_adapter(name: str, path: str, uid: str, num_layers: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read the adapter at ``path`` into host memory in ``dtype``; ValueError
    naming the folder for a file the engine cannot serve."""
    from safetensors.torch import load_file

    config = read_config(path)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path!r}: no {WEIGHTS_FILE} (only safetensors adapters are read)")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(file).items():
        m = _WEIGHT_NAME.search(key)
        if m is None:
            raise ValueError(f"{path!r}: weight {key!r} is not a LoRA weight of an attention or MLP projection")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_MODULES:
            raise ValueError(f"{path!r}: LoRA on {module!r} is not supported (only {', '.join(SUPPORTED_MODULES)})")
        if not 0 <= layer < num_layers:
            raise ValueError(f"{path!r}: weight {key!r} names layer {layer}; the model has {num_layers}")
        parts.setdefault((layer, module), {})[ab] = tensor.to(dtype)
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path!r}: layer {layer} {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(f"{path!r}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                             f"do not have rank r={config.r}")
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
    if not weights:
        raise ValueError(f"{path!r}: the adapter has no LoRA weights")
    return LoRAAdapter(name, path, uid, config, weights)
