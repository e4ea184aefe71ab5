"""Model definitions, one file per architecture family, and their registry."""

from radixserve.models.registry import ModelRegistry

__all__ = ["ModelRegistry"]
