"""matrix.json is written cell by cell, merges idempotently, and renders matrix.md from the same data."""

import json

import pytest

from stackcheck import results

VERSIONS = {"python": "3.11", "torch": "2.13.0", "transformers": "5.6.2", "peft": "0.19.1", "accelerate": "1.13.0", "bitsandbytes": "0.49.2"}


def cell(test, verdict, set_name="seed", bug=None):
    return {"set": set_name, "family": "shared_kv_redispatch", "test": test, "lane": "cpu", "verdict": verdict,
            "signature": "KeyError: 2 @ x" if bug else None, "bug": bug, "seconds": 1.5}


def test_each_cell_is_on_disk_as_soon_as_it_is_recorded(tmp_path):
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS)
    results.record_cell(path, cell("t1", "known_bug", bug="shared_kv_redispatch"))
    assert [c["test"] for c in json.loads(path.read_text())["cells"]] == ["t1"]
    results.record_cell(path, cell("t2", "pass"))
    data = json.loads(path.read_text())
    assert {c["test"] for c in data["cells"]} == {"t1", "t2"}
    assert set(data) == {"sets", "cells", "fingerprint"} and data["sets"]["seed"]["transformers"] == "5.6.2"
    assert set(results.CELL_KEYS) <= set(data["cells"][0])
    markdown = path.with_suffix(".md").read_text()
    assert "| shared_kv_redispatch | **known_bug** [shared_kv_redispatch]" in markdown
    assert "5.6.2" in markdown


def test_merge_is_idempotent_and_replaces_a_rerun_cell():
    run = {"sets": {"seed": VERSIONS}, "cells": [cell("t1", "known_bug", bug="shared_kv_redispatch")]}
    merged = results.merge_into(results.empty(), run)
    again = results.merge_into(json.loads(json.dumps(merged)), run)
    assert again == merged
    rerun = {"sets": {"seed": VERSIONS}, "cells": [cell("t1", "pass")]}
    assert [c["verdict"] for c in results.merge_into(merged, rerun)["cells"]] == ["pass"]


def test_merge_refuses_one_set_name_with_two_version_lists():
    merged = results.merge_into(results.empty(), {"sets": {"seed": VERSIONS}, "cells": []})
    with pytest.raises(ValueError, match="different versions"):
        results.merge_into(merged, {"sets": {"seed": dict(VERSIONS, peft="0.20.0")}, "cells": []})


def test_family_cell_shows_the_worst_verdict():
    assert results.worst(["pass", "known_bug", "pass"]) == "known_bug"
    assert results.worst(["known_bug", "new_failure"]) == "new_failure"
