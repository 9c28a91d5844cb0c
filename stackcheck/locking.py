"""One lock between processes: a folder's own flock, so no `.lock` file is left behind and a crashed holder's lock is
released with its process."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def folder_locked(folder: Path):
    """Exclusive use of `folder` (made if missing) between processes, until the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock
