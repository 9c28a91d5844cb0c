"""The cross-release step of `matrix`: the writer set's checkpoints are written once per machine into the cache, read
by every set's cross-release cells, and written again where the family definitions change (environments and pytest
stood in for)."""

import json
import sys
from pathlib import Path

import pytest

from stackcheck import cli
from stackcheck.commands import cross_release, matrix as matrix_command
from stackcheck.core import results
from stackcheck.core.protocol import CROSS_RELEASE_OPTION
from stackcheck.runner import envs

RUN = ["matrix", "--sets", "seed,latest", "--arch", "llama3"]


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """`built`: the sets whose environment was asked for; `writes`: the writer runs (their pytest options); `reads`:
    each set's run, with the cross-release folder it was given (None: none)."""
    state = {"built": [], "writes": [], "reads": []}
    monkeypatch.setenv("STACKCHECK_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny-llama3-base"
    source.mkdir()

    def build(vset, find_links=(), no_index=False, groups=()):
        state["built"].append(vset.name)
        return Path(sys.executable)

    def write(python, vset, targets, extra, results_path, baseline=None, env=None, run=None):
        """The writer's cells as the exchange leaves them: one export per quantization of each architecture asked."""
        state["writes"].append(extra)
        archs = next(o for o in extra if o.startswith("--stackcheck-arch=")).split("=", 1)[1].split(",")
        for arch in archs:
            export = results_path.parent / "base-checkpoints" / arch / vset.slug / "cpu-nf4"
            export.mkdir(parents=True, exist_ok=True)
            (export / "export.json").write_text(json.dumps({"set": vset.name, "source_checkpoint": str(source)}))
        return 0

    def read(python, vset, targets, extra, results_path, baseline=None, env=None, run=None):
        given = [o.split("=", 1)[1] for o in extra if o.startswith(CROSS_RELEASE_OPTION + "=")]
        state["reads"].append((vset.name, given[0] if given else None))
        return 0

    monkeypatch.setattr(envs, "build", build)
    monkeypatch.setattr(envs, "versions_in", lambda python, vset: "scripted")
    monkeypatch.setattr(envs, "import_problem", lambda python: None)
    monkeypatch.setattr(cross_release, "run_pytest", write)
    monkeypatch.setattr(matrix_command, "run_pytest", read)
    state["source"] = source
    return state


def matrix(tmp_path, *extra, families="quantized_checkpoint"):
    return cli.main([*RUN, "--families", families, "--results", str(tmp_path / "m.json"), *extra])


def test_the_first_run_writes_the_cache_and_a_second_reuses_it(scripted, tmp_path, capsys):
    assert matrix(tmp_path) == 0
    (folder,) = (tmp_path / "cache" / "cross-release").iterdir()
    assert scripted["built"] == ["seed", "latest", "t4"] and len(scripted["writes"]) == 1
    assert "--stackcheck-arch=llama3" in scripted["writes"][0] and "test_saved_checkpoint_reloads_bit_exact" in scripted["writes"][0]
    assert f"== cross-release: set t4 wrote its checkpoints for llama3 into {folder} in " in capsys.readouterr().out
    assert scripted["reads"] == [("seed", str(folder)), ("latest", str(folder))]

    scripted.update(built=[], reads=[])
    assert matrix(tmp_path) == 0
    assert scripted["built"] == ["seed", "latest"] and len(scripted["writes"]) == 1  # the writer neither built nor run
    assert f"== cross-release: set t4's checkpoints reused from {folder}" in capsys.readouterr().out
    assert scripted["reads"] == [("seed", str(folder)), ("latest", str(folder))]


def test_other_family_definitions_or_a_cleared_tiny_cache_write_again(scripted, tmp_path, monkeypatch):
    assert matrix(tmp_path) == 0
    monkeypatch.setattr(results, "fingerprint", lambda: "0" * 16)
    assert matrix(tmp_path) == 0
    assert len(scripted["writes"]) == 2 and len(list((tmp_path / "cache" / "cross-release").iterdir())) == 2
    assert scripted["reads"][-1][1] != scripted["reads"][0][1]  # the new folder, never the stale one
    scripted["source"].rmdir()  # the bf16 checkpoint the writer quantized, which its cells read too
    assert matrix(tmp_path) == 0
    assert len(scripted["writes"]) == 3


@pytest.mark.parametrize("extra, families", [(["--no-cross-release"], "quantized_checkpoint"), (["--sets", "t4"], "quantized_checkpoint"),
                                             ([], "merge_parity")], ids=["opted out", "the writer in the run", "without the family"])
def test_no_cross_release_step(extra, families, scripted, tmp_path):
    """Opted out; the writer among the run's sets (`--sets t4,latest`: its cells read it as the baseline, as before);
    quantized_checkpoint not run."""
    assert matrix(tmp_path, *extra, families=families) == 0
    assert scripted["built"] == ["seed", "latest", *(["t4"] if extra == ["--sets", "t4"] else [])]
    assert not scripted["writes"] and all(folder is None for _set, folder in scripted["reads"])
