"""The adapter exchange hands a set's trained adapter to the sets after it, and refuses a stale or missing one."""

import json

import pytest
import torch

from stackcheck.child import exchange
from stackcheck.core import results


def exported(tmp_path, set_name="seed") -> exchange.AdapterExchange:
    adapter = tmp_path / "trained"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    sender = exchange.AdapterExchange(tmp_path / "exchange", set_name, None)
    sender.export("language", adapter, {"transformers": "5.6.2"}, tmp_path / "base", torch.zeros(1, 2), torch.ones(1, 2), [3, 4],
                  {"delta": torch.full((2, 2), 5.0)})
    return sender


def test_a_later_set_reads_what_its_baseline_exported(tmp_path):
    folder = exported(tmp_path, "seed+transformers==5.5.1").folder

    export = exchange.AdapterExchange(folder, "latest", "seed+transformers==5.5.1").baseline_export("language")

    assert export.set_name == "seed+transformers==5.5.1" and export.versions == {"transformers": "5.6.2"}
    assert (export.adapter / "adapter_config.json").exists() and export.base_checkpoint == tmp_path / "base"
    assert torch.equal(export.trained_logits, torch.ones(1, 2)) and export.trained_tokens == [3, 4]
    assert export.tensors.keys() == {"delta"} and torch.equal(export.tensors["delta"], torch.full((2, 2), 5.0))


def test_no_baseline_or_no_results_file_means_no_exchange(tmp_path):
    folder = exported(tmp_path).folder
    assert exchange.AdapterExchange(folder, "latest", None).baseline_export("language") is None
    assert exchange.AdapterExchange(folder, "seed", "seed").baseline_export("language") is None
    assert exchange.AdapterExchange(None, "latest", "seed").baseline_export("language") is None


def test_a_missing_or_stale_export_is_refused(tmp_path):
    folder = exported(tmp_path).folder
    with pytest.raises(exchange.ExportMissing, match="set 'other' left no trained 'language' adapter"):
        exchange.AdapterExchange(folder, "latest", "other").baseline_export("language")
    with pytest.raises(exchange.ExportMissing, match="set 'seed' left no trained 'experts' adapter"):
        exchange.AdapterExchange(folder, "latest", "seed").baseline_export("experts")
    meta = folder / "seed" / "language" / "export.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), fingerprint="0" * 16)))
    assert results.fingerprint() != "0" * 16
    with pytest.raises(exchange.ExportMissing, match="other family definitions"):
        exchange.AdapterExchange(folder, "latest", "seed").baseline_export("language")


def test_a_baseline_that_met_a_known_bug_before_exporting_makes_the_upgrade_cell_not_applicable(tmp_path):
    """adapter_round_trip's cross-set cell, where the baseline left no adapter: not applicable where the baseline's
    own training cell (the same parameters) is recorded as a known bug, which stopped it before its export (seed's
    MoE training meets `peft_moe_all_linear_charset`); scenario not reached where that cell was judged otherwise."""
    import importlib
    from types import SimpleNamespace

    from stackcheck.core.cell import Cell
    from stackcheck.models.tiny import NotApplicable
    from stackcheck.harness.scenario import ScenarioNotReached

    family = importlib.import_module("tests.families.test_adapter_round_trip")
    module = "tests/families/test_adapter_round_trip.py"
    path = tmp_path / "matrix.json"

    def cross_set_cell(trained_verdict: str, bug: str | None):
        data = results.empty()
        data["cells"] = [Cell("seed", "adapter_round_trip", f"{module}::test_trained_adapter_reloads_onto_a_fresh_4bit_base[cpu-qwen3moe]",
                              "cpu", trained_verdict, bug=bug)]
        results.save(path, data, markdown=False)
        request = SimpleNamespace(config=SimpleNamespace(getoption=lambda name: str(path)),
                                  node=SimpleNamespace(nodeid=f"{module}::test_adapter_trained_by_the_baseline_set_reloads[cpu-qwen3moe]",
                                                       originalname="test_adapter_trained_by_the_baseline_set_reloads"))
        family.test_adapter_trained_by_the_baseline_set_reloads(None, None, exchange.AdapterExchange(tmp_path / "exchange", "latest", "seed"), request)

    with pytest.raises(NotApplicable, match="set 'seed' left no trained 'language' adapter .* known bug peft_moe_all_linear_charset"):
        cross_set_cell("known_bug", "peft_moe_all_linear_charset")
    with pytest.raises(ScenarioNotReached, match="set 'seed' left no trained 'language' adapter"):
        cross_set_cell("new_failure", None)
