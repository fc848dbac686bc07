"""Block bytes through a shared tmpfs for clients on the pool's host: one file per block.

A Put writes each block into its own file (``prfaas-put-…``), copying the bytes once, and the pool
adopts the file by renaming it into its own namespace (``prfaas-pool-<pool>-…``): no bytes pass
through gRPC or the pool process. A Get names the pool's files and the client reads them, again
one copy. The pool never maps the files (it holds no descriptor per block): it reads one only to
spill it to SSD or to answer a client without shared memory, and frees it by unlinking it, so the
memory budget counts tmpfs pages exactly as it counted bytes.

Whether a client shares the pool's tmpfs is tested, not assumed: the pool writes a probe file with
a random token and ``Describe`` tells its name and token; a client that reads the same token there
uses shared memory, any other falls back to inline bytes. Files are created ``0600``, so only the
pool's own user can take part. A pool removes its files at stop. One killed outright leaves them,
and a client killed between writing its files and its Put leaves those: at start and then every
``orphan_put_age_s / 2``, a pool removes the files of killed pools of its name and put files older
than ``orphan_put_age_s``.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PUT_PREFIX = "prfaas-put-"
ORPHAN_PUT_AGE_S = 120.0  # a put file is written just before its Put: one this old was never put
_PUT_NAME = re.compile(r"prfaas-put-[A-Za-z0-9_.-]{1,200}")


@dataclass(frozen=True, slots=True)
class ShmFile:
    """A block file named on the wire (``ShmFile`` in cache_pool.proto): a plain name and the size."""

    name: str
    size: int


@dataclass(frozen=True, slots=True)
class ShmBlockData:
    """A block's bytes in one file of the pool's shared-memory directory; ``len`` is their size."""

    path: str
    size: int

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return read_file(self.path, self.size)

    def release(self) -> None:
        _unlink(self.path)


def release(data) -> None:
    """Free a block's bytes when they live in a file (plain bytes need nothing)."""
    if isinstance(data, ShmBlockData):
        data.release()


def read_file(path: str, size: int) -> bytes:
    """The file's ``size`` bytes; ``FileNotFoundError`` when it is gone, ``OSError`` when short."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, size)
        if len(data) < size:
            data += _read_rest(fd, size - len(data))
    finally:
        os.close(fd)
    return data


def write_file(path: str, data) -> None:
    """Create ``path`` (``0600``, never an existing file) holding ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    os.close(fd)


class ShmStore:
    """The pool's side: its directory, probe file and adopted block files."""

    def __init__(self, directory: str | Path, pool_name: str, orphan_put_age_s: float = ORPHAN_PUT_AGE_S) -> None:
        self.directory = str(Path(directory).resolve())
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(f"shared-memory directory {self.directory} does not exist")
        self._pool_prefix = f"prfaas-pool-{_safe(pool_name)}-"
        self._orphan_put_age_s = orphan_put_age_s
        self.orphan_puts_removed = 0
        self._stopped = threading.Event()
        self.remove_stale_files()
        threading.Thread(target=self._sweep, name="prfaas-pool-shm-sweep", daemon=True).start()
        self._prefix = f"{self._pool_prefix}{os.getpid()}-{secrets.token_hex(4)}-"
        self._names = itertools.count()
        self.probe_file = f"{self._prefix}probe"
        self.probe_token = secrets.token_bytes(16)
        write_file(os.path.join(self.directory, self.probe_file), self.probe_token)

    def adopt(self, name: str, size: int) -> ShmBlockData:
        """Take over a client's block file; ``ValueError`` (the client's fault) when it is not one."""
        if not _PUT_NAME.fullmatch(name):
            raise ValueError(f"shm.name {name!r} is not a block file (a plain name starting with {PUT_PREFIX!r})")
        source = os.path.join(self.directory, name)
        try:
            info = os.lstat(source)
        except FileNotFoundError:
            raise ValueError(f"shm.name {name!r}: no such file in {self.directory}") from None
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ValueError(f"shm.name {name!r} is not a regular file of this pool's user")
        if info.st_size != size or size == 0:
            raise ValueError(f"shm.name {name!r} holds {info.st_size} bytes, the block says {size}")
        target = self._new_path()
        try:
            os.rename(source, target)
        except FileNotFoundError:
            raise ValueError(f"shm.name {name!r} vanished before the pool took it over") from None
        return ShmBlockData(target, size)

    def remove_stale_files(self) -> int:
        """Remove what nobody will read: files of killed pools of this name (their process is gone),
        and this user's put files older than ``orphan_put_age_s`` (their client died before its Put,
        or gave up on it without cleaning up). Returns how many put files went."""
        cutoff, removed = time.time() - self._orphan_put_age_s, 0
        for entry in os.scandir(self.directory):
            if entry.name.startswith(self._pool_prefix):
                pid = entry.name[len(self._pool_prefix):].split("-", 1)[0]
                if pid.isdigit() and not _alive(int(pid)):
                    _unlink(entry.path)
                continue
            if not entry.name.startswith(PUT_PREFIX):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # adopted or removed meanwhile
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and info.st_mtime < cutoff:
                _unlink(entry.path)
                removed += 1
        if removed:
            self.orphan_puts_removed += removed
            logger.warning("removed %d block file(s) that clients wrote to %s but never put (older than %.0f s)",
                           removed, self.directory, self._orphan_put_age_s)
        return removed

    def _sweep(self) -> None:
        while not self._stopped.wait(self._orphan_put_age_s / 2):
            try:
                self.remove_stale_files()
            except OSError as exc:
                logger.warning("sweeping %s for stale block files failed: %s", self.directory, exc)

    def close(self) -> None:
        """Stop sweeping and remove every file of this store (blocks and probe)."""
        self._stopped.set()
        for entry in os.scandir(self.directory):
            if entry.name.startswith(self._prefix):
                _unlink(entry.path)

    def _new_path(self) -> str:
        return os.path.join(self.directory, f"{self._prefix}{next(self._names):x}")


def same_host_directory(directory: str, probe_file: str, token: bytes) -> str | None:
    """``directory`` when this process sees the pool's probe file with its token, else None."""
    if not directory or not probe_file or "/" in probe_file:
        return None
    try:
        with open(os.path.join(directory, probe_file), "rb") as probe:
            return directory if probe.read(len(token) + 1) == token else None
    except OSError:
        return None


def _read_rest(fd: int, remaining: int) -> bytes:
    parts = []
    while remaining:
        part = os.read(fd, remaining)
        if not part:
            raise OSError("shared-memory block file is shorter than its block")
        parts.append(part)
        remaining -= len(part)
    return b"".join(parts)


def remove_files(directory: str, names) -> None:
    """Unlink these files of ``directory``; ones already gone are fine."""
    for name in names:
        _unlink(os.path.join(directory, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
