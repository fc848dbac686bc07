"""A CPU stand-in for CUDA that records every call that would make the calling thread wait for the
GPU, so a unit test can drive the connector's core through its CUDA code paths on any host and fail
when an engine-thread path synchronizes.

``RecordingDevice`` is the core's device facade (``device.streams.Device``) with ``is_cuda`` set and
tensors left on the CPU: streams and events are stand-ins whose ``synchronize`` is recorded when the
engine thread calls it; ``index`` and ``upload`` (the facade's non-blocking host-to-device copies)
mark what they return as device memory, as the caches are. ``recording_syncs`` additionally patches
torch while it is open: ``.item()``, ``.tolist()``, ``.cpu()``, ``.cuda()``, ``.to(<device>)``,
``torch.tensor(..., device=...)``, ``torch.cuda.synchronize`` and a blocking ``copy_`` between host
and device memory, each recorded when the engine thread calls it (on CUDA each waits for the stream).
"""
from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from services.kv_connector.device.streams import CpuEvent, CpuStream, Device


class _Recorder:
    def __init__(self) -> None:
        self.engine_thread = threading.current_thread()
        self.calls: list[str] = []
        self.device_storages: set[int] = set()

    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self.engine_thread

    def record(self, what: str) -> None:
        if self.on_engine_thread():
            where = "".join(traceback.format_stack(limit=6)[:-2])
            self.calls.append(f"{what}\n{where}")

    def mark_device(self, tensor: torch.Tensor) -> torch.Tensor:
        self.device_storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.device_storages


class _Event(CpuEvent):
    def __init__(self, recorder: _Recorder) -> None:
        self._recorder = recorder

    def synchronize(self) -> None:
        self._recorder.record("event.synchronize()")


class _Stream(CpuStream):
    def __init__(self, recorder: _Recorder) -> None:
        self._recorder = recorder

    def synchronize(self) -> None:
        self._recorder.record("stream.synchronize()")


class RecordingDevice(Device):
    """The facade on CPU tensors, taking the CUDA branches of the core; ``recorder.calls`` lists the
    synchronizing calls the engine thread made."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__("cpu")
        self.is_cuda = True
        self.recorder = recorder

    def current_stream(self) -> Any:
        return _Stream(self.recorder)

    def _new_side_stream(self) -> Any:
        return _Stream(self.recorder)

    def event(self) -> Any:
        return _Event(self.recorder)

    def use(self, stream: Any) -> Any:
        return nullcontext()

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def index(self, ids) -> torch.Tensor:
        return self.recorder.mark_device(_ORIGINAL["tensor"](list(ids), dtype=torch.long))

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return self.recorder.mark_device(host.clone())

    def bind_thread(self) -> None:
        pass

    def register(self, address: int, size: int) -> bool:
        return True

    def unregister(self, address: int) -> None:
        pass

    def drain(self) -> None:
        pass


_ORIGINAL = {"tensor": torch.tensor}


def _names_a_device(args, kwargs) -> bool:
    """``Tensor.to`` given a device (or a tensor whose device it takes), not only a dtype."""
    return kwargs.get("device") is not None or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)


@contextmanager
def recording_syncs():
    """Yields ``device_of(device) -> RecordingDevice`` (for ``PrfaasConnectorWorker(device_of=...)``,
    ``PoolWorker.register_kv_caches``) and the recorder; torch is patched while the block runs."""
    recorder = _Recorder()
    tensor_class = torch.Tensor
    originals = {name: getattr(tensor_class, name) for name in ("item", "tolist", "cpu", "cuda", "to", "copy_")}
    original_sync = torch.cuda.synchronize

    def patched(name: str):
        original = originals[name]

        def call(self, *args, **kwargs):
            if name == "to" and not _names_a_device(args, kwargs):
                return original(self, *args, **kwargs)
            if name == "copy_":
                source = args[0]
                blocking = not (args[1] if len(args) > 1 else kwargs.get("non_blocking", False))
                if blocking and recorder.is_device(self) != recorder.is_device(source):
                    recorder.record("blocking copy_ between host and device memory")
                return original(self, *args, **kwargs)
            recorder.record(f"Tensor.{name}()")
            return original(self, *args, **kwargs)
        return call

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            recorder.record("torch.tensor(..., device=...)")
        return _ORIGINAL["tensor"](*args, **kwargs)

    for name in originals:
        setattr(tensor_class, name, patched(name))
    torch.tensor = tensor
    torch.cuda.synchronize = lambda *args, **kwargs: recorder.record("torch.cuda.synchronize()")
    try:
        def device_of(_device) -> RecordingDevice:
            return RecordingDevice(recorder)
        yield device_of, recorder
    finally:
        for name, original in originals.items():
            setattr(tensor_class, name, original)
        torch.tensor = _ORIGINAL["tensor"]
        torch.cuda.synchronize = original_sync


def mark_caches(recorder: _Recorder, caches) -> None:
    """The engine's KV caches are device memory."""
    for cache in caches:
        recorder.mark_device(cache)
