"""What unit tests that stand in for the KV transport must do as it does."""
from __future__ import annotations


FRAME_BYTES = 512 << 10  # what a stand-in transport's ``frame_bytes(peer)`` says


def parts_on_the_wire(block_start: int, num_blocks: int, payload, divisible: bool) -> list[tuple[int, int, memoryview]]:
    """The frames one ``send`` may arrive as, ``(block_start, num_blocks, payload)`` each: a payload
    the sender marked divisible, of several blocks, cut in two between blocks (as the transport may cut
    it, ``sender._cut``); any other payload whole."""
    view = memoryview(payload).cast("B")
    if not divisible or num_blocks < 2:
        return [(block_start, num_blocks, view)]
    half, step = num_blocks // 2, len(view) // num_blocks
    return [(block_start, half, view[:half * step]), (block_start + half, num_blocks - half, view[half * step:])]
