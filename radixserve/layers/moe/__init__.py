"""Mixture-of-experts layers (docs/moe.md): routing (``topk``), the experts'
torch path (``native``) and fused Triton path (``triton_ops``), how tokens
reach experts on other ranks (``dispatch``), and the ``FusedMoE`` module."""
