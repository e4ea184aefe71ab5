"""KV cache events on the wire, and the block hashes they carry.

The format is SGLang's (``sglang/srt/disaggregation/kv_events.py``), which
vLLM's consumers read too (Dynamo's KV router decodes both):

- a batch is a msgpack array ``[ts, [event, ...], data_parallel_rank]``;
- an event is a msgpack map tagged by ``"type"``: ``BlockStored``
  (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
  ``lora_id``, ``medium``, ``lora_name``), ``BlockRemoved`` (``block_hashes``,
  ``medium``) or ``AllBlocksCleared``.

A block hash is SGLang's page hash: SHA-256 over the previous block's
32-byte digest (nothing for a sequence's first block) followed by the
block's token ids as little-endian uint32; the event carries the digest's
first 8 bytes as a big-endian signed 64-bit integer. It depends only on the
token ids, so every process, replica and router computes the same value
(``prefix_block_hashes``).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import MISSING, dataclass, fields
from typing import Sequence, Union

import msgpack

MEDIUM_GPU = "GPU"  # SGLang's StorageMedium.GPU: the device KV pool


@dataclass
class BlockStored:
    """Blocks ``block_hashes`` (a chain, each the next one's parent) became
    cached; ``token_ids`` are theirs, ``block_size`` tokens each. The first
    one follows ``parent_block_hash`` (None: it starts the sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    """Blocks ``block_hashes`` left the cache (evicted)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


@dataclass
class AllBlocksCleared:
    """Every block left the cache (flush_cache, or the cache was created)."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in _EVENT_TYPES.values()}
_REQUIRED = {cls: {f.name for f in fields(cls) if f.default is MISSING} for cls in _EVENT_TYPES.values()}


@dataclass
class EventBatch:
    """The events of one scheduler step, in order."""

    ts: float  # time.time() when the scheduler published it
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def encode_batch(batch: EventBatch) -> bytes:
    """The batch as a msgpack payload. Every field is written, None as nil:
    SGLang's decoder defaults the optional ones, vLLM's requires some."""
    events = [{"type": type(e).__name__, **{name: getattr(e, name) for name in _FIELDS[type(e)]}}
              for e in batch.events]
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """Parse a payload (for consumers written in Python, and tests). Unknown
    keys are ignored and absent optional ones are None, as in SGLang's
    decoder; an unknown event type or a malformed batch raises ValueError."""
    try:
        ts, raw_events, *rest = msgpack.unpackb(payload, raw=False)
        events = []
        for raw in raw_events:
            cls = _EVENT_TYPES[raw["type"]]
            required = _REQUIRED[cls]
            events.append(cls(**{name: raw[name] if name in required else raw.get(name) for name in _FIELDS[cls]}))
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a KV event batch: {exc!r}") from exc
    return EventBatch(float(ts), events, rest[0] if rest else None)


# -- block hashes ----------------------------------------------------------------
def hash_block(token_ids: Sequence[int], prior: bytes | None) -> bytes:
    """The SHA-256 digest of one block after the block with digest ``prior``."""
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def hash_id(digest: bytes) -> int:
    """The 64-bit hash an event carries for a block digest."""
    return int.from_bytes(digest[:8], "big", signed=True)


def chain_digests(token_ids: Sequence[int], block_size: int, prior: bytes | None = None) -> list[bytes]:
    """Digests of the full blocks of ``token_ids``, chained after ``prior``
    (a partial last block is left out)."""
    digests = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prior = hash_block(token_ids[start : start + block_size], prior)
        digests.append(prior)
    return digests


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hash of every full block of a sequence that starts at its first
    token: what a router computes for a prompt to find its cached blocks."""
    return [hash_id(d) for d in chain_digests(token_ids, block_size)]
