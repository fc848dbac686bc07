"""A self-pipe that wakes an I/O thread sleeping in epoll from any other thread."""
from __future__ import annotations

import os
import threading


class WakePipe:
    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        with self._lock:  # never write to a closed descriptor: its number may belong to another file by now
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"x")
            except BlockingIOError:
                pass  # a wake-up is already pending (pipe full)

    def drain(self) -> None:
        """Called by the woken thread, so that the next wait sleeps again."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self.fd)
            os.close(self._write_fd)
