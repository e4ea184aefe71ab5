"""SGLang's expert-parallel flags (``--ep-size``, ``--moe-a2a-backend``):
their values and their checks, in plain Python, since the server parses its
arguments before it loads torch (docs/moe.md)."""

from __future__ import annotations

# SGLang's names. "all_to_all" is radixserve's own: torch.distributed.all_to_all_single.
MOE_A2A_BACKENDS = ("none", "all_to_all", "deepep", "mooncake")
UNAVAILABLE_A2A_BACKENDS = {
    "deepep": "DeepEP's kernels and the NVSHMEM / InfiniBand (IBGDA) RDMA libraries they run on",
    "mooncake": "Mooncake's EP transfer engine and the RDMA libraries it runs on",
}


def check_expert_parallel(tp_size: int, ep_size: int, a2a_backend: str) -> None:
    """A ValueError naming the flag when ``--ep-size`` / ``--moe-a2a-backend`` cannot work."""
    if a2a_backend not in MOE_A2A_BACKENDS:
        raise ValueError(f"moe_a2a_backend must be one of {', '.join(MOE_A2A_BACKENDS)}; got {a2a_backend!r}")
    if a2a_backend in UNAVAILABLE_A2A_BACKENDS:
        raise ValueError(f"moe_a2a_backend {a2a_backend!r} needs {UNAVAILABLE_A2A_BACKENDS[a2a_backend]}, which "
                         "this build lacks; use --moe-a2a-backend none (all-reduce) or all_to_all")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if ep_size > tp_size or tp_size % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide tp_size {tp_size}: the expert-parallel ranks are "
                         "the tensor-parallel ranks (--ep-size <= --tp-size)")
    if a2a_backend == "all_to_all" and (ep_size == 1 or ep_size != tp_size):
        raise ValueError(f"moe_a2a_backend all_to_all sends tokens between expert-parallel ranks that each hold "
                         f"whole experts: it needs --ep-size equal to --tp-size > 1 (got ep_size {ep_size}, "
                         f"tp_size {tp_size})")
