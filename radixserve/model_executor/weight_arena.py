"""A model's weights in a :class:`VirtualArena` (``--enable-memory-saver``,
docs/elastic_kv.md): their physical memory can be given back between uses
(SGLang's ``/release_memory_occupation`` with the ``weights`` tag) while their
addresses stay reserved, so CUDA graphs captured over them stay valid.

At load, every parameter and buffer of the model is copied into one arena
(on CUDA a :class:`CudaArena`, on a CPU a :class:`CpuArena`) and re-pointed
there: its ``.data`` becomes a view of the arena with the same shape, strides
and dtype, and tensors that shared storage (tied embeddings, views) share it
in the arena too. Release copies the weights to the host and unmaps every
page; resume maps them back at the same addresses and copies the host copy in.

The host copy is made at release, not at load: a server holds no second copy
of its weights while it serves (an 8B model's is 16 GB of pinned RAM), and
the copy is what the weights are when released, as SGLang's
``--enable-weights-cpu-backup`` (torch_memory_saver's CPU backup) does. On
CUDA it is pinned host memory. On a CPU the device *is* the host, so a copy
in RAM would give nothing back; it goes to an unlinked temporary file
(``tempfile``'s directory, ``TMPDIR``), which the kernel may write out to
disk when it needs the RAM.
"""

from __future__ import annotations

import logging
import tempfile
from typing import IO, Callable

import torch
from torch import nn

from radixserve.mem_cache.virtual_memory import VirtualArena, granularity, make_arena

logger = logging.getLogger(__name__)

ALIGN = 512  # each storage's offset in the arena: torch's CUDA allocator aligns as much, kernels rely on less
PAGE_BYTES = 64 << 20  # an arena page: few driver calls per map, and a failed map costs at most this much


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``model``, each tensor object once
    (a tied weight is one Parameter held by two modules)."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and id(tensor) not in seen:
                seen[id(tensor)] = tensor
    return list(seen.values())


class WeightArena:
    """The model's tensors in one arena (pages of ``PAGE_BYTES`` at most);
    ``release`` and ``resume`` give its memory back and take it again. Under tensor
    parallelism each rank has its own; ``agree_min`` (the TP group's) makes a
    failure on one rank a failure on all, so their states stay the same."""

    def __init__(self, model: nn.Module, device: torch.device, agree_min: Callable[[int], int] | None = None):
        self._agree_min = agree_min or (lambda value: value)
        layout, self.nbytes = self._layout(_model_tensors(model))
        gran = granularity(device)
        page = -(-min(PAGE_BYTES, max(self.nbytes, 1)) // gran) * gran
        self.arena: VirtualArena = make_arena([page], max(-(-self.nbytes // page), 1), device)
        self._backup: torch.Tensor | IO[bytes] | None = None  # the host copy while released
        if not self._map_all():
            raise RuntimeError(f"--enable-memory-saver: no memory for the weights' {self.nbytes / 2**20:.0f} MB")
        base = self.arena.tensors[0]
        with torch.no_grad():
            for start, nbytes, tensors in layout:
                base[start: start + nbytes].copy_(_storage_bytes(tensors[0]))
                for t in tensors:  # as_strided's offset counts from the arena's start, in elements
                    elements = start // t.element_size() + t.storage_offset()
                    t.data = base.view(t.dtype).as_strided(t.shape, t.stride(), elements)
        if device.type == "cuda":  # the weights' first home goes back to the device (the KV pool maps from there)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        logger.info("memory saver: %d weight tensors in an arena of %.1f MB (%d pages)",
                    sum(len(ts) for _, _, ts in layout), self.reserved_bytes() / 2**20, self.arena.num_pages)

    @staticmethod
    def _layout(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int, list[torch.Tensor]]], int]:
        """``[(offset in the arena, bytes, tensors over that storage)]`` and
        the bytes in all: one region per storage, so views keep sharing it."""
        storages: dict[int, list[torch.Tensor]] = {}
        for t in tensors:
            if t.is_mkldnn:  # an opaque oneDNN layout (ModelRunner does not prepack under the memory saver)
                raise ValueError("--enable-memory-saver: a oneDNN-packed weight cannot live in the weight arena")
            if t.untyped_storage().nbytes():  # an empty tensor holds no memory to release
                storages.setdefault(t.untyped_storage().data_ptr(), []).append(t)
        layout, offset = [], 0
        for group in storages.values():
            nbytes = group[0].untyped_storage().nbytes()
            if any(nbytes % t.element_size() for t in group):
                raise ValueError("--enable-memory-saver: a storage shared by tensors of mismatched dtypes")
            layout.append((offset, nbytes, group))
            offset += -(-nbytes // ALIGN) * ALIGN
        return layout, offset

    # -- state -------------------------------------------------------------------
    @property
    def released(self) -> bool:
        return self._backup is not None

    def reserved_bytes(self) -> int:
        return self.arena.reserved_bytes()

    def mapped_bytes(self) -> int:
        return self.arena.mapped_bytes()

    def release(self) -> str | None:
        """Copy the weights to the host and unmap them; None when done, else
        why not (on any rank; nothing changed). The caller makes sure no
        forward runs until :meth:`resume`."""
        try:
            backup = self._copy_out()
        except (RuntimeError, OSError) as exc:  # pinned host memory or the temporary file refused
            logger.error("memory saver: no host copy of the weights: %s", exc)
            backup = None
        if not self._agree_min(int(backup is not None)):
            if backup is not None and not isinstance(backup, torch.Tensor):
                backup.close()
            return "no room for the weights' host copy (on some rank)"
        self._backup = backup
        self.arena.unmap_many(list(self.arena.stats.mapped))
        return None

    def resume(self) -> str | None:
        """Map the weights' pages back, at the same addresses, and copy the
        host copy in; None when done, else why not (on any rank; they stay released)."""
        if not self._agree_min(int(self._map_all())):
            self.arena.unmap_many(list(self.arena.stats.mapped))
            return "no memory to map the weights back (on some rank)"
        self._copy_in(self._backup)
        self._backup = None
        return None

    # -- the pages and the host copy ---------------------------------------------------
    def _map_all(self) -> bool:
        """Map every page; False (and what did map stays mapped) when the device refuses one."""
        return self.arena.map_many(range(self.arena.num_pages)) == self.arena.num_pages

    def _used(self) -> torch.Tensor:
        return self.arena.tensors[0][: self.nbytes]

    def _copy_out(self) -> torch.Tensor | IO[bytes]:
        data = self._used()
        if data.is_cuda:
            host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            host.copy_(data)  # from device to pinned memory: synchronous
            return host
        file = tempfile.TemporaryFile(prefix="radixserve-weights-")
        try:
            file.write(memoryview(data.numpy()))
            file.flush()
        except OSError:
            file.close()
            raise
        return file

    def _copy_in(self, backup: torch.Tensor | IO[bytes]) -> None:
        data = self._used()
        if isinstance(backup, torch.Tensor):
            data.copy_(backup)  # from pinned memory, ordered after the pages' zeroing on the current stream
            return
        with backup:
            backup.seek(0)
            if backup.readinto(memoryview(data.numpy())) != self.nbytes:
                raise RuntimeError("memory saver: the weights' host copy came back short")


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as uint8 (views see all of it)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))
