"""The adapter exchange: each set of a run leaves the adapter it trained, with what it measured, for the sets
after it; a candidate set loads its baseline's, as a user loads the adapter they trained before upgrading.

The runner names the folder (beside the run's matrix.json, one per architecture) and the baseline: the gate's baseline for its
candidate, the first set of a `matrix` run for the others. A set may train several adapters (say one on the
attention and one on a mixture of experts' fused expert parameters); it exports each under
`<folder>/<set slug>/<adapter name>/`: `adapter/` (PEFT's `save_pretrained`), `outputs.safetensors` (the logits
of the base and of the trained model on the prompt), `tensors.safetensors` (what else it measured on the trained
model) and `export.json` (the set's versions, the greedy tokens, the base checkpoint the adapter was trained on,
and the fingerprint of the family definitions it was trained under).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from stackcheck import results
from stackcheck.versions import slug

FOLDER_NAME = "trained-adapters"


def folder_beside(results_path: Path) -> Path:
    return results_path.parent / FOLDER_NAME


@dataclass(frozen=True)
class Export:
    """A set's trained adapter, as read back by a later set."""

    set_name: str
    versions: dict[str, str]
    adapter: Path
    base_checkpoint: Path
    base_logits: torch.Tensor
    trained_logits: torch.Tensor
    trained_tokens: list[int]
    tensors: dict[str, torch.Tensor]  # what else the set measured on its trained model (its LoRA deltas, say)


@dataclass(frozen=True)
class AdapterExchange:
    folder: Path | None  # None: this run exchanges nothing (a single set, no results file)
    set_name: str
    baseline: str | None

    def export(self, name: str, adapter: Path, versions: dict[str, str], base_checkpoint: Path, base_logits: torch.Tensor,
               trained_logits: torch.Tensor, trained_tokens: list[int], tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Leave this set's trained adapter `name` for the sets after it (nothing when the run exchanges nothing),
        with `tensors` it measured on the trained model."""
        from safetensors.torch import save_file

        if self.folder is None:
            return
        target = self.folder / slug(self.set_name) / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(adapter, target / "adapter")
        save_file({"base": base_logits.contiguous(), "trained": trained_logits.contiguous()}, target / "outputs.safetensors")
        save_file({key: value.contiguous() for key, value in (tensors or {}).items()}, target / "tensors.safetensors")
        (target / "export.json").write_text(json.dumps({
            "set": self.set_name, "versions": versions, "base_checkpoint": str(base_checkpoint),
            "trained_tokens": trained_tokens, "fingerprint": results.fingerprint(),
        }, indent=2))

    def baseline_export(self, name: str) -> Export | None:
        """The baseline's export of its adapter `name`; None when this run names no baseline. Raises ExportMissing
        when it names one that left no such export made under the current family definitions."""
        from safetensors.torch import load_file

        if self.folder is None or self.baseline is None or self.baseline == self.set_name:
            return None
        source = self.folder / slug(self.baseline) / name
        if not (source / "export.json").exists():
            raise ExportMissing(f"set '{self.baseline}' left no trained '{name}' adapter in {source}")
        meta = json.loads((source / "export.json").read_text())
        if meta["fingerprint"] != results.fingerprint():
            raise ExportMissing(f"set '{self.baseline}' trained its '{name}' adapter under other family definitions")
        outputs = load_file(source / "outputs.safetensors")
        return Export(meta["set"], meta["versions"], source / "adapter", Path(meta["base_checkpoint"]),
                      outputs["base"], outputs["trained"], meta["trained_tokens"], load_file(source / "tensors.safetensors"))


class ExportMissing(Exception):
    pass
