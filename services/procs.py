"""Facts about operating-system processes that several services' clean-ups share."""
from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """A process ``pid`` exists (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
