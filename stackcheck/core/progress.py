"""How far a long run is: cells done of the total and an ETA, for matrix, gpu-matrix, gate and history.

The command (`Progress`) runs units, a set or a release's probe each, one pytest process per unit. After each
unit it prints one line, which is what a CI log shows. In a terminal, the unit's pytest process
(stackcheck.child.progress, which the runner always loads) also keeps one live line, rewritten after each cell
in place of pytest's per-test letters; failures still come in pytest's summary. The totals assume each unit still to run
has as many cells as the current one (the same families in each set or release).
"""

from __future__ import annotations

import json
import threading
import time

from stackcheck.core import protocol

# Set by the command for a unit's pytest process: what the live line needs to know of the whole run.
ENV = protocol.PROGRESS_ENV


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def line(command: str, kind: str, units: int, units_done: int, finished_cells: int, per_unit: int, running: int,
         elapsed: float) -> str:
    """Cells done (`finished_cells` of the units done, `running` of the one in progress) of the estimated total,
    which counts `per_unit` cells for each unit not done; the ETA comes from the pace so far."""
    done, total = finished_cells + running, finished_cells + per_unit * (units - units_done)
    eta = "done" if units_done == units else f"ETA {minutes(elapsed / done * (total - done))}" if done else "ETA unknown"
    return (f"{command}: {done} of {'' if units_done == units else '~'}{total} cells, "
            f"{units_done} of {units} {kind}s done, {minutes(elapsed)} in, {eta}")


class Progress:
    """The command's side: one line after each unit; the environment its pytest process reads for the live line."""

    def __init__(self, command: str, units: int, kind: str):
        self.command, self.units, self.kind = command, units, kind
        self.started = time.monotonic()
        self.units_done = self.finished_cells = self.per_unit = 0
        self.lock = threading.Lock()  # history finishes probes from several threads

    def env(self, live: bool = True) -> dict[str, str]:
        """Variables for the next unit's pytest process; `live`: False where units run side by side."""
        state = {"command": self.command, "kind": self.kind, "units": self.units, "units_done": self.units_done,
                 "finished_cells": self.finished_cells, "elapsed": time.monotonic() - self.started, "live": live}
        return {ENV: json.dumps(state)}

    def finished(self, name: str, cells: int) -> None:
        with self.lock:
            self.units_done += 1
            self.finished_cells += cells
            self.per_unit = max(self.per_unit, cells)
            print(f"== progress: {self.kind} {name} done, {cells} cells; " + line(
                self.command, self.kind, self.units, self.units_done, self.finished_cells, self.per_unit, 0,
                time.monotonic() - self.started), flush=True)
