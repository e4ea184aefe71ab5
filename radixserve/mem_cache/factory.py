"""From the server's options to the prefix cache a scheduler uses: none
(``--disable-radix-cache``), the radix tree, or the radix tree over a host
tier and a file tier (``--enable-hierarchical-cache``, docs/hicache.md)."""

from __future__ import annotations

import hashlib
import os

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.kv_events import KVEventRecorder
from radixserve.mem_cache.radix_cache import RadixCache


def build_tree_cache(args, model_runner, kv_event_publisher=None, forward_stream=None) -> BasePrefixCache:
    """The prefix cache over ``model_runner``'s pools that ``args`` (a
    ``ServerArgs``) ask for, recording KV events for ``kv_event_publisher``
    when given; ``forward_stream`` is where forwards run (the hierarchical
    cache orders its copies after it)."""
    pools = (model_runner.req_to_token_pool, model_runner.token_to_kv_pool_allocator, model_runner.page_size)
    if args.disable_radix_cache:
        return ChunkCache(*pools)
    kv_events = None
    if kv_event_publisher is not None:
        kv_events = KVEventRecorder(model_runner.page_size, kv_event_publisher.config.block_size)
    if not args.enable_hierarchical_cache:
        return RadixCache(*pools, eviction_policy=args.eviction_policy, kv_events=kv_events)
    from radixserve.mem_cache.hiradix_cache import HiRadixCache
    from radixserve.mem_cache.host_pool import HostKVPool, host_pool_tokens

    device_pool = model_runner.token_to_kv_pool
    bytes_per_token = device_pool.mem_bytes() // ((device_pool.size + device_pool.page_size))
    size = host_pool_tokens(device_pool.size, device_pool.page_size, bytes_per_token, args.hicache_ratio,
                            args.hicache_size)
    host = HostKVPool(device_pool, size)
    storage = None
    if args.hicache_storage_backend == "file":
        from radixserve.mem_cache.hicache_storage import FileTier, storage_block_tokens
        from radixserve.mem_cache.storage import HiCacheFile

        namespace = storage_namespace(model_runner, storage_block_tokens(device_pool.page_size), args.random_seed)
        max_gb = args.hicache_storage_options().get("max_gb")
        backend = HiCacheFile(args.resolved_hicache_storage_dir(), namespace,
                              max_bytes=int(max_gb * 2**30) if max_gb else None)
        storage = FileTier(backend, host, device_pool.page_size, model_runner.tp_group)
    return HiRadixCache(*pools, host, args.hicache_write_policy, args.eviction_policy, kv_events, storage,
                        forward_stream, model_runner.tp_group)


def storage_namespace(model_runner, block_tokens: int, seed: int) -> str:
    """The file tier's directory name for this model's KV: which weights
    (their folder, or the dummy's seed), dtype, layout, TP rank, pipeline
    stage's layers and block size, so that no other model or layout ever
    reads these files."""
    config = model_runner.model_config
    pool = model_runner.token_to_kv_pool
    source = config.weights_dir or config.model_path
    if config.load_format == "dummy":
        source = f"{config.model_path}:dummy:{seed}"
    digest = hashlib.sha256(os.path.abspath(source).encode() if os.path.exists(source) else source.encode())
    name = os.path.basename(str(config.model_path).rstrip("/")) or "model"
    pp = model_runner.pp
    layers = f"-layers{pp.start}to{pp.end}" if pp.size > 1 else ""  # names without pipeline parallelism as before
    return (f"{name}-{digest.hexdigest()[:12]}-{str(pool.dtype).removeprefix('torch.')}-L{pool.layer_num}{layers}"
            f"-H{pool.head_num}-D{pool.head_dim}-tp{model_runner.tp_rank}of{model_runner.tp_size}-b{block_tokens}")
