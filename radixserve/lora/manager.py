"""The LoRA manager of one rank's ModelRunner: the adapters in host memory
(by name, each with a uid unique to its load), the device slots of every
LoRA-enabled linear layer (``pool.LoRALayer``, hooked into the layer as
``LinearBase.lora``), and each forward's segments.

Which adapter goes in which slot is the scheduler's decision
(``slots.LoRASlotTable``), taken alike on every rank; a batch names each
request's adapter uid and slot, and :meth:`activate` fills the slots whose
content differs before the forward, on the forward's stream.

Adapters are also loaded and unloaded while serving (:meth:`load`,
:meth:`unload`). An unloaded adapter's name is gone at once, but its uid
stays readable (host copy and slot) until the scheduler releases it
(:meth:`release`), once no request holds it any more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import re

import numpy as np
import torch
from torch import nn

from radixserve.lora.adapter import LoRAAdapter, load_adapter
from radixserve.lora.options import LoRAOptions, check_name
from radixserve.lora.pool import LoRABatch, LoRALayer, LoRAPart, LoRASegment

if TYPE_CHECKING:
    from radixserve.lora.triton_ops import StaticKernelTable

logger = logging.getLogger(__name__)

# Our merged layers and the PEFT modules (with their shard ids) inside each.
_LAYERS = {
    "self_attn.qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "mlp.gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    "self_attn.o_proj": (("o_proj", None),),
    "mlp.down_proj": (("down_proj", None),),
}
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(" + "|".join(re.escape(k) for k in _LAYERS) + r")$")


class LoRAManager:
    """Adapters and slots of one rank (see the module's docstring).
    ``options.max_lora_rank`` and ``options.target_modules`` default to
    what the start-up adapters need. ``stack``: with the triton backend,
    lay the slots' ``A`` under each base weight in the model's dtype
    (``pool.LoRALayer.stack``)."""

    def __init__(self, model: nn.Module, num_layers: int, options: LoRAOptions, tp_rank: int,
                 dtype: torch.dtype, device: torch.device, stack: bool = True):
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.num_slots = options.max_loras_per_batch
        self.kernels = options.backend == "triton"
        self.stack = stack and self.kernels  # the slots' A under unquantized base weights (LoRALayer.stack)
        self.slot_scaling = torch.zeros(self.num_slots, dtype=torch.float32, device=device)  # the kernels read it
        self.max_loaded = options.max_loaded_loras
        self.adapters: dict[str, LoRAAdapter] = {}  # by name: what requests may name
        self._by_uid: dict[str, LoRAAdapter] = {}  # every adapter in host memory, unloaded ones not yet released too
        self.unloading: set[str] = set()  # uids unloaded, released once no request holds them
        self._loads = 0
        for name, path in options.paths.items():
            self._register(self._read(name, path))
        ranks = [a.rank for a in self.adapters.values()]
        if options.max_lora_rank is None and not ranks:
            raise ValueError("max_lora_rank: required when no adapter is given at start-up (--lora-paths)")
        self.max_rank = options.max_lora_rank or max(ranks)
        modules = options.target_modules
        if modules is None:
            modules = frozenset().union(*(a.target_modules for a in self.adapters.values()))
            if not modules:
                raise ValueError("lora_target_modules: required when no adapter is given at start-up (--lora-paths)")
        self.target_modules = modules
        for adapter in self.adapters.values():
            self._check_fits(adapter, "lora_paths")
        self.layers = self._attach(model, tp_rank)
        if self.stack and device.type == "cuda":  # the unstacked weights' memory, for the KV pool to map
            torch.cuda.empty_cache()
        # One flat row per slot holds every layer's B and the unstacked layers' A (LoRALayer.bind): a slot
        # fills in one copy, and one more per stacked layer for its A (under the base weight).
        self.pool = torch.zeros(self.num_slots, sum(layer.numel for layer in self.layers), dtype=dtype, device=device)
        at = 0
        for layer in self.layers:
            layer.bind(self.pool[:, at : at + layer.numel])
            at += layer.numel
        # An adapter's host copy (_pack): the pool's row, then each stacked layer's A from this offset
        self._stacked, at = [], self.pool.shape[1]
        for layer in self.layers:
            if layer.stacked:
                self._stacked.append((layer, at))
                at += layer.a_numel
        self._packed_numel = at
        for adapter in self.adapters.values():
            self._pack(adapter, "lora_paths")
        self.slot_uids: list[str | None] = [None] * self.num_slots  # what each device slot holds
        self.active: LoRABatch | None = None
        logger.info("LoRA: %d adapters, %d slots of rank %d on %d layers (%s)", len(self.adapters), self.num_slots,
                    self.max_rank, len(self.layers), ", ".join(sorted(self.target_modules)))

    # -- adapters in host memory -----------------------------------------------
    def _read(self, name: str, path: str) -> LoRAAdapter:
        # every load gets a new uid (the radix cache's namespace): KV of an earlier load is never served
        return load_adapter(name, path, f"{name}#{self._loads + 1}", self.num_layers, self.dtype)

    def _register(self, adapter: LoRAAdapter) -> None:
        self._loads += 1
        self.adapters[adapter.name] = adapter
        self._by_uid[adapter.uid] = adapter

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read the PEFT adapter at ``path`` as ``name`` while serving;
        ValueError naming the field (``lora_name``, ``lora_path``), and
        nothing changes, for a name in use, a full host memory
        (``--max-loaded-loras``, unloaded adapters not yet released
        included), or an adapter that is unreadable or does not fit the slots."""
        check_name(name, "lora_name")
        if name in self.adapters:
            raise ValueError(f"lora_name: an adapter named {name!r} is loaded already (unload it first)")
        if self.max_loaded is not None and len(self._by_uid) >= self.max_loaded:
            raise ValueError(f"lora_name: {len(self._by_uid)} adapters are in host memory, --max-loaded-loras "
                             f"{self.max_loaded} (unloaded ones count until their requests finish); unload one first")
        try:
            adapter = self._read(name, path)
        except (ValueError, OSError) as exc:
            raise ValueError(f"lora_path: {exc}") from None
        self._check_fits(adapter, "lora_path")
        self._pack(adapter, "lora_path")
        self._register(adapter)
        return adapter

    def unload(self, name: str) -> str:
        """Forget ``name``: no new request can name it. Its uid (returned)
        stays readable until :meth:`release`. ValueError naming ``lora_name``."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"lora_name: no LoRA adapter {name!r} is loaded (loaded: {known})")
        self.unloading.add(adapter.uid)
        return adapter.uid

    def release(self, uid: str) -> None:
        """Drop an unloaded adapter's host copy and empty its slot: no request holds ``uid`` any more."""
        self.unloading.discard(uid)
        del self._by_uid[uid]
        self.slot_uids = [None if owner == uid else owner for owner in self.slot_uids]

    def loaded(self) -> dict[str, str]:
        """The adapters requests may name: name -> folder."""
        return {name: a.path for name, a in sorted(self.adapters.items())}

    def _check_fits(self, adapter: LoRAAdapter, field: str) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"{field}: adapter {adapter.name!r} has rank {adapter.rank}, above --max-lora-rank "
                             f"{self.max_rank}")
        extra = sorted(adapter.target_modules - self.target_modules)
        if extra:
            raise ValueError(f"{field}: adapter {adapter.name!r} targets {', '.join(extra)}, not among "
                             f"--lora-target-modules ({', '.join(sorted(self.target_modules))})")

    def _pack(self, adapter: LoRAAdapter, field: str) -> None:
        """Lay ``adapter`` out as a slot holds it on this rank (host memory,
        pinned for an asynchronous copy on CUDA), in place of its weights."""
        packed = torch.zeros(self._packed_numel, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        a_offsets = iter(at for _, at in self._stacked)  # in the layers' order
        at = 0
        for layer in self.layers:
            row = packed[at : at + layer.numel]
            if layer.stacked:
                a_at = next(a_offsets)
                a, b = packed[a_at : a_at + layer.a_numel], row
            else:
                a, b = row[: layer.a_numel], row[layer.a_numel :]
            layer.pack(a, b, adapter.weights, f"{field}: adapter {adapter.name!r}")
            at += layer.numel
        adapter.packed, adapter.weights = packed, {}

    def resolve(self, name: str) -> str:
        """The uid of the adapter loaded as ``name``; ValueError naming ``lora_path``."""
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"lora_path: unknown LoRA adapter {name!r} (loaded: {known})")
        return adapter.uid

    # -- the model's layers ---------------------------------------------------------
    def _attach(self, model: nn.Module, tp_rank: int) -> list[LoRALayer]:
        layers, found = [], set()
        for name, module in model.named_modules():
            m = _LAYER_NAME.search(name)
            if m is None:
                continue
            layer_id, kind = int(m.group(1)), m.group(2)
            parts = self._parts(module, _LAYERS[kind])
            found.update((layer_id, p) for p, _ in _LAYERS[kind])
            if not parts:
                continue
            row = kind in ("self_attn.o_proj", "mlp.down_proj")
            in_size = module.input_size_per_rank if row else module.input_size
            out_size = module.output_size if row else module.weight.shape[0]
            hook = LoRALayer(layer_id, parts, row, in_size, module.input_size, out_size, self.max_rank, tp_rank,
                             self.device, self._batch, self.slot_scaling)
            if self.stack and module.weight_scale is None and not module.weight.is_mkldnn:  # the shrink in the GEMM
                hook.stack(module, self.num_slots)
            module.lora = hook
            layers.append(hook)
        missing = sorted({m for m in self.target_modules for i in range(self.num_layers) if (i, m) not in found})
        if missing:
            raise ValueError(f"lora_target_modules: this model has no dense {', '.join(missing)} in every layer "
                             "(LoRA on mixture-of-experts layers is not supported)")
        return layers

    def _parts(self, module: nn.Module, modules: tuple) -> list[LoRAPart]:
        parts = []
        for peft_name, shard_id in modules:
            if peft_name not in self.target_modules:
                continue
            if shard_id is None:  # row-parallel: the whole output
                parts.append(LoRAPart(peft_name, 0, module.output_size, 0))
            else:
                s = module.shards[shard_id]
                parts.append(LoRAPart(peft_name, s.offset, s.size, s.start))
        return parts

    def _batch(self) -> LoRABatch | None:
        return self.active

    # -- a forward -------------------------------------------------------------------
    def prepare(self, lora_ids: list[str | None] | None, lora_slots: list[int] | None,
                tokens: list[int]) -> LoRABatch | None:
        """The segments (or the kernels' table) of a batch whose request ``i``
        has ``tokens[i]`` rows (contiguous, in batch order), adapter
        ``lora_ids[i]`` in slot ``lora_slots[i]``; None when no request has an adapter."""
        if not lora_ids or all(uid is None for uid in lora_ids):
            return None
        adapters = {slot: self._adapter(uid) for uid, slot in zip(lora_ids, lora_slots) if uid is not None}
        batch = LoRABatch(loads=[(slot, a.uid) for slot, a in sorted(adapters.items()) if self.slot_uids[slot] != a.uid])
        if self.kernels:
            batch.row_slots = np.repeat(np.asarray(lora_slots, dtype=np.int64), tokens)
            return batch
        starts = np.concatenate([[0], np.cumsum(tokens)]).tolist()
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(lora_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(i)
        for slot, reqs in sorted(by_slot.items()):
            adapter = adapters[slot]
            batch.segments.append(LoRASegment(slot, self._rows(reqs, starts), adapter.rank, adapter.config.scaling))
        return batch

    def _adapter(self, uid: str) -> LoRAAdapter:
        adapter = self._by_uid.get(uid)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter {uid} is not loaded but a batch uses it")
        return adapter

    def static_table(self, max_rows: int) -> StaticKernelTable:
        """A CUDA graph runner's table for up to ``max_rows`` rows (the triton backend)."""
        from radixserve.lora.triton_ops import StaticKernelTable

        return StaticKernelTable(max_rows, self.num_slots, self.device)

    def capture_with(self, table: StaticKernelTable, num_rows: int) -> None:
        """Make the layers launch the kernels over ``table`` (sized for
        ``num_rows``) while a graph is captured; :meth:`activate` ends it."""
        self.active = LoRABatch(table=table.view(num_rows))

    def _rows(self, reqs: list[int], starts: list[int]) -> slice | torch.Tensor:
        if all(starts[a + 1] == starts[b] for a, b in zip(reqs, reqs[1:])):
            return slice(starts[reqs[0]], starts[reqs[-1] + 1])
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in reqs])
        return rows.to(self.device, non_blocking=True)

    def activate(self, batch: LoRABatch | None) -> None:
        """Fill the slots ``batch`` needs and make it the one the layers
        apply (None: the base model only). Call on the forward's stream."""
        for slot, uid in batch.loads if batch is not None else ():
            if self.slot_uids[slot] != uid:
                adapter = self._by_uid[uid]
                self.pool[slot].copy_(adapter.packed[: self.pool.shape[1]], non_blocking=True)
                for layer, at in self._stacked:
                    layer.A[slot].view(-1).copy_(adapter.packed[at : at + layer.a_numel], non_blocking=True)
                self.slot_scaling[slot].fill_(adapter.config.scaling)
                self.slot_uids[slot] = uid
        self.active = batch
