"""Request-to-token table and the paged KV pool.

Region map of the KV pool (``page_size = P``, ``num_pages = N``)::

    slot:  0 .. P-1 | P .. 2P-1 | ... | N*P .. (N+1)*P-1
    page:     0     |     1     | ... |        N
           (dummy)  |  <----------- allocatable ----------->

Page 0 is never handed out: padded tokens (CUDA-graph padding, dummy decode
rows) write their K/V there, so a pool of ``size`` usable slots owns
``size + P`` rows.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """One row per running request: ``req_to_token[row, pos]`` is the KV slot
    holding the token at position ``pos`` of that request.

    Rows are handed out by :meth:`alloc` and returned by :meth:`free`; a row's
    contents are only meaningful up to the request's current length.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        if size < 1 or max_context_len < 1:
            raise ValueError(f"ReqToTokenPool needs size >= 1 and max_context_len >= 1, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._free_rows: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int = 1) -> list[int]:
        """Take ``n`` rows; raises :class:`PoolExhausted` if fewer are free."""
        if n > len(self._free_rows):
            raise PoolExhausted(f"ReqToTokenPool: asked for {n} rows, {len(self._free_rows)} of {self.size} free")
        rows, self._free_rows = self._free_rows[:n], self._free_rows[n:]
        return rows

    def free(self, rows: int | list[int]) -> None:
        rows = [rows] if isinstance(rows, int) else list(rows)
        for r in rows:
            if not 0 <= r < self.size:
                raise ValueError(f"ReqToTokenPool: row {r} out of range [0, {self.size})")
        if len(set(rows)) != len(rows) or set(rows) & set(self._free_rows):
            raise RuntimeError(f"ReqToTokenPool: double free of rows {rows}")
        self._free_rows.extend(rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record ``slots`` as the KV slots of positions ``start ..`` of ``row``."""
        end = start + len(slots)
        if end > self.max_context_len:
            raise ValueError(f"ReqToTokenPool: position {end} exceeds max_context_len {self.max_context_len}")
        self.req_to_token[row, start:end] = slots.to(device=self.device, dtype=torch.int32)

    def write_at(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Record ``slots[i]`` as the KV slot of position ``positions[i]`` of
        row ``rows[i]``, for every ``i`` in one scatter (``rows`` and
        ``positions`` on the host)."""
        if len(positions) and int(positions.max()) >= self.max_context_len:
            raise ValueError(f"ReqToTokenPool: position {int(positions.max())} exceeds max_context_len "
                             f"{self.max_context_len}")
        self.req_to_token[rows.to(self.device), positions.to(self.device)] = slots.to(self.device, torch.int32)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))


class PoolExhausted(RuntimeError):
    """Raised when a pool cannot satisfy an allocation."""


KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype`` as a torch dtype: ``auto`` is the model's."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the pool's ``dtype``. fp8 stores values unscaled, so values
    beyond its range saturate to its largest finite value instead of
    becoming NaN or inf (e4m3 has no inf)."""
    if x.dtype == dtype:
        return x
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def copy_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor that ``index_select`` / ``index_copy_`` accept: an
    fp8 tensor as ``uint8`` over the same bytes (torch lacks fp8 kernels for
    them), any other as itself."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def _rows(raw: torch.Tensor, dtype: torch.dtype, heads: int, dim: int) -> torch.Tensor:
    """A ``uint8`` buffer as ``[rows, heads, dim]`` of ``dtype``, over the same memory."""
    per_row = heads * dim * dtype.itemsize
    return raw[: raw.numel() // per_row * per_row].view(dtype).view(-1, heads, dim)


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape ``[size + page_size, kv_heads, head_dim]``
    in ``dtype`` (``--kv-cache-dtype``: the model's, bf16 or fp8; attention
    reads fp8 K/V back into the model's dtype).

    Slot indices come from :class:`~radixserve.mem_cache.allocator.TokenToKVPoolAllocator`;
    slots ``0 .. page_size-1`` form the dummy page.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device = "cpu",
        v_head_dim: int | None = None,
        buffers: list[torch.Tensor] | None = None,
    ):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        rows = size + page_size
        if buffers is None:
            self.k_buffer = [torch.zeros((rows, head_num, head_dim), dtype=dtype, device=self.device)
                             for _ in range(layer_num)]
            self.v_buffer = [torch.zeros((rows, head_num, self.v_head_dim), dtype=dtype, device=self.device)
                             for _ in range(layer_num)]
        else:  # given as raw bytes, K then V of each layer (an elastic pool's ranges, which may hold more rows)
            self.k_buffer = [_rows(b, dtype, head_num, head_dim) for b in buffers[0::2]]
            self.v_buffer = [_rows(b, dtype, head_num, self.v_head_dim) for b in buffers[1::2]]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Store ``cache_k`` / ``cache_v`` (``[n, kv_heads, head_dim]``) at slots ``loc``."""
        cache_k, cache_v = to_kv_dtype(cache_k, self.dtype), to_kv_dtype(cache_v, self.dtype)
        self.k_buffer[layer_id][loc] = cache_k
        self.v_buffer[layer_id][loc] = cache_v

    def mem_bytes(self) -> int:
        per_slot = self.head_num * (self.head_dim + self.v_head_dim) * self.dtype.itemsize
        return per_slot * (self.size + self.page_size) * self.layer_num
