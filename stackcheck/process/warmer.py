"""The bytecode warmer: one process that imports a set's libraries into the bytecode cache (envs.PYCACHE_DIR) while
a pytest run of many xdist workers starts, so that they read what it compiled instead of each compiling the same
modules at once. The command starts it beside pytest (`start`, `stop`); each worker, before it imports torch, waits
until the warmer has written torch's bytecode (`wait_for_torch`). Only the cache changes: what the warmer cannot
import or has not reached yet, a worker compiles as before. What each variant measured: docs/speed.md, session 19.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.core.protocol import WARMING_ENV

# The libraries a set's processes import, in the order an xdist worker first needs them: torch in its configure, the
# stack at collection, then what families import when they run (the Trainer, trl, DeepSpeed, inductor's compiler).
IMPORTS = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "transformers.trainer", "trl", "deepspeed",
           "torch._inductor.compile_fx")
FIRST = "torch"
# From how many xdist workers starting at once a run warms the cache beside them (2 cores: a third process would
# compete with the two).
FROM_WORKERS = 4
# The longest a worker waits for the warmer's torch: many times a cold import of it (docs/speed.md, "Numbers behind constants").
WAIT_SECONDS = 60.0
POLL_SECONDS = 0.05


def start(python: Path, workers: int, environ: dict[str, str]) -> subprocess.Popen | None:
    """The warmer of a run of `workers` xdist workers, started with `environ` (the pytest run's, its bytecode cache
    included), which it also marks for the workers to wait on (WARMING_ENV: the file it writes once it has imported
    FIRST, and its process id); None under FROM_WORKERS workers."""
    if workers < FROM_WORKERS:
        return None
    marker = Path(tempfile.mkdtemp(prefix="stackcheck-warm-")) / FIRST
    code = ("import importlib, pathlib\n"
            f"for name in {IMPORTS!r}:\n"
            "    try:\n        importlib.import_module(name)\n    except Exception:\n        pass\n"
            f"    if name == {FIRST!r}:\n        pathlib.Path({str(marker)!r}).touch()\n")
    warmer = subprocess.Popen([str(python), "-c", code], cwd=REPO_ROOT, env=environ, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    environ[WARMING_ENV] = f"{marker}{os.pathsep}{warmer.pid}"
    return warmer


def stop(warmer: subprocess.Popen | None, environ: dict[str, str]) -> None:
    """The warmer ended (killed if it still imports: pytest's run is over), its marker removed."""
    if warmer is None:
        return
    warmer.kill()
    warmer.wait()
    marker = Path(environ.pop(WARMING_ENV).rpartition(os.pathsep)[0])
    marker.unlink(missing_ok=True)
    marker.parent.rmdir()


def wait_for_torch(environ: dict[str, str] | None = None) -> float:
    """In an xdist worker of a warmed run, before it imports torch: wait until the warmer has imported it (its marker
    is there), has ended, or WAIT_SECONDS have passed. The seconds waited; 0 in a run without a warmer."""
    given = (environ if environ is not None else os.environ).get(WARMING_ENV)
    if not given:
        return 0.0
    marker, _, pid = given.rpartition(os.pathsep)
    began = time.monotonic()
    while not Path(marker).exists() and alive(int(pid)) and time.monotonic() - began < WAIT_SECONDS:
        time.sleep(POLL_SECONDS)
    return time.monotonic() - began


def alive(pid: int) -> bool:
    """Whether process `pid` still runs: an ended one its parent has not reaped yet (the command is in pytest's run)
    counts as ended."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
