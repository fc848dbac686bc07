"""What callers of a cache pool share with it: the protocol's types (``types.py``) and their protobuf
form (``convert.py``), the chained prefix block hashes that key blocks (``hashing.py``; xxh3 by default,
vLLM's sha256 chain on request), the gRPC client (``client.py``; ``arena_client.py`` reads and writes
the pool's shared-memory arena, laid out by ``arena.py``, when caller and pool share a host; ``inbox.py``
receives blocks streamed over the KV transport), the router's global index across clusters
(``index.GlobalCacheIndex``) and copies between clusters' pools (``transfer.py``).

A library below the router and the KV connector: it imports no service.
"""
