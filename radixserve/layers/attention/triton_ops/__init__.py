"""Triton kernels of the ``triton`` attention backend (GPU; the CPU runs them
only through Triton's interpreter, ``TRITON_INTERPRET=1``, for debugging).

- ``decode_attention``: paged split-KV decode (flash-decoding) and its merge.
- ``extend_attention``: prefill of new tokens over a cached, paged prefix.
- ``kv_store``: one fused store of a forward's new K and V into the pool.
- ``launch``: ``CachedLaunch``, which launches them without Triton's
  per-call dispatch once a specialization has been compiled.

Every kernel reads the KV pool only through slot indices from
``req_to_token``, so the page size never reaches them.
"""

from radixserve.layers.attention.triton_ops.decode_attention import MAX_KV_SPLITS, decode_attention_fwd
from radixserve.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from radixserve.layers.attention.triton_ops.kv_store import store_kv

__all__ = ["MAX_KV_SPLITS", "decode_attention_fwd", "extend_attention_fwd", "store_kv"]
