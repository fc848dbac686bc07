"""The hybrid prefix cache pool (one per cluster) and the global index across clusters.

``pool.CachePool`` is the plain core (memory tier ``memory.py``, SSD tier ``ssd.py``, usable-prefix
rule ``usable.py``, shared-memory arena ``arena.py`` and ``slots.py``); ``server.py`` serves it over
gRPC (proto/prfaas/v1/cache_pool.proto), ``client.py`` (``arena_client.py`` on the pool's host) and
``index.GlobalCacheIndex`` query it, ``hashing.py`` computes the chained prefix block hashes that
key it (xxh3 by default, vLLM's sha256 chain on request).
"""
