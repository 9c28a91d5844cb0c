"""What a cell leaves in its process that the next cell must not see: the libraries' process-wide state.

A user's script starts with none of it; a pytest worker or a warm rank runs many cells in one process. accelerate keeps
its AcceleratorState, PartialState and GradientState as class-wide shared dicts: the first `Accelerator` of a process
fixes the device type, and a later one that asks for another raises (`AcceleratorState has already been initialized
and cannot be changed, restart your runtime completely and pass cpu=True to Accelerator()`). Measured on a GPU host,
where one worker runs GPU-lane and CPU-lane cells: every CPU-lane GRPO cell that followed a GPU-lane Trainer read that
error as a new failure. transformers keeps a weak reference to the HfDeepSpeedConfig of the last DeepSpeed run.

`reset_libraries` puts both back as a fresh process has them (the next `Accelerator` builds its state again from the
environment, and finds a process group that is already up, as a second `Accelerator` of a user's script does). It is
called after every test (stackcheck.gc_freeze) and between a warm rank's cells (stackcheck.distributed.rank); it
imports nothing a cell did not import. `leave_the_cell` does that and more, between the cells of a warm process (a rank
pool's rank, the warm resume process of stackcheck.harness.resume_process)."""

from __future__ import annotations

import os
import sys


def reset_libraries() -> None:
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if "transformers.integrations.deepspeed" in sys.modules:
        sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()


def leave_the_cell(environ: dict, cwd: str) -> None:
    """Reset what a passed cell leaves in the process for the next one, the process group aside: accelerate's shared
    state (the next `Accelerator` or `PartialState` builds it again from the launch's variables and finds the process
    group initialized, as a second `Accelerator` of a user's script does), transformers' HfDeepSpeedConfig weak
    reference, the environment, working folder and default dtype the process started with, then garbage and the CUDA
    cache."""
    import gc

    reset_libraries()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_default_dtype(torch.float32)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
