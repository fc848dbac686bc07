"""The device facade: every call the connector's core makes on CUDA (streams, events, index tensors,
host-to-device copies, pinned registrations, a helper thread's device) goes through ``Device``, with
stand-ins on CPU that complete at once, so the producer and the consumer run one code path on both.

Nothing here waits for the GPU on the calling thread except ``Device.wait`` (helper threads) and
``Device.drain`` (shutdown): the engine thread's calls only enqueue. A test replaces the facade with
one that records synchronizing calls (tests/unit/test_engine_thread_sync.py).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

logger = logging.getLogger(__name__)


class CpuEvent:
    """A CUDA event's stand-in: CPU work runs to its end before the next line, so every event is
    complete as soon as it is recorded."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuStream:
    """A CUDA stream's stand-in: work issued "on" it runs on the calling thread, in order."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Device:
    """Where the KV cache lives. ``side_stream`` is a long-lived stream per ``Device`` and ``which``,
    at the highest priority the device offers (the copies' small kernels and DMAs are scheduled
    ahead of the forward's queued kernels instead of behind them; vLLM's compute stream has the
    default, lowest priority); ``event`` makes events for them."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self._sides: dict[int, Any] = {}

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.is_cuda else CpuStream()

    def side_stream(self, which: int = 0) -> Any:
        if which not in self._sides:
            self._sides[which] = self._new_side_stream()
        return self._sides[which]

    def _new_side_stream(self) -> Any:
        if not self.is_cuda:
            return CpuStream()
        _, highest = torch.cuda.Stream.priority_range()  # (least, greatest): greatest is numerically lowest
        return torch.cuda.Stream(self.device, priority=highest)

    def event(self) -> Any:
        return torch.cuda.Event() if self.is_cuda else CpuEvent()

    def use(self, stream: Any) -> Any:
        """Makes ``stream`` current for the block (nothing to switch on CPU)."""
        return torch.cuda.stream(stream) if self.is_cuda else nullcontext()

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tells the caching allocator that ``stream`` still reads ``tensor`` (no-op on CPU)."""
        if self.is_cuda:
            tensor.record_stream(stream)

    def index(self, ids: Sequence[int]) -> torch.Tensor:
        """``ids`` as a long tensor on the device, enqueued on the current stream: built in pinned
        memory and copied ``non_blocking`` (PyTorch's pinned allocator keeps the host copy until the
        copy completed), so the host never waits."""
        if not self.is_cuda:
            return torch.tensor(list(ids), dtype=torch.long)
        return torch.tensor(list(ids), dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor's bytes on the device, enqueued on the current stream without a host wait:
        staged through PyTorch's pinned allocator (which holds it until the copy completed), since
        the source's own memory (a received frame, a decoded one) may be reused once this returns."""
        if not self.is_cuda:
            return host
        staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)

    def bind_thread(self) -> None:
        """Called first by every helper thread that issues CUDA work: without it, a thread of TP rank
        1 would make its calls (and a context) on GPU 0."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    def register(self, address: int, size: int) -> bool:
        """Pin host memory this process did not allocate with torch, in place, at its exact size;
        False (the memory stays pageable: slower, still correct) where it cannot be."""
        if not self.is_cuda:
            return False
        error = int(torch.cuda.cudart().cudaHostRegister(address, size, 0))
        if error != 0:
            logger.warning("%d bytes of host memory not pinned (cudaHostRegister error %d): copies through "
                           "them will be slower", size, error)
            return False
        return True

    def unregister(self, address: int) -> None:
        if self.is_cuda:
            torch.cuda.cudart().cudaHostUnregister(address)

    def drain(self) -> None:
        """Wait for every side stream's work (shutdown: before the pinned memory it uses goes)."""
        for stream in self._sides.values():
            stream.synchronize()
