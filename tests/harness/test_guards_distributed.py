"""The distributed contract families fail on deliberately broken engines: each guard puts a class of bug its property
exists for into every rank of a real gloo job (a `sitecustomize` on the ranks' path patches the library in the rank's
worker process only) and runs the family's real test against it.

Each guard launches the family's jobs on two CPU ranks: the resume guard (two jobs, about a minute of CI's 2 cores)
runs with STACKCHECK_DIST_CPU=all only, like the cell it guards."""

import importlib
import json
import os
import re
import textwrap
from types import SimpleNamespace

import pytest

from stackcheck.distributed import launcher
from stackcheck.distributed.cells import RANKS, Ranks
from stackcheck.distributed.outcome import RanksFailed, RankState

data_parallel = importlib.import_module("tests.contract.distributed.test_data_parallel_training")
resume = importlib.import_module("tests.contract.distributed.test_sharded_resume")
engine_accumulation = importlib.import_module("tests.contract.distributed.test_engine_accumulation")


def break_the_ranks(monkeypatch, tmp_path, patch: str) -> None:
    """`patch` (Python) runs in every rank's worker before its function: a sitecustomize on the ranks' PYTHONPATH (the
    launcher keeps the caller's), inert in the launcher and the supervisors."""
    site = tmp_path / "broken_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nif '--worker' in sys.argv:\n" + textwrap.indent(textwrap.dedent(patch), "    "))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("STACKCHECK_DIST_CPU", "all")  # the guarded cells are left out of the default CPU lane


def ranks_for(tmp_path) -> Ranks:
    return Ranks(SimpleNamespace(stash=pytest.Stash()), "cpu", tmp_path / "ranks")


