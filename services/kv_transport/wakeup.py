"""A self-pipe that wakes an I/O thread sleeping in epoll from any other thread."""
from __future__ import annotations

import os


class WakePipe:
    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"x")
        except OSError:
            pass  # a wake-up is already pending (pipe full), or the I/O thread has closed the pipe

    def drain(self) -> None:
        """Called by the woken thread, so that the next wait sleeps again."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._write_fd)
