"""The distributed contract families fail on deliberately broken engines: each guard puts a class of bug its property
exists for into every rank of a real gloo job (a `sitecustomize` on the ranks' path patches the library in the rank's
worker process only) and runs the family's real test against it.

Each guard launches the family's jobs on two CPU ranks: the resume guard (two jobs, about a minute of CI's 2 cores)
runs with STACKCHECK_DIST_CPU=all only, like the cell it guards."""

import importlib
import os
import re
import textwrap
from types import SimpleNamespace

import pytest

from stackcheck.distributed.cells import Ranks
from stackcheck.distributed.outcome import RanksFailed, RankState

data_parallel = importlib.import_module("tests.contract.distributed.test_data_parallel_training")
resume = importlib.import_module("tests.contract.distributed.test_sharded_resume")


def break_the_ranks(monkeypatch, tmp_path, patch: str) -> None:
    """`patch` (Python) runs in every rank's worker before its function: a sitecustomize on the ranks' PYTHONPATH (the
    launcher keeps the caller's), inert in the launcher and the supervisors."""
    site = tmp_path / "broken_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nif '--worker' in sys.argv:\n" + textwrap.indent(textwrap.dedent(patch), "    "))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("STACKCHECK_DIST_CPU", "all")  # the guarded cells are left out of the default CPU lane


def ranks_for(tmp_path) -> Ranks:
    return Ranks(SimpleNamespace(), "cpu", tmp_path / "ranks")


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
    resumed steps move the adapter otherwise than the uninterrupted job."""
    break_the_ranks(monkeypatch, tmp_path, """
        import transformers.trainer
        transformers.trainer.deepspeed_load_checkpoint = lambda *args, **kwargs: None
    """)
    with pytest.raises(RanksFailed) as excinfo:
        resume.test_a_resumed_job_continues_the_uninterrupted_one(ranks_for(tmp_path), 2, "zero3", "lora", tmp_path)
    messages = failures(excinfo)
    assert messages and all("differ from the uninterrupted job's" in m for m in messages), messages
