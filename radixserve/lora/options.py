"""LoRA serving's start-up options (``--enable-lora`` and the flags after
it, SGLang's names), parsed and checked without importing torch: the server
arguments and the TokenizerManager read them too (docs/lora.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# PEFT's module names, per projection of the Llama-like families.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
# What SGLang's --lora-target-modules also accepts for "every supported module".
ALL_MODULES = "all"
# --lora-backend: the segmented Triton GEMMs (CUDA, under graphs) or the torch loop (any device)
LORA_BACKENDS = ("triton", "torch_native")
# The answer to a load or unload, or an adapter named, on a server without --enable-lora.
LORA_NOT_ENABLED = "LoRA is not enabled on this server (start it with --enable-lora)"


@dataclass(frozen=True)
class LoRAOptions:
    """What the ModelRunner's LoRA manager and the scheduler's slot table are
    built from. ``max_lora_rank`` and ``target_modules`` None: taken from the
    start-up adapters (``paths``, name to PEFT folder)."""

    paths: dict[str, str] = field(default_factory=dict)
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    target_modules: frozenset[str] | None = None
    max_loaded_loras: int | None = None
    backend: str = "torch_native"  # one of LORA_BACKENDS


def parse_lora_paths(entries: list[str] | None) -> dict[str, str]:
    """``--lora-paths`` as ``{name: path}``, in SGLang's forms: ``NAME=PATH``,
    a bare ``PATH`` (named by its folder), or a JSON object with
    ``lora_name`` and ``lora_path``. ValueError naming the flag."""
    out: dict[str, str] = {}
    for entry in entries or []:
        if entry.lstrip().startswith("{"):
            try:
                obj = json.loads(entry)
            except ValueError as exc:
                raise ValueError(f"lora_paths: {entry!r} is not JSON ({exc})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("lora_name"), str) \
                    or not isinstance(obj.get("lora_path"), str) or set(obj) - {"lora_name", "lora_path", "pinned"}:
                raise ValueError(f"lora_paths: a JSON entry needs lora_name and lora_path (strings), got {entry!r}")
            name, path = obj["lora_name"], obj["lora_path"]
        elif "=" in entry:
            name, path = (s.strip() for s in entry.split("=", 1))
        else:
            path = entry.strip()
            name = os.path.basename(os.path.normpath(path))
        check_name(name, "lora_paths")
        if not path:
            raise ValueError(f"lora_paths: adapter {name!r} has no path")
        if name in out:
            raise ValueError(f"lora_paths: the name {name!r} is given twice")
        out[name] = path
    return out


def check_name(name: str, field: str) -> None:
    """An adapter name must be usable in ``model: "BASE:NAME"``."""
    if not name or ":" in name or name != name.strip():
        raise ValueError(f"{field}: {name!r} is not a usable adapter name (non-empty, no ':' or outer spaces)")


def parse_target_modules(entries: list[str] | None) -> frozenset[str] | None:
    """``--lora-target-modules``: PEFT module names, or ``all``; None when not given."""
    if not entries:
        return None
    if ALL_MODULES in entries:
        return frozenset(SUPPORTED_MODULES)
    bad = [m for m in entries if m not in SUPPORTED_MODULES]
    if bad:
        raise ValueError(f"lora_target_modules: {bad[0]!r} is not supported; choose from "
                         f"{', '.join(SUPPORTED_MODULES)} or {ALL_MODULES}")
    return frozenset(entries)