@pytest.mark.parametrize("lane", ["cpu", "gpu"])
def test_deepspeed_cells_of_other_configs_share_the_engines_pool(tmp_path, lane):
    """Two cells of other DeepSpeed configs each write their own file, and on a warm pool each differs from the
    engine's own launch by variables only (accelerate's own launcher code says so: it passes the file's path and never
    reads it), the cell's path among them: both run on the engine's pool, each reading its own config."""
    first, second = Ranks(SimpleNamespace(stash=pytest.Stash()), lane, tmp_path / "a"), Ranks(SimpleNamespace(stash=pytest.Stash()), lane, tmp_path / "b")
    paths = [first.deepspeed_config({"zero_optimization": {"stage": 1}}), second.deepspeed_config({"zero_optimization": {"stage": 3}})]
    assert [json.loads(path.read_text())["zero_optimization"]["stage"] for path in paths] == [1, 3]
    assert paths == [tmp_path / cell / "ds_config.json" for cell in "ab"]
    env = launcher.job_environment(lane)
    for path, stage3 in zip(paths, (False, True)):
        overlay = launcher.options_environment("zero", {"deepspeed_config_file": str(path), "zero3_init_flag": stage3}, 1, env, path.parent)
        assert overlay is not None, "the cell's config changes more than its ranks' variables: it would start a pool of its own"
        assert overlay["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(path)


def failures(excinfo) -> list[str]:
    return [o.failure.message for o in excinfo.value.outcomes if o.state == RankState.FAILED]


def test_a_loss_scaled_by_the_world_size_fails_the_data_parallel_property(monkeypatch, tmp_path):
    """accelerate's backward on a loss multiplied by the world size (the class of transformers#34191's and #35839's
    scaling across devices): every rank's update comes out about twice one process's (2.08 measured: three SGD steps,
    each from where the last one left the weights)."""
    break_the_ranks(monkeypatch, tmp_path, """
        import accelerate
        original = accelerate.Accelerator.backward
        accelerate.Accelerator.backward = lambda self, loss, **kwargs: original(self, loss * self.num_processes, **kwargs)
    """)
    with pytest.raises(RanksFailed) as excinfo:
        data_parallel.test_ddp_qlora_steps_match_one_process(ranks_for(tmp_path), 2, "rank")
    messages = failures(excinfo)
    assert len(messages) == 2 and all(re.search(r"the LoRA update is 2\.\d\d times one process's", m) for m in messages), messages


@pytest.mark.skipif(os.environ.get("STACKCHECK_DIST_CPU") != "all", reason="two jobs a run: with STACKCHECK_DIST_CPU=all, as the cell")
def test_a_resume_that_restores_nothing_fails_the_resume_property(monkeypatch, tmp_path):
    """The Trainer under ZeRO-3 resuming without loading DeepSpeed's checkpoint (the class of transformers#24252 and
    peft#2040: a resumed run that restarts from the initial adapter and fresh moments), its step count kept: the
    resumed job's adapter, once the Trainer has loaded the checkpoint, is not the uninterrupted job's at the save."""
    break_the_ranks(monkeypatch, tmp_path, """
        import transformers.trainer
        transformers.trainer.deepspeed_load_checkpoint = lambda *args, **kwargs: None
    """)
    with pytest.raises(RanksFailed) as excinfo:
        resume.test_a_resumed_job_continues_the_uninterrupted_one(ranks_for(tmp_path), 2, "zero3", "lora", tmp_path)
    messages = failures(excinfo)
    assert messages and all("adapter, loaded from checkpoint-2, differs from the uninterrupted job's" in m for m in messages), messages


SPLIT_AUTO_BASE = """
    import os
    from pathlib import Path
    from stackcheck.harness import scenario
    from stackcheck.harness import load, place

    def split_auto(under_test, device_map=None, **kwargs):
        if device_map != "auto":
            return load.load_base(under_test, device_map=device_map, **kwargs)
        return place.split_base(under_test, Path(OFFLOAD + os.environ["RANK"]))

    scenario.load_base = split_auto
"""


@pytest.mark.skipif(os.environ.get("STACKCHECK_DIST_CPU") != "all", reason="two jobs a run: with STACKCHECK_DIST_CPU=all, as the cell")
def test_an_unclear_refusal_of_a_split_base_fails_the_auto_cell(monkeypatch, tmp_path):
    """`device_map="auto"` splitting the base across devices, as on a rank that sees several GPUs (here the harness's
    split base of the CPU lane, its final norm offloaded to disk: LoRA weights all on the CPU): accelerate's own refusal
    at `prepare` passes the auto cell, with its message as the result; the same refusal that does not say why fails it."""
    split = f"OFFLOAD = {str(tmp_path / 'offload-')!r}\n" + textwrap.dedent(SPLIT_AUTO_BASE)
    (tmp_path / "clear").mkdir()
    (tmp_path / "unclear").mkdir()
    break_the_ranks(monkeypatch, tmp_path / "clear", split)
    ranks = ranks_for(tmp_path / "clear")
    data_parallel.test_ddp_qlora_steps_match_one_process(ranks, 2, "auto")
    results = [outcome.result for outcome in ranks.node.stash[RANKS]]
    assert all("meta" in r["base_devices"] and "device_map='auto'" in r["refused_at_prepare"] for r in results), results

    break_the_ranks(monkeypatch, tmp_path / "unclear", split + textwrap.dedent("""
        import accelerate
        prepare = accelerate.Accelerator.prepare

        def unclear(self, *args, **kwargs):
            try:
                return prepare(self, *args, **kwargs)
            except ValueError:
                raise ValueError("this model cannot be prepared") from None

        accelerate.Accelerator.prepare = unclear
    """))
    with pytest.raises(RanksFailed) as excinfo:
        data_parallel.test_ddp_qlora_steps_match_one_process(ranks_for(tmp_path / "unclear"), 2, "auto")
    messages = failures(excinfo)
    assert len(messages) == 2 and all(m == "this model cannot be prepared" for m in messages), messages


@pytest.mark.skipif(os.environ.get("STACKCHECK_DIST_CPU") != "all", reason="a job of 20 to 30 s: with STACKCHECK_DIST_CPU=all")
def test_a_dropped_micro_batch_fails_the_engine_accumulation_property(monkeypatch, tmp_path):
    """DeepSpeed's engine leaving out the first micro-batch of every accumulated step (the class of deepspeed#7967's
    and #7981's dropped micro-steps): the update misses a third of the gradient, on every rank."""
    break_the_ranks(monkeypatch, tmp_path, """
        import deepspeed.runtime.engine as engine_module
        original = engine_module.DeepSpeedEngine.backward

        def backward(self, loss, *args, **kwargs):
            if not self.is_gradient_accumulation_boundary() and getattr(self, "guard_dropped_at", None) != self.global_steps:
                self.guard_dropped_at = self.global_steps
                return loss
            return original(self, loss, *args, **kwargs)

        engine_module.DeepSpeedEngine.backward = backward
    """)
    with pytest.raises(RanksFailed) as excinfo:
        engine_accumulation.test_accumulated_micro_batches_update_as_one_batch(ranks_for(tmp_path), 2, "z2-bf16-offload")
    messages = failures(excinfo)
    scales = [float(m) for message in messages for m in re.findall(r"the update is (\S+) times one process's", message)]
    assert len(scales) == 2 and all(0.3 < scale < 0.95 for scale in scales), messages
