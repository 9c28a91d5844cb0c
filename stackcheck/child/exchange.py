"""The exchange: each set of a run leaves what it wrote (a trained adapter, a quantized base checkpoint), with
what it measured, for the sets after it; a later set loads its baseline's, as a user loads after upgrading what
they saved before.

The runner names the baseline (`--stackcheck-baseline`); the folders lie beside the run's matrix.json
(`trained-adapters/<arch>/`, `base-checkpoints/<arch>/`). What each holds: docs/internals.md, "child/exchange.py".
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotations' only: a process that records no exchange (an xdist controller) never imports torch for it
    import torch

from stackcheck.core import results
from stackcheck.core.versions import slug

FOLDER_NAME = "trained-adapters"
FOLDER_NAMES = {"adapter": FOLDER_NAME, "base": "base-checkpoints"}


def folder_beside(results_path: Path, kind: str = "adapter") -> Path:
    return results_path.parent / FOLDER_NAMES[kind]


class ExportMissing(Exception):
    pass


@dataclass(frozen=True)
class Exchange:
    """One kind's folder for one architecture (None: this run exchanges nothing, as a single set without a results
    file), this set's name and the baseline it reads from."""

    folder: Path | None
    set_name: str
    baseline: str | None

    WHAT = "export '{name}'"  # how a message names one export

    def _target(self, name: str) -> Path | None:
        """A fresh folder for this set's export `name`, or None when the run exchanges nothing."""
        if self.folder is None:
            return None
        target = self.folder / slug(self.set_name) / name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        return target

    def _write_meta(self, target: Path, versions: dict[str, str], **meta) -> None:
        (target / "export.json").write_text(json.dumps({
            "set": self.set_name, "versions": versions, "fingerprint": results.fingerprint(), **meta}, indent=2))

    def _baseline_source(self, name: str) -> tuple[Path, dict] | None:
        """(folder, export.json) of the baseline's export `name`; None when this run names no baseline. Raises
        ExportMissing when it names one that left no such export made under the current family definitions."""
        if self.folder is None or self.baseline is None or self.baseline == self.set_name:
            return None
        source = self.folder / slug(self.baseline) / name
        if not (source / "export.json").exists():
            raise ExportMissing(f"set '{self.baseline}' left no {self.WHAT.format(name=name)} in {source}")
        meta = json.loads((source / "export.json").read_text())
        if meta["fingerprint"] != results.fingerprint():
            raise ExportMissing(f"set '{self.baseline}' wrote its {self.WHAT.format(name=name)} under other family definitions")
        return source, meta


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
class AdapterExchange(Exchange):
    WHAT = "trained '{name}' adapter"

    def export(self, name: str, adapter: Path, versions: dict[str, str], base_checkpoint: Path, base_logits: torch.Tensor,
               trained_logits: torch.Tensor, trained_tokens: list[int], tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Leave this set's trained adapter `name` for the sets after it (nothing when the run exchanges nothing),
        with `tensors` it measured on the trained model."""
        from safetensors.torch import save_file

        if (target := self._target(name)) is None:
            return
        shutil.copytree(adapter, target / "adapter")
        save_file({"base": base_logits.contiguous(), "trained": trained_logits.contiguous()}, target / "outputs.safetensors")
        save_file({key: value.contiguous() for key, value in (tensors or {}).items()}, target / "tensors.safetensors")
        self._write_meta(target, versions, base_checkpoint=str(base_checkpoint), trained_tokens=trained_tokens)

    def baseline_export(self, name: str) -> Export | None:
        """The baseline's export of its adapter `name`; None when this run names no baseline. Raises ExportMissing
        when it names one that left no such export made under the current family definitions."""
        from safetensors.torch import load_file

        if (found := self._baseline_source(name)) is None:
            return None
        source, meta = found
        outputs = load_file(source / "outputs.safetensors")
        return Export(meta["set"], meta["versions"], source / "adapter", Path(meta["base_checkpoint"]),
                      outputs["base"], outputs["trained"], meta["trained_tokens"], load_file(source / "tensors.safetensors"))


@dataclass(frozen=True)
class BaseExport:
    """A set's saved (quantized) base checkpoint, as read back by a later set. `refused`: the set could not build
    the model at all (the reason); then there is no checkpoint."""

    set_name: str
    versions: dict[str, str]
    checkpoint: Path | None
    source_checkpoint: Path | None  # the bf16 checkpoint the set quantized while loading
    outputs: dict[str, torch.Tensor]
    facts: dict
    refused: str | None = None


@dataclass(frozen=True)
class BaseExchange(Exchange):
    WHAT = "base checkpoint '{name}'"

    def export(self, name: str, checkpoint: Path, versions: dict[str, str], source_checkpoint: Path,
               outputs: dict[str, torch.Tensor], facts: dict | None = None) -> None:
        """Leave this set's saved base `name` (the folder `save_pretrained` wrote) for the sets after it, with the
        `outputs` the saved model gave and `facts` it counted of it."""
        from safetensors.torch import save_file

        if (target := self._target(name)) is None:
            return
        shutil.copytree(checkpoint, target / "checkpoint")
        save_file({key: value.contiguous() for key, value in outputs.items()}, target / "outputs.safetensors")
        self._write_meta(target, versions, source_checkpoint=str(source_checkpoint), facts=facts or {})

    def refuse(self, name: str, versions: dict[str, str], reason: str) -> None:
        """Say that this set could not write `name` at all (it cannot build the model), and why."""
        if (target := self._target(name)) is not None:
            self._write_meta(target, versions, refused=reason)

    def baseline_export(self, name: str) -> BaseExport | None:
        """The baseline's export `name`; None when this run names no baseline. Raises ExportMissing when it names one
        that left no such export made under the current family definitions."""
        from safetensors.torch import load_file

        if (found := self._baseline_source(name)) is None:
            return None
        source, meta = found
        if "refused" in meta:
            return BaseExport(meta["set"], meta["versions"], None, None, {}, {}, meta["refused"])
        return BaseExport(meta["set"], meta["versions"], source / "checkpoint", Path(meta["source_checkpoint"]),
                          load_file(source / "outputs.safetensors"), meta["facts"])
