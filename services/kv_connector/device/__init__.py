"""The connector's device data path: KV moves between the paged cache and pinned host memory on
side streams, ordered by events, so nothing on the engine's compute path waits for the host.

The same code runs on CPU tensors, where streams and events are stand-ins that complete at once
(``streams.Device``). ``ring`` holds the pinned host memory, ``producer`` copies a layer's blocks
out, ``consumer`` copies received blocks in. docs/gpu.md says which stream and thread does what.
"""

# The host ring's defaults (``ring.HostRing``; settings ``host_ring_bytes`` / ``host_ring_slot_bytes``),
# here so that settings can name them without importing torch: 16 slots of 16 MiB per direction,
# half an 8B-class layer of an 8K-token prefill per slot.
DEFAULT_RING_BYTES = 256 << 20
DEFAULT_SLOT_BYTES = 16 << 20
