"""The architectures the families run on, and the one rule that shrinks a `config.json` to a tiny model of the
same structure.

Built in: every `fixtures/architectures/<name>.json` (a full-size published config, shrunk by `shrink`) and `gemma4`,
the seed's tiny Gemma 4, kept as written. What decides code paths is kept; only sizes shrink. Adding an architecture
is one config file. What is kept and why: docs/internals.md, "models/architectures.py".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from stackcheck.models.tiny import FIXTURES_DIR

ARCHITECTURES_DIR = FIXTURES_DIR / "architectures"
SEED_ARCHITECTURE = "gemma4"
SEED_TINY_CONFIG = FIXTURES_DIR / "tiny_gemma4.json"

VOCAB = 256  # the prompt's token ids reach 247
HIDDEN, HEAD_DIM, HEADS = 128, 64, 2
INTERMEDIATE, EXPERT_INTERMEDIATE = 256, 128
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
TOWER_HIDDEN, TOWER_INTERMEDIATE, TOWER_HEAD_DIM = 64, 128, 32
LINEAR_HEAD_DIM = 32
SLIDING_WINDOW = 16  # as the seed's tiny Gemma 4: the prompt and its generation stay under it
# Sizes the rule sets, by key. Any other integer key that names a size and exceeds these is a structure the rule
# does not know: the config cannot be shrunk (refused, never built at full size).
TEXT_SIZES = {
    "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
    "head_dim": HEAD_DIM, "global_head_dim": HEAD_DIM, "hidden_size_per_layer_input": 64,
    "moe_intermediate_size": EXPERT_INTERMEDIATE, "shared_expert_intermediate_size": EXPERT_INTERMEDIATE,
    # Gated DeltaNet (Qwen3-Next's linear attention): its head dims; its head counts shrink keeping their ratio
    # (`_shrink_text`). Its torch fallback (CPU, or a GPU without flash-linear-attention) costs per head.
    "linear_key_head_dim": LINEAR_HEAD_DIM, "linear_value_head_dim": LINEAR_HEAD_DIM,
}
TOWER_SIZES = {"hidden_size": TOWER_HIDDEN, "intermediate_size": TOWER_INTERMEDIATE, "head_dim": TOWER_HEAD_DIM,
               "global_head_dim": TOWER_HEAD_DIM, "output_proj_dims": TOWER_HIDDEN, "position_embedding_size": 64,
               "subsampling_conv_channels": [8, 4]}  # the seed's tiny Gemma 4 towers
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "top_k", "experts_per_token")
SIZE_KEY = re.compile(r".*(size|dim|dims|rank|features|channels|experts)$")
LARGEST_UNSHRUNK_SIZE = 256
TOWER_KEYS = ("vision_config", "audio_config")
# An image tower that reads a fixed square image (SigLIP's `image_size`, in `patch_size` pixels a side): the tiny tower
# reads this many patches a side, and a pooled projector (Gemma 3's `mm_tokens_per_image`) keeps its pooling kernel.
IMAGE_PATCHES_PER_SIDE = 8
# The structures a family can need (`pytest.mark.needs`), read off a built config by `structures`.
STRUCTURES = ("vision_tower", "audio_tower", "clippable_linear", "kv_sharing", "experts", "tied_embeddings", "sliding_window")


class ArchitectureError(Exception):
    """An architecture that cannot be run: an unknown name, a config that is not JSON or cannot be shrunk."""


@dataclass(frozen=True)
class Architecture:
    name: str
    source: str  # where the config came from: a built-in fixture or the user's file
    config: dict  # the tiny config.json, `model_type` and `architectures` included
    # What a built-in config says it has (its "_structures" key), checked against what the tiny model has, so
    # that a broken fixture errors instead of turning its cells not_applicable; None for a user's config.
    declared: frozenset[str] | None = None

    def __post_init__(self) -> None:  # a repro script rebuilds it from JSON, where the set is a list
        if self.declared is not None:
            object.__setattr__(self, "declared", frozenset(self.declared))

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def model_class(self) -> str:
        """The transformers class `from_pretrained` loads, as the config names it."""
        return (self.config.get("architectures") or ["AutoModelForCausalLM"])[0]

    def digest_text(self) -> str:
        return json.dumps(self.config, sort_keys=True)

    def __hash__(self) -> int:  # the config is a dict: hash what it says (tiny's builders are cached per architecture)
        return hash((self.name, self.digest_text()))


def _period(layer_types: list[str]) -> int:
    """The length of the shortest prefix that, repeated, gives `layer_types` (at least 2 layers)."""
    for length in range(1, len(layer_types) + 1):
        if all(kind == layer_types[index % length] for index, kind in enumerate(layer_types)):
            return max(length, 2)
    return len(layer_types)


def _remap_token_ids(config: dict, vocab: int) -> None:
    """Token ids past the tiny vocabulary move to its top, distinct ids staying distinct."""
    large = sorted({i for key, value in config.items() if key.endswith(("_token_id", "_token_index"))
                    for i in (value if isinstance(value, list) else [value]) if isinstance(i, int) and i >= vocab})
    moved = {old: vocab - 1 - rank for rank, old in enumerate(large)}
    for key, value in config.items():
        if key.endswith(("_token_id", "_token_index")):
            config[key] = [moved.get(i, i) for i in value] if isinstance(value, list) else moved.get(value, value)


def _truncate_rope_factors(rope: dict | None, rotary_half: int) -> None:
    """longrope's per-frequency factors (Phi-3/4) have one entry per rotary frequency: keep the first ones."""
    if not isinstance(rope, dict):
        return
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), list):
            rope[key] = rope[key][:rotary_half]
    for nested in rope.values():
        _truncate_rope_factors(nested if isinstance(nested, dict) else None, rotary_half)


