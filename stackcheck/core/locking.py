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


def run_folder(tmp_path_factory, name: str) -> Path:
    """A folder that every xdist worker of this pytest run shares (the parent of a worker's temporary folder is the
    run's), or this plain run's: where a result that several tests read is built once, under `folder_locked`."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
