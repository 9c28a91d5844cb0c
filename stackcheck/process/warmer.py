"""The bytecode warmer: one process that imports a set's libraries into the bytecode cache (envs.PYCACHE_DIR) while
a pytest run of many xdist workers starts, so that they read what it compiled instead of each compiling the same
modules at once (on a fresh machine, or a set's first run, the cache is empty). Both sides of the process boundary
use it: the command starts the warmer beside pytest (`start`, `stop`); each worker, before it imports torch, waits
until the warmer has written torch's bytecode (`wait_for_torch`), which is the first and largest thing a worker
imports. Only the cache changes: a library the warmer cannot import is skipped, and what it has not reached yet a
worker compiles as before.

What was measured on fresh H100 machines (16 workers, latest, the cache emptied before each run; docs/speed.md,
session 19), each worker's start-up and collection:
- nothing warmed: 16.8 to 18.0 CPU-seconds (20.2 s from pytest's start until the last had collected); where pytest's
  controller itself had imported torch before starting its workers (until this session): 10.2 to 11.6;
- the warmer beside the workers, nobody waiting: 13.1 to 14.8 (17.0 s), the warmer 26 CPU-seconds;
- on a slower machine, each variant twice: torch warmed before pytest started, 15.3 and 16.0 (medians), the last
  worker collected 27.8 and 29.1 s after the command's start; the warmer beside them, 21.2 and 20.6 (32.1, 32.2 s);
  nothing warmed, 23.3 and 23.2 (35.0, 35.1 s). torch first is what pays;
- on another, each twice: the workers waiting here, 14.4 and 18.1 (the last collected 21.1 and 29.2 s after the
  command's start); torch warmed before pytest started, 11.6 and 15.0 (21.1, 29.7 s); nothing warmed, 20.0 and 20.8
  (28.8, 31.2 s). Waiting in the workers is as fast, and the command and pytest's controller do not wait.
Compiling the whole site-packages before pytest instead (session 18: about 110 CPU-seconds, 11.5 to 15.1 s before
pytest started) started the first test later.
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
# The longest a worker waits for the warmer's torch: a cold import of it takes 4 to 6 s on the H100 hosts.
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
