"""The fused MoE path in Triton (GPU; the CPU runs it only through Triton's
interpreter, ``TRITON_INTERPRET=1``, in the tests).

- ``fused_moe``: ``moe_align_block_size`` (the pairs sorted by expert, each
  expert's run padded to the block size), the two grouped GEMMs (gate/up with
  SiLU-and-mul fused; down with the routing weights applied), the top-k sum,
  and the launch configurations tuned per shape and device
  (``layers/moe/configs/*.json``, written by ``benchmarks/tune_fused_moe.py``).

Importing this package imports triton: the MoE layer imports it only where it
runs the fused path.
"""

from radixserve.layers.moe.triton_ops.fused_moe import fused_experts, get_config, moe_align_block_size

__all__ = ["fused_experts", "get_config", "moe_align_block_size"]
