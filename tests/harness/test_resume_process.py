"""The warm resume process (stackcheck.process.resume) resumes as a new process does: one checkpoint resumed
in a new process, and twice in a warm one after another architecture's resume, gives the same Record, bit for bit;
a resume that raises there is a ResumeFailed carrying the Failure of what raised, as in a new process, and ends the
warm process."""

import dataclasses

import pytest
import torch

from stackcheck.process.warm import POOL_ENV
from stackcheck.harness import checkpoint
from stackcheck.process import resume as resume_process
from stackcheck.harness.subject import UnderTest
from stackcheck.models import architectures

LLAMA3 = UnderTest(architectures.builtin()["llama3"], torch.device("cpu"))
QWEN3 = UnderTest(architectures.builtin()["qwen3"], torch.device("cpu"))
OPTIM = "adamw_torch"


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def trained(under_test: UnderTest, folder) -> checkpoint.Path:
    checkpoint.run_uninterrupted(under_test, folder, OPTIM)
    saved = checkpoint.checkpoint_dir(folder)
    assert checkpoint.saved_step(saved) == checkpoint.SAVE_STEPS, "scenario not reached: no checkpoint-2"
    return saved


def test_a_warm_process_resumes_as_a_new_one(monkeypatch, tmp_path):
    saved, other = trained(LLAMA3, tmp_path / "llama3"), trained(QWEN3, tmp_path / "qwen3")
    monkeypatch.setenv(POOL_ENV, "0")
    new = checkpoint.resume_in_fresh_process(LLAMA3, saved, tmp_path / "new", OPTIM)
    assert not resume_process._warm, "scenario not reached: the new process went through a warm one"

    monkeypatch.setenv(POOL_ENV, "1")
    try:
        checkpoint.resume_in_fresh_process(QWEN3, other, tmp_path / "warm-qwen3", OPTIM)
        (warm,) = resume_process._warm.values()
        first = checkpoint.resume_in_fresh_process(LLAMA3, saved, tmp_path / "warm-1", OPTIM)
        second = checkpoint.resume_in_fresh_process(LLAMA3, saved, tmp_path / "warm-2", OPTIM)
        assert list(resume_process._warm.values()) == [warm] and warm.cells == 3 and warm.alive(), (
            "scenario not reached: the three resumes did not go to one warm process")
        assert new.begin_step == checkpoint.SAVE_STEPS and sorted(new.losses) == [3, 4], "scenario not reached: no resume"
        for name, record in (("first", first), ("second", second)):
            for part in dataclasses.fields(checkpoint.Record):
                assert same(getattr(record, part.name), getattr(new, part.name)), (
                    f"the warm process's {name} resume differs from a new process's in its {part.name}")

        with pytest.raises(checkpoint.ResumeFailed) as failed:
            checkpoint.resume_in_fresh_process(LLAMA3, tmp_path / "no-checkpoint", tmp_path / "warm-3", OPTIM)
        assert failed.value.child_failure is not None, f"the warm process wrote no Failure: {failed.value}"
        assert not resume_process._warm and not warm.alive(), "the warm process outlived a resume that raised"
    finally:
        resume_process.close_all()
