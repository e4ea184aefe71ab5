"""Storage tiers under HiCache's host memory (SGLang's
``--hicache-storage-backend``): KV blocks keyed by the chained digest of their
token prefix, kept beyond the life of one server.

``file``: one file per block under a local (or shared) directory.
"""

from radixserve.mem_cache.storage.file_backend import HiCacheFile

__all__ = ["HiCacheFile"]
