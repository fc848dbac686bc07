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
# The saver's ring on CUDA when ``host_ring_bytes`` is not set: one whole 8K-token prefill of an
# 8B-class model (1 GiB in ~130 ms on an H100, faster than any link drains it), so a prefill waits
# for the network only when the previous one has not left yet (docs/gpu.md, "Defaults on CUDA and why").
CUDA_SAVE_RING_BYTES = 1 << 30
# The frame payload a consumer asks producers for at the KV handshake when `transport.frame_bytes` is
# not set: on CUDA, 8 MiB frames reached 0.81-0.87x of a pinned host-to-device copy on an H100 where
# 512 KiB frames held it to 0.16-0.35x (each frame costs the engine thread a copy to issue and its
# batch an index and an event); elsewhere the transport's default, whose CPU measurements put 512 KiB
# to 8 MiB within noise (docs/gpu.md, "Defaults on CUDA and why").
CUDA_FRAME_BYTES = 8 << 20
CPU_FRAME_BYTES = 512 << 10


def save_ring_bytes(configured: int | None, is_cuda: bool) -> int:
    """The saver's ring: ``host_ring_bytes`` when set, else the device's default."""
    return configured or (CUDA_SAVE_RING_BYTES if is_cuda else DEFAULT_RING_BYTES)


def receive_ring_bytes(configured: int | None) -> int:
    """The receiver's ring (CUDA only): ``host_ring_bytes`` when set, else the CPU default, which
    holds more than one engine step's worth of frames at any link rate measured here."""
    return configured or DEFAULT_RING_BYTES


def receive_frame_bytes(is_cuda: bool) -> int:
    """The frame payload a consumer on this device asks producers for (``transport.frame_bytes``
    set overrides it)."""
    return CUDA_FRAME_BYTES if is_cuda else CPU_FRAME_BYTES
