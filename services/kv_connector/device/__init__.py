"""The connector's device data path: KV moves between the paged cache and pinned host memory on
side streams, ordered by events, so nothing on the engine's compute path waits for the host.

The same code runs on CPU tensors, where streams and events are stand-ins that complete at once
(``streams.Device``). ``ring`` holds the pinned host memory, ``producer`` copies a layer's blocks
out, ``consumer`` copies received blocks in. docs/gpu.md says which stream and thread does what.
"""
