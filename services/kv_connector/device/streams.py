"""Streams and events on CUDA, and stand-ins on CPU that complete at once, so the producer and the
consumer run one code path on both (only CUDA's calls are skipped on CPU)."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch


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


class Device:
    """Where the KV cache lives. ``side_stream`` is a long-lived, lowest-priority stream per
    ``Device`` and ``which`` (copies yield to the forward's kernels; a second one lets host-to-device
    copies overlap the writes into the cache); ``event`` makes events for them."""

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
        lowest, _ = torch.cuda.Stream.priority_range()
        return torch.cuda.Stream(self.device, priority=lowest)

    def event(self) -> Any:
        return torch.cuda.Event() if self.is_cuda else CpuEvent()

    def use(self, stream: Any) -> Any:
        """Makes ``stream`` current for the block (nothing to switch on CPU)."""
        return torch.cuda.stream(stream) if self.is_cuda else nullcontext()

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tells the caching allocator that ``stream`` still reads ``tensor`` (no-op on CPU)."""
        if self.is_cuda:
            tensor.record_stream(stream)