def _shrink_text(text: dict, where: str) -> dict:
    _refuse_missing_sizes(text, REQUIRED_TEXT_SIZES, where)
    text = dict(text)
    heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
    for key, size in TEXT_SIZES.items():
        if key in text and text[key] is not None:
            text[key] = size
    if heads:
        text["num_attention_heads"] = HEADS
        if kv_heads:  # grouped KV heads stay grouped, multi-head stays multi-head
            text["num_key_value_heads"] = 1 if kv_heads < heads else HEADS
        if "head_dim" not in text:
            text["head_dim"] = HEAD_DIM
    if text.get("linear_num_key_heads") and text.get("linear_num_value_heads"):
        # Gated DeltaNet: value heads share key heads as grouped KV heads share query heads; the grouping stays.
        group = max(1, text["linear_num_value_heads"] // text["linear_num_key_heads"])
        text["linear_num_key_heads"], text["linear_num_value_heads"] = HEADS, HEADS * group
    if text.get("num_global_key_value_heads"):
        text["num_global_key_value_heads"] = 1
    layers = text.get("num_hidden_layers", 2)
    layer_types = text.get("layer_types")
    if layer_types:
        period = _period(layer_types)
    elif text.get("sliding_window_pattern"):  # Gemma 3's spelling of the layer-type pattern
        period = int(text["sliding_window_pattern"])
    elif text.get("full_attention_interval"):  # Qwen3-Next's: every n-th layer full attention, linear otherwise
        period = int(text["full_attention_interval"])
    else:
        period = 2
    shared = text.get("num_kv_shared_layers") or 0
    # KV sharing: one period of layers that keep their K/V, one period that reuses them.
    tiny_layers = 2 * period if shared else period
    text["num_hidden_layers"] = min(layers, tiny_layers) if layers > 1 else layers
    if shared:
        text["num_kv_shared_layers"] = period
    if layer_types:
        text["layer_types"] = layer_types[: text["num_hidden_layers"]]
    for key in ("mlp_only_layers",):
        if isinstance(text.get(key), list):
            text[key] = [index for index in text[key] if index < text["num_hidden_layers"]]
    if isinstance(text.get("sliding_window"), int):
        text["sliding_window"] = min(text["sliding_window"], SLIDING_WINDOW)
    for key in EXPERT_COUNT_KEYS:
        if text.get(key):
            text[key] = EXPERTS
    for key in EXPERTS_PER_TOKEN_KEYS:
        if text.get(key):
            text[key] = min(text[key], EXPERTS_PER_TOKEN)
    rotary = text.get("head_dim", HEAD_DIM) * float(text.get("partial_rotary_factor", 1.0))
    _truncate_rope_factors(text.get("rope_scaling"), int(rotary) // 2)
    _truncate_rope_factors(text.get("rope_parameters"), int(rotary) // 2)
    _remap_token_ids(text, VOCAB)
    _refuse_unknown_sizes(text, TEXT_SIZES, where)
    return text


def _shrink_tower(tower: dict, where: str) -> dict:
    _refuse_missing_sizes(tower, REQUIRED_TOWER_SIZES, where)
    tower = dict(tower)
    for key, size in TOWER_SIZES.items():
        if key in tower:
            tower[key] = size
    if "num_hidden_layers" in tower:
        tower["num_hidden_layers"] = 1
    for key in ("num_attention_heads", "num_key_value_heads"):
        if key in tower:
            tower[key] = 2
    _refuse_unknown_sizes(tower, TOWER_SIZES, where)
    return tower


# The sizes a config must state for the rule to shrink them: a missing one would be transformers' default, the
# full-size model's (a `{"model_type": "llama"}` builds 7B-wide layers). Towers: the width.
REQUIRED_TEXT_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
REQUIRED_TOWER_SIZES = ("hidden_size",)


def _refuse_missing_sizes(config: dict, required: tuple[str, ...], where: str) -> None:
    missing = [key for key in required if not isinstance(config.get(key), int) or isinstance(config.get(key), bool)]
    if missing:
        raise ArchitectureError(f"{where}: cannot be shrunk: it does not state {', '.join(missing)} (as integers), so "
                                "transformers' full-size default would be built; write the sizes of the model into it")
    # The rule replaces the sizes, so a wrong one would be built as a sound tiny model and hide the config's mistake.
    wrong = [f"{key} {value}" for key, value in config.items() if isinstance(value, int) and not isinstance(value, bool)
             and (value <= 0 if key in required or key == "num_hidden_layers" else value < 0 and bool(SIZE_KEY.fullmatch(key)))]
    if wrong:
        raise ArchitectureError(f"{where}: cannot be shrunk: {', '.join(wrong)}: a size or count is a positive integer")


def _refuse_unknown_sizes(config: dict, known: dict, where: str) -> None:
    unknown = [key for key, value in config.items() if SIZE_KEY.fullmatch(key) and key not in known
               and isinstance(value, int) and not isinstance(value, bool) and value > LARGEST_UNSHRUNK_SIZE]
    if unknown:
        raise ArchitectureError(f"{where}: cannot be shrunk: the shrink rule does not know the size key(s) {', '.join(unknown)}")


def shrink(config: dict, where: str = "config") -> dict:
    """A full-size `config.json` -> the config of a tiny model of the same structure (the rule: docs/internals.md, "models/architectures.py")."""
    if not isinstance(config.get("model_type"), str):
        raise ArchitectureError(f"{where}: no model_type: not a transformers config.json")
    tiny = {key: value for key, value in config.items() if not key.startswith("_")}
    tiny.pop("quantization_config", None)  # the families choose the quantization
    if isinstance(tiny.get("text_config"), dict):
        tiny["text_config"] = _shrink_text(tiny["text_config"], f"{where} text_config")
        _remap_token_ids(tiny, VOCAB)
    else:
        tiny = _shrink_text(tiny, where)
    _shrink_image_grid(tiny)
    for key in TOWER_KEYS:
        if isinstance(tiny.get(key), dict):
            tiny[key] = _shrink_tower(tiny[key], f"{where} {key}")
    return tiny


def _shrink_image_grid(config: dict) -> None:
    """A fixed-size image tower: `IMAGE_PATCHES_PER_SIDE` patches a side, of the release's patch size; the soft tokens
    per image (`mm_tokens_per_image`, a square) shrink with it, so the projector pools by the release's kernel
    (Gemma 3: 64 patches a side pooled 4 x 4 to 256 tokens; tiny: 8 pooled 4 x 4 to 4)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict) or not isinstance(vision.get("image_size"), int) or not isinstance(vision.get("patch_size"), int):
        return
    vision = config["vision_config"] = dict(vision)
    side = vision["image_size"] // vision["patch_size"]
    vision["image_size"] = vision["patch_size"] * IMAGE_PATCHES_PER_SIDE
    tokens = config.get("mm_tokens_per_image")
    if isinstance(tokens, int) and tokens > 0:
        kernel = side // math.isqrt(tokens)
        config["mm_tokens_per_image"] = (IMAGE_PATCHES_PER_SIDE // kernel) ** 2


def structures(config) -> frozenset[str]:
    """The structures a built transformers config (not a dict: defaults count) has, among `STRUCTURES`."""
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    found = {
        "vision_tower": getattr(config, "vision_config", None) is not None,
        "audio_tower": getattr(config, "audio_config", None) is not None,
        "clippable_linear": any(getattr(getattr(config, key, None), "use_clipped_linears", False) for key in TOWER_KEYS),
        "kv_sharing": bool(getattr(text, "num_kv_shared_layers", 0)),
        "experts": any(getattr(text, key, None) for key in EXPERT_COUNT_KEYS),
        "tied_embeddings": bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)),
        "sliding_window": "sliding_attention" in layer_types,
    }
    return frozenset(name for name, present in found.items() if present)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArchitectureError(f"--arch {path}: no such file") from None
    except IsADirectoryError:
        raise ArchitectureError(f"--arch {path} is a folder without a config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchitectureError(f"--arch {path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ArchitectureError(f"--arch {path}: not a config.json (a JSON object)")
    return config


def _declared(config: dict) -> frozenset[str]:
    return frozenset(config.get("_structures", ()))


def _seed_architecture() -> Architecture:
    written = _read_config(SEED_TINY_CONFIG)
    config = {key: value for key, value in written.items() if not key.startswith("_")}
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], **config}
    return Architecture(SEED_ARCHITECTURE, str(SEED_TINY_CONFIG.relative_to(FIXTURES_DIR.parent)), config, _declared(written))


def comment(arch: Architecture) -> str:
    """What a built-in architecture's fixture says of itself (its `_comment`: the full-size model and where its
    config was read)."""
    path = SEED_TINY_CONFIG if arch.name == SEED_ARCHITECTURE else ARCHITECTURES_DIR / f"{arch.name}.json"
    return str(_read_config(path).get("_comment", ""))


@cache
def builtin() -> dict[str, Architecture]:
    """The built-in architectures by name, the seed's first."""
    found = {SEED_ARCHITECTURE: _seed_architecture()}
    for path in sorted(ARCHITECTURES_DIR.glob("*.json")):
        full = _read_config(path)
        found[path.stem] = Architecture(path.stem, f"fixtures/architectures/{path.name}", shrink(full, path.name), _declared(full))
    return found


def user_architecture(path: Path) -> Architecture:
    """A user's own config.json, shrunk; named after its folder (a Hub snapshot's) or its file. A folder stands
    for its config.json: a Hub snapshot is one."""
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    stem = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    name = re.sub(r"\W+", "_", stem).strip("_").lower() or "custom"
    if name in builtin():
        name = f"{name}_custom"
    return Architecture(name, str(path), shrink(_read_config(path), str(path)))


def resolve(spec: str | None) -> list[Architecture]:
    """`--arch NAME[,NAME]`, `--arch path/to/config.json` or `--arch path/to/snapshot` (a folder with a config.json);
    every built-in architecture when None. No item is empty, and no two name the same architecture (their cells
    would be one)."""
    if spec is None:
        return list(builtin().values())
    chosen = []
    fixtures = {ARCHITECTURES_DIR / f"{name}.json": arch for name, arch in builtin().items()} | {SEED_TINY_CONFIG: builtin()[SEED_ARCHITECTURE]}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            raise ArchitectureError(f"--arch {spec!r} has an empty item: separate names with single commas")
        path = Path(item).expanduser().resolve()
        if item in builtin():
            chosen.append(builtin()[item])
        elif path in fixtures:  # a built-in fixture named by its path is that architecture
            chosen.append(fixtures[path])
        elif item.endswith(".json") or "/" in item or Path(item).expanduser().is_dir():
            chosen.append(user_architecture(path))
        else:
            raise ArchitectureError(f"--arch: unknown architecture '{item}' (built in: {', '.join(builtin())}; or a path to a "
                                    "config.json or to a folder with one)")
    names = [arch.name for arch in chosen]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ArchitectureError(f"--arch {spec}: names the architecture {', '.join(repeated)} more than once")
    seen: dict[str, Architecture] = {}
    for arch in chosen:  # two configs that shrink to one tiny model would run the same cells twice
        same = seen.setdefault(arch.digest_text(), arch)
        if same is not arch:
            raise ArchitectureError(f"--arch {spec}: {same.source} and {arch.source} are the same model; name it once")
    return chosen
