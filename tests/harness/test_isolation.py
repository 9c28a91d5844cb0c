"""A cell starts as a fresh process would, as far as the libraries' process-wide state goes (stackcheck.process.isolation):
accelerate's state that one test built is gone before the next, and garbage collection between tests still frees a
test's cycles. A nested pytest run of two tests in one process, with the plugin that does both."""

import subprocess
import sys
import textwrap

from stackcheck import REPO_ROOT

TESTS = '''
import gc, weakref

HELD = {}


class Cycle:
    def __init__(self):
        self.me = self


def test_builds_accelerate_state_and_a_cycle():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    Accelerator(cpu=True)
    assert AcceleratorState._shared_state, "no state was built"
    HELD["cycle"] = weakref.ref(Cycle())


def test_finds_neither():
    from accelerate.state import AcceleratorState, PartialState

    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}
    assert HELD["cycle"]() is None, "the first test's reference cycle was not collected"
'''


def test_the_next_test_finds_no_accelerate_state_and_no_garbage_of_the_last(tmp_path):
    (tmp_path / "test_two.py").write_text(TESTS)
    run = subprocess.run([sys.executable, "-m", "pytest", "test_two.py", "-p", "stackcheck.child.gc_freeze", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0 and "2 passed" in run.stdout, textwrap.shorten(run.stdout + run.stderr, 3000)


def test_the_next_cell_compiles_afresh_not_as_a_recompile():
    """Every model's forward goes through one shared frame (transformers' output-capturing wrapper): a second model
    compiled in the process is a second entry of that frame's cache, a recompile, unless dynamo was reset; after
    reset_libraries the frame holds nothing and the next model's compile is its first entry."""
    import torch
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from stackcheck.process.isolation import reset_libraries

    def wrapper(forward, x):  # the shared frame
        return forward(x) + 1

    def entries() -> int:
        return len(_debug_get_cache_entry_list(wrapper.__code__))

    x = torch.ones(3)
    try:
        torch.compile(wrapper, backend="eager")(torch.sin, x)
        torch.compile(wrapper, backend="eager")(torch.cos, x)
        assert entries() == 2, f"scenario not reached: two functions through the frame left {entries()} compiled entries"
        reset_libraries()
        assert entries() == 0, f"reset_libraries left {entries()} compiled entries of the shared frame"
        assert torch.equal(torch.compile(wrapper, backend="eager")(torch.tan, x), torch.tan(x) + 1) and entries() == 1
    finally:
        torch._dynamo.reset()


def test_a_warm_process_destroys_the_deepspeed_engines_a_cell_left(monkeypatch):
    """DeepSpeed engines outlive their cell in a warm rank (hooks' closures hold them) with their buffers: between
    cells each is destroyed once, as accelerate's free_memory does. A stand-in for deepspeed.runtime.engine (the real
    one needs a process group and takes seconds): what is checked is which live objects get destroy() and how often."""
    import types

    from stackcheck.process.isolation import release_deepspeed_engines

    class DeepSpeedEngine:
        def __init__(self):
            self.destroyed = 0

        def destroy(self):
            self.destroyed += 1

    class Failing(DeepSpeedEngine):
        def destroy(self):
            super().destroy()
            raise RuntimeError("destroy failed")

    monkeypatch.setitem(sys.modules, "deepspeed.runtime.engine", types.SimpleNamespace(DeepSpeedEngine=DeepSpeedEngine))
    held = [Failing(), DeepSpeedEngine()]  # held as a hook's closure holds them
    assert release_deepspeed_engines() == 2 and [engine.destroyed for engine in held] == [1, 1], (
        "a live engine was not destroyed, or one that raised stopped the others")
    held.append(DeepSpeedEngine())  # the next cell's
    assert release_deepspeed_engines() == 1 and [engine.destroyed for engine in held] == [1, 1, 1], (
        "an engine was destroyed twice")


def test_the_next_cell_finds_zero3s_module_stack_empty(monkeypatch):
    """ZeRO-3 pushes each engine's model onto parameter_offload.FWD_MODULE_STACK and never pops it; a fresh process
    starts with it empty, and so does the next cell after reset_libraries. A stand-in module, as above."""
    import types

    from stackcheck.process.isolation import reset_libraries

    stack = [object()]  # an earlier cell's model
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero.parameter_offload", types.SimpleNamespace(FWD_MODULE_STACK=stack))
    reset_libraries()
    assert stack == [], "the earlier cell's model is still on ZeRO-3's module stack"
