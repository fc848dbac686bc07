"""The hybrid prefix cache pool service (one per cluster).

``pool.CachePool`` is the plain core (memory tier ``memory.py``, SSD tier ``ssd.py``, usable-prefix
rule ``usable.py``, the shared-memory arena's slots ``slots.py``, eviction ``eviction.py``);
``server.py`` serves it over gRPC (proto/prfaas/v1/cache_pool.proto) and ``cli.py`` starts it.
Everything a caller of the pool needs (its types, prefix hashing, the client, the global index,
cross-cluster copies) is the library ``services/cache_pool_client/``, which this service shares.
"""
