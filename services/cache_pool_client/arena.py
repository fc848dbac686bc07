"""The pool's shared-memory arena: one pre-allocated file on a tmpfs, cut into fixed slots.

File layout (both sides read it the same way): a header page (magic, then the arena's random
token), a table of one 64-bit generation per slot, then the slots. The pool creates the file at
start, allocates all of it (``posix_fallocate``: the whole budget is resident from then on) and maps
it pre-faulted (``MAP_POPULATE``), asking for transparent huge pages (``MADV_HUGEPAGE``; the tmpfs
gives them only when its ``shmem_enabled`` or ``huge=`` mount option allows, else 4 KiB pages,
silently). Clients on the same host map the same file once (``ArenaMapping.open``), after reading
the token the pool gave them in ``Describe`` back from its header: a file of another pool, or no
file at all, means no shared memory (bytes go inline).

A block occupies ``ceil(size / slot_bytes)`` slots, not necessarily adjacent. Only the pool writes
the generation table: it bumps a slot's generation whenever the slot is freed, before anyone can
reuse it. A reader copies a block out and then compares the slots' generations with the ones its
Get returned (``ArenaMapping.intact``): a slot reused after eviction is never read as the old block.
(Ordering: x86-64 keeps stores and loads in order, which this relies on.)

Copies use numpy (one ``memcpy`` per run, GIL released), straight between the caller's buffers and
the mapping, a Put's or Get's blocks spread over a few threads (``copy_each``).
"""
from __future__ import annotations

import functools
import logging
import mmap
import os
import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from services.procs import process_alive

logger = logging.getLogger(__name__)

