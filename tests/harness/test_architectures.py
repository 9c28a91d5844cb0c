"""The architecture axis: the shrink rule keeps what decides code paths, and `--arch` refuses in one line what
cannot run, before any environment is built."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from stackcheck import REPO_ROOT
from stackcheck.models import architectures, tiny
from stackcheck.models.tiny import FIXTURES_DIR

FULL_CONFIGS = sorted(architectures.ARCHITECTURES_DIR.glob("*.json")) + sorted(FIXTURES_DIR.glob("gemma4-*/config.json"))
TINY_PARAMETERS = 5_000_000


def built(config: dict, device: str):
    settings = {key: value for key, value in config.items() if not key.startswith("_")}
    built_config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device(device):
        return built_config, getattr(transformers, config["architectures"][0])(built_config)


def module_classes(model) -> set[str]:
    return {type(module).__name__ for module in model.modules()}


@pytest.mark.parametrize("path", FULL_CONFIGS, ids=[p.parent.name if p.name == "config.json" else p.stem for p in FULL_CONFIGS])
def test_shrink_keeps_the_structure_of_the_full_config(path):
    """The tiny model has every module class of the full model built on meta, the same structures, a few
    parameters, and 4-bit-quantizable widths that are multiples of 64 in its language model."""
    full = json.loads(path.read_text())
    full_config, full_model = built(full, "meta")
    tiny_config, tiny_model = built(architectures.shrink(full, path.name), "cpu")

    assert module_classes(tiny_model) == module_classes(full_model)
    assert architectures.structures(tiny_config) == architectures.structures(full_config)
    assert sum(p.numel() for p in tiny_model.parameters()) < TINY_PARAMETERS
    head = tiny_model.get_output_embeddings()
    towers = tuple(f"model.{key.removesuffix('_config')}" for key in architectures.TOWER_KEYS)
    odd = [(name, tuple(m.weight.shape)) for name, m in tiny_model.named_modules()
           if isinstance(m, torch.nn.Linear) and m is not head and not name.startswith(towers)
           and (m.in_features % 64 or m.out_features % 64) and m.out_features >= 64]
    assert not odd, f"widths that are not multiples of 64: {odd}"


def test_every_builtin_architecture_builds_and_names_its_structures():
    chosen = architectures.resolve(None)
    assert chosen[0].name == architectures.SEED_ARCHITECTURE and len(chosen) >= 7
    found = {arch.name: architectures.structures(built(arch.config, "meta")[0]) for arch in chosen}
    assert {"kv_sharing", "clippable_linear", "vision_tower", "audio_tower"} <= found["gemma4"]
    assert sum("experts" in s for s in found.values()) >= 2
    assert sum("tied_embeddings" in s for s in found.values()) >= 3
    assert "sliding_window" in found["gemma3"]


def test_a_hybrid_linear_attention_model_keeps_both_layer_kinds():
    """Qwen3-Next's release spells its pattern as `full_attention_interval` (transformers derives `layer_types`):
    the tiny model keeps one period, three Gated DeltaNet layers and one full-attention layer, and the delta net's
    grouping of key heads over value heads."""
    config, _model = built(architectures.builtin()["qwen3next"].config, "meta")
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.linear_num_value_heads == 2 * config.linear_num_key_heads


def test_a_fixed_size_image_tower_keeps_its_pooling():
    """Gemma 3's SigLIP tower reads 896-pixel images in 14-pixel patches, pooled 4 x 4 to 256 soft tokens: the tiny one
    reads 8 x 8 patches of the same size, pooled by the same kernel to 4 tokens."""
    config = architectures.builtin()["gemma3mm"].config
    assert (config["vision_config"]["image_size"], config["vision_config"]["patch_size"], config["mm_tokens_per_image"]) == (112, 14, 4)


def stackcheck(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stackcheck", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", ["unknown_name", "not_json", "cannot_shrink", "unknown_model_type", "missing_file"])
def test_arch_mistakes_are_one_line_and_exit_2_before_any_build(case, tmp_path):
    llama = json.loads((architectures.ARCHITECTURES_DIR / "llama3.json").read_text())
    spec = {
        "unknown_name": "llama9",
        "not_json": str(write(tmp_path, "config.json", "{ not json")),
        "cannot_shrink": str(write(tmp_path, "config.json", json.dumps(llama | {"kv_lora_rank": 512}))),
        "unknown_model_type": str(write(tmp_path, "config.json", json.dumps(llama | {"model_type": "llama99"}))),
        "missing_file": str(tmp_path / "nowhere" / "config.json"),
    }[case]

    run = stackcheck("matrix", "--sets", "seed", "--arch", spec, "--results", str(tmp_path / "matrix.json"))

    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and run.stderr.startswith("stackcheck: --arch"), run.stderr
    assert "installed" not in run.stdout  # no environment was built


def test_a_users_config_runs_the_families_under_its_own_name(tmp_path):
    """`--arch path/to/config.json`: a Hub snapshot's config is shrunk and every cell carries its name."""
    snapshot = tmp_path / "My-Llama"
    snapshot.mkdir()
    (snapshot / "config.json").write_text((architectures.ARCHITECTURES_DIR / "llama3.json").read_text())
    results = tmp_path / "matrix.json"

    subprocess.run([sys.executable, "-m", "pytest", "tests/families/test_params4bit_kwargs.py", "-q", "-p", "no:cacheprovider",
                    "--stackcheck-lanes=cpu", f"--stackcheck-arch={snapshot / 'config.json'}", f"--stackcheck-results={results}"],
                   cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)

    cells = json.loads(results.read_text())["cells"]
    assert cells and {cell["arch"] for cell in cells} == {"my_llama"}
    assert all("[cpu-my_llama]" in cell["test"] and cell["verdict"] in ("pass", "known_bug") for cell in cells), cells


@pytest.mark.parametrize("name", sorted(architectures.builtin()))
def test_building_a_tiny_config_leaves_the_architecture_as_it_was(name):
    """transformers fills nested settings in place (5.23: Phi-4's rope_scaling); the architecture's digest names its
    cache folder, so a config built from it must not change it: else a job's ranks ask for another checkpoint than
    their caller built (and a rank other than 0 saves an empty one under its process group)."""
    arch = architectures.builtin()[name]
    before = arch.digest_text()
    tiny.tiny_config(arch)
    assert arch.digest_text() == before


def test_a_fixture_built_empty_is_never_cached(tmp_path):
    target = tmp_path / "cache" / "base"
    target.parent.mkdir()
    with pytest.raises(tiny.FixtureError, match="built empty"):
        tiny._build_once(target, lambda out: None)
    assert not target.exists()
