"""What a cell leaves in its process that the next cell must not see: the libraries' process-wide state.

A user's script starts with none of it; a pytest worker or a warm rank runs many cells in one process. accelerate's
shared states, transformers' DeepSpeed config, DeepSpeed's ZeRO-3 module stack and dynamo's compiled frames are
put back as a fresh process has them: `reset_libraries` after every test (stackcheck.child.gc_freeze) and between a
warm rank's cells, `leave_the_cell` (more) between the cells of a warm process. Why each: docs/internals.md,
"process/isolation.py"; what a recompile cost: docs/speed.md.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref


def reset_libraries() -> None:
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if "transformers.integrations.deepspeed" in sys.modules:
        sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()
    if "torch._dynamo" in sys.modules:  # what dynamo compiled, and its CUDA graphs: the next cell compiles afresh
        sys.modules["torch._dynamo"].reset()
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None and getattr(offload, "FWD_MODULE_STACK", None):  # empty in a fresh process
        offload.FWD_MODULE_STACK.clear()


def leave_the_cell(environ: dict, cwd: str) -> None:
    """Reset what a passed cell leaves in the process for the next one, the process group aside: accelerate's shared
    state (the next `Accelerator` or `PartialState` builds it again from the launch's variables and finds the process
    group initialized, as a second `Accelerator` of a user's script does), transformers' HfDeepSpeedConfig weak
    reference, then garbage and the DeepSpeed engines the cell left alive (release_deepspeed_engines), the
    environment, working folder and default dtype the process started with, and the CUDA cache."""
    reset_libraries()
    gc.collect()
    release_deepspeed_engines()  # destroy() drops the buffers' last references: no second collection
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_default_dtype(torch.float32)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def release_deepspeed_engines() -> int:
    """Destroy every DeepSpeed engine a cell left alive in a warm process, as accelerate's `free_memory` does between
    two trainings of one script (`DeepSpeedEngine.destroy`: ZeRO-3's hooks removed, its gradient buckets released).
    A user's job ends with its process; in a warm rank the engines stayed referenced (ZeRO-3's module stack, which
    reset_libraries empties, was one holder; with it empty they still lived) and piled up. On this machine a ZeRO-3
    rank held 1, then 2 live engines after its first two cells; on two H100s (latest, every
    family, 32 workers, 2026-11-27) the two ZeRO-3 pools' first ranks held 17.0 and 18.5 GiB of GPU 0 and cells
    elsewhere ran out of memory (13 new_failure, 4 error; one of them asked DeepSpeed for 1.86 GiB). How many it
    destroyed; a destroy that raises is reported on stderr (the rank's log) and the others are destroyed still."""
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    if engine_module is None:
        return 0
    engines = [thing for thing in gc.get_objects()
               if isinstance(thing, engine_module.DeepSpeedEngine) and thing not in _DESTROYED]
    for engine in engines:
        _DESTROYED.add(engine)
        try:
            engine.destroy()
        except Exception as exc:  # cleanup between cells: the next cell's own run says what it finds
            print(f"stackcheck: DeepSpeedEngine.destroy() raised {exc!r} between cells", file=sys.stderr)
    return len(engines)


_DESTROYED: weakref.WeakSet = weakref.WeakSet()  # engines destroyed already, still referenced (by closures of hooks)