MAGIC = b"PRFAREN1"
TOKEN_BYTES = 16
PAGE = 4096
HEADER_BYTES = PAGE
ARENA_PREFIX = "prfaas-arena-"
COPY_THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    """Where the generation table and the slots are in an arena file of ``size`` bytes."""

    token: bytes
    slot_bytes: int
    slots_offset: int
    num_slots: int

    @classmethod
    def of(cls, token: bytes, size: int, slot_bytes: int) -> "ArenaLayout":
        num_slots = max(0, (size - HEADER_BYTES) // (slot_bytes + 8))
        slots_offset = _round_up(HEADER_BYTES + 8 * num_slots, PAGE)
        while num_slots and slots_offset + num_slots * slot_bytes > size:
            num_slots -= 1
        return cls(token, slot_bytes, slots_offset, num_slots)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slots_for(self, size: int) -> int:
        return max(1, -(-size // self.slot_bytes))


@dataclass(frozen=True, slots=True)
class ArenaBlock:
    """A block's bytes in the arena: its slots in order, their generations when it was written, its size."""

    slots: tuple[int, ...]
    generations: tuple[int, ...]
    size: int
    slot_bytes: int

    @property
    def footprint(self) -> int:
        """Bytes of the arena the block takes (whole slots)."""
        return len(self.slots) * self.slot_bytes

    def __len__(self) -> int:
        return self.size


def footprint(data) -> int:
    """Memory a stored value takes: whole slots for an arena block, else its length."""
    return data.footprint if isinstance(data, ArenaBlock) else len(data)


class ArenaMapping:
    """One process' mapping of an arena file: copies in and out of slots, generation reads."""

    def __init__(self, path: str, size: int, token: bytes, buffer: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self.token = token
        self._mmap = buffer
        self._bytes = np.frombuffer(buffer, np.uint8)
        self._generations = self._bytes[HEADER_BYTES:].view(np.uint64) if size > HEADER_BYTES else None

    @classmethod
    def create(cls, path: str, size: int) -> "ArenaMapping":
        """Create, allocate and map a new arena file (``0600``); ``OSError`` when the tmpfs has no room."""
        size = size // PAGE * PAGE
        if size <= HEADER_BYTES:
            raise OSError(f"an arena of {size} B has no room for slots")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            buffer = _map(fd, size)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        token = secrets.token_bytes(TOKEN_BYTES)
        buffer[:len(MAGIC) + TOKEN_BYTES] = MAGIC + token
        return cls(path, size, token, buffer)

    @classmethod
    def open(cls, path: str, size: int, token: bytes) -> "ArenaMapping | None":
        """Map the pool's arena when this process sees it (same file, same token), else None."""
        if not path or "\0" in path or size <= HEADER_BYTES or len(token) != TOKEN_BYTES:
            return None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if info.st_size != size or info.st_uid != os.getuid():
                return None
            if os.pread(fd, len(MAGIC) + TOKEN_BYTES, 0) != MAGIC + token:
                return None
            return cls(path, size, token, _map(fd, size))
        except OSError as exc:
            logger.warning("cannot map the cache pool's arena %s: %s", path, exc)
            return None
        finally:
            os.close(fd)

    @property
    def address(self) -> int:
        """Where the mapping starts in this process' memory (to register it as pinned memory)."""
        return self._bytes.ctypes.data

    def generation(self, slot: int) -> int:
        return int(self._generations[slot])

    def bump(self, slots: Iterable[int]) -> None:
        """The pool frees these slots: their old contents must no longer pass ``intact``."""
        for slot in slots:
            self._generations[slot] += 1

    def intact(self, block: ArenaBlock) -> bool:
        """Whether no slot of ``block`` was freed since it was written (check after copying out)."""
        return all(self._generations[s] == g for s, g in zip(block.slots, block.generations))

    def runs(self, layout: ArenaLayout, block: ArenaBlock) -> list[np.ndarray]:
        """The block's bytes as views of the mapping, one per slot (no copy)."""
        runs, left = [], block.size
        for slot in block.slots:
            start = layout.slots_offset + slot * layout.slot_bytes
            length = min(left, layout.slot_bytes)
            runs.append(self._bytes[start:start + length])
            left -= length
        return runs

    def write(self, layout: ArenaLayout, block: ArenaBlock, pieces: Sequence) -> None:
        copy_runs([p if hasattr(p, "copy_into") else as_array(p) for p in pieces], self.runs(layout, block))

    def read(self, layout: ArenaLayout, block: ArenaBlock) -> bytes:
        return b"".join(run.tobytes() for run in self.runs(layout, block))

    def close(self) -> None:
        """Drop this process' mapping (views handed out keep theirs until they go)."""
        self._generations = None
        self._bytes = None
        try:
            self._mmap.close()
        except BufferError:  # a caller still holds a view: the mapping goes with it
            pass


def copy_runs(sources: Sequence, targets: Sequence[np.ndarray]) -> None:
    """Copy the concatenation of ``sources`` into the concatenation of ``targets`` (equal lengths).
    A source is a flat uint8 array, or a piece that copies itself: ``copy_into(target, start)`` writes
    its bytes ``[start, start + len(target))`` (e.g. from device memory, ``kv_connector.pool.copies``).
    A piece with a ``batch`` only records its targets: the writer calls ``batch.flush()`` afterwards."""
    if sum(len(s) for s in sources) != sum(len(t) for t in targets):
        raise ValueError("copy between buffers of different total sizes")
    si = ti = s_off = t_off = 0
    while si < len(sources) and ti < len(targets):
        source, target = sources[si], targets[ti]
        count = min(len(source) - s_off, len(target) - t_off)
        if hasattr(source, "copy_into"):
            source.copy_into(target[t_off:t_off + count], s_off)
        else:
            np.copyto(target[t_off:t_off + count], source[s_off:s_off + count])
        s_off, t_off = s_off + count, t_off + count
        if s_off == len(source):
            si, s_off = si + 1, 0
        if t_off == len(target):
            ti, t_off = ti + 1, 0


def copy_each(copy: Callable[..., None], calls: Iterable[tuple]) -> None:
    """``copy(*args)`` for each of ``calls``, spread over ``COPY_THREADS`` threads (numpy releases the
    GIL while it copies, and one core alone does not reach the memory's bandwidth); the first
    error is raised once every call has ended."""
    calls = list(calls)
    if len(calls) < 2 or COPY_THREADS == 1:
        for args in calls:
            copy(*args)
        return
    futures = [_copiers().submit(copy, *args) for args in calls]
    for future in futures:
        future.exception()
    for future in futures:
        future.result()


@functools.cache
def _copiers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="prfaas-arena-copy")


def as_array(buffer) -> np.ndarray:
    """A flat uint8 view of any contiguous buffer (bytes, memoryview, numpy array), no copy."""
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buffer).cast("B"), np.uint8)


def arena_name(pool_name: str) -> str:
    return f"{ARENA_PREFIX}{_safe(pool_name)}-{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_arenas(directory: str, pool_name: str) -> None:
    """Remove arena files of killed pools of this name (their process is gone): their memory is the
    tmpfs', held until someone unlinks them."""
    prefix = f"{ARENA_PREFIX}{_safe(pool_name)}-"
    for entry in os.scandir(directory):
        if entry.name.startswith(prefix):
            pid = entry.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not process_alive(int(pid)):
                logger.warning("removing the arena %s of a cache pool that did not stop cleanly", entry.path)
                _unlink(entry.path)


def _map(fd: int, size: int) -> mmap.mmap:
    buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass  # no transparent huge pages here: 4 KiB pages
    return buffer


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
