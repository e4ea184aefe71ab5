"""KV cache events for external routers (``--kv-events-config``,
docs/kv_events.md): the radix cache's stored and evicted blocks, published
over ZeroMQ in SGLang's wire format.

- ``events``: the event types, the msgpack payload, the block hashes;
- ``recorder``: ``KVEventRecorder``, which a ``RadixCache`` calls when it
  inserts, splits, evicts and resets nodes;
- ``publisher``: ``ZmqEventPublisher``, the PUB and replay sockets and the
  thread that sends each scheduler step's events.
"""

from radixserve.mem_cache.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    decode_batch,
    encode_batch,
    prefix_block_hashes,
)
from radixserve.mem_cache.kv_events.publisher import (
    END_SEQ,
    KVEventsConfig,
    ZmqEventPublisher,
    create_publisher,
    offset_endpoint,
)
from radixserve.mem_cache.kv_events.recorder import KVEventRecorder, event_block_size

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVEventRecorder",
    "KVEventsConfig",
    "ZmqEventPublisher",
    "create_publisher",
    "decode_batch",
    "encode_batch",
    "event_block_size",
    "offset_endpoint",
    "prefix_block_hashes",
]
