"""The connector's cache-pool half: ``io`` (the pool client's I/O thread and the pool's keys),
``planner`` (scheduler side: what to look up, load and store), ``worker`` (engine side: stores and
loads on the paged cache), ``copies`` (device-to-host copies into the pool's arena, its registration
as pinned memory)."""
