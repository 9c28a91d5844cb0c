"""The 4-bit weights under a sharding engine, for every `bnb_4bit_quant_storage` a user picks (uint8, bf16, fp32):
the packed bytes survive sharding, and sharding saves what the user's arithmetic says.

Properties, known bugs met, recipes, the judgement, measurements and the lanes:
docs/family-notes.md#sharded_quant_storage.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import memory, rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

MODULE = "tests.contract.distributed.test_sharded_quant_storage"
ARCHITECTURE = "llama3"
# Shards are padded to divide evenly: a part within 5% of its share is held as the arithmetic says.
SLACK = 0.05
CPU_COSTLY = "its CPU variant reproduces nothing the GPU lane does not"
STORAGE = pytest.mark.parametrize("quant_storage", list(recipes.STORAGES))
TWO_RANKS = pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.gpus(2))], ids=["ws2"])


def subject() -> scenario.UnderTest:
    return scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())


def require_storage(model, quant_storage: torch.dtype) -> None:
    stored = {p.dtype for p in model.parameters() if type(p).__name__ == "Params4bit"}
    scenario.require(stored == {quant_storage}, f"the 4-bit weights are stored as {stored}, not {quant_storage}")


def first_forward(sharding: str, quant_storage: str, loading: dict | None = None) -> dict:
    """On every rank: the recipe's logits in one process, then the engine's before any step; their difference.
    `loading`: the config's loading options of the cell (`LOADING`), proven in force."""
    storage, engine = recipes.STORAGES[quant_storage], sharding
    under_test = subject()
    if under_test.device.type == "cuda":
        torch.cuda.set_device(under_test.device)
    # One process's model is loaded before the process group exists: transformers takes its FSDP loading path
    # (`is_fsdp_enabled`: a process group and FSDP_CPU_RAM_EFFICIENT_LOADING) for the sharded model only.
    single = recipes.storage_model(under_test, engine, storage)
    require_storage(single, storage)
    batch = scenario.training_batch(under_test.device, single.config)
    with torch.no_grad():
        expected = single(**batch).logits.float().cpu()
    del single

    accelerator = recipes.engine_accelerator(engine)
    require_loading(accelerator, engine, loading or {})
    model = recipes.storage_model(under_test, engine, storage)
    if (loading or {}).get("fsdp_use_orig_params") is False:
        # Flat parameters need one requires_grad a unit: PEFT's wrap policy gives every LoRA layer a unit of its own,
        # as the Trainer sets it (transformers.integrations.fsdp.update_fsdp_plugin_peft) and PEFT's docs ask.
        from peft.utils.other import fsdp_auto_wrap_policy

        accelerator.state.fsdp_plugin.auto_wrap_policy = fsdp_auto_wrap_policy(model)
    model, _optimizer, _plain = recipes.prepare(accelerator, engine, model, recipes.optimizer_for(model), batch)
    if engine == "fsdp1":
        flat = {m._use_orig_params for m in model.modules() if type(m).__name__ == "FullyShardedDataParallel"}
        scenario.require(flat == {(loading or {}).get("fsdp_use_orig_params", True)}, f"FSDP1's units have use_orig_params {flat}")
    with torch.no_grad():
        logits = model(**batch).logits.float().cpu()
    difference = float((logits - expected).abs().max())
    assert torch.equal(logits, expected), (f"{engine}'s first forward differs from one process's with {quant_storage} storage: "
                                           f"largest logit difference {difference:.3g}")
    return {"largest_logit_difference": difference}


def require_loading(accelerator, engine: str, loading: dict) -> None:
    """The cell's loading options are accelerate's FSDP plugin's, and transformers loads through its FSDP path where
    the config asks for RAM-efficient loading."""
    from transformers.integrations import is_fsdp_enabled

    plugin = accelerator.state.fsdp_plugin
    ram_efficient = loading.get("fsdp_cpu_ram_efficient_loading", False)
    scenario.require(plugin is not None and bool(plugin.cpu_ram_efficient_loading) == ram_efficient,
                     f"accelerate's FSDP plugin has cpu_ram_efficient_loading {getattr(plugin, 'cpu_ram_efficient_loading', None)}")
    scenario.require(is_fsdp_enabled() == ram_efficient, f"transformers' FSDP loading path is {is_fsdp_enabled()}, the config asks {ram_efficient}")
    if engine == "fsdp1":
        scenario.require(bool(plugin.use_orig_params) == loading.get("fsdp_use_orig_params", True), f"use_orig_params is {plugin.use_orig_params}")
        scenario.require(bool(plugin.sync_module_states) == loading.get("fsdp_sync_module_states", False),
                         f"sync_module_states is {plugin.sync_module_states}")


def held_at_rest(sharding: str, quant_storage: str) -> dict:
    """On every rank: what the prepared model's parameters hold, by part, against the user's arithmetic."""
    storage, engine = recipes.STORAGES[quant_storage], sharding
    accelerator = recipes.engine_accelerator(engine)
    under_test = subject()
    model = recipes.storage_model(under_test, engine, storage)
    require_storage(model, storage)
    parts = memory.weight_parts(model)
    scenario.require(parts[memory.WEIGHTS], "the model holds no 4-bit weight")
    batch = scenario.training_batch(under_test.device, model.config)
    _model, _optimizer, plain = recipes.prepare(accelerator, engine, model, recipes.optimizer_for(model), batch)
    world_size = torch.distributed.get_world_size()
    scenario.require(world_size > 1, f"the job runs {world_size} rank: every rank holds everything")
    held = memory.held_by_part(plain, parts)
    users = memory.users_arithmetic(parts, world_size)
    if engine == "fsdp1":  # a unit's flat parameter is sharded in contiguous slices: only the sum is the rank's share
        held, users = memory.merged(held, users)
    over = memory.over_arithmetic(held, users, SLACK)
    described = "; ".join(f"{part} {got} bytes where the arithmetic gives {want:.0f} (whole {users[part]['whole_bytes']})"
                          for part, (got, want) in over.items())
    assert not over, f"rank {torch.distributed.get_rank()} holds more than its share at rest under {engine} with {quant_storage} storage: {described}"
    return {"held_by_part": held, "users_arithmetic": {part: want["on_rank_bytes"] for part, want in users.items()}}


@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2"])
@STORAGE
@WORLD_SIZES
def test_the_first_forward_equals_one_process(ranks, world_size, engine, quant_storage):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    ranks(f"{MODULE}:first_forward", world_size, engine=engine, cpu_costly=CPU_COSTLY, sharding=engine, quant_storage=quant_storage)


# The loading axes users set in the config, each a cell of its own beside the fixtures' defaults (use_orig_params on,
# RAM-efficient loading off): FSDP1 with flat parameters, FSDP1 and FSDP2 with RAM-efficient loading (FSDP1 then needs
# sync_module_states, which broadcasts rank 0's parameters; FSDP2 loads rank 0's full state dict into the shards).
LOADING = {
    "fsdp1-flat_params": ("fsdp1", {"fsdp_use_orig_params": False}),
    "fsdp1-ram_efficient": ("fsdp1", {"fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True}),
    "fsdp1-ram_efficient-flat_params": ("fsdp1", {"fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True,
                                                  "fsdp_use_orig_params": False}),
    "fsdp2-ram_efficient": ("fsdp2", {"fsdp_cpu_ram_efficient_loading": True}),
}
# accelerate's FSDP plugin asks an accelerator device for sync_module_states.
SYNC_GPU_ONLY = "sync_module_states needs an accelerator device"


@pytest.mark.parametrize("loading", list(LOADING))
@pytest.mark.ranks_engine(lambda params: LOADING[params["loading"]][0])
@WORLD_SIZES
def test_the_first_forward_equals_one_process_on_every_loading_path(ranks, world_size, loading):
    """bf16 storage, the storage FSDP1 and FSDP2 shard."""
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])
    engine, options = LOADING[loading]
    reproduces_on_cpu = loading == "fsdp2-ram_efficient"  # fsdp2_ram_efficient_loading_params4bit (accelerate < 1.14)
    ranks(f"{MODULE}:first_forward", world_size, engine=engine, engine_options=options, cpu_costly=None if reproduces_on_cpu else CPU_COSTLY,
          gpu_only=SYNC_GPU_ONLY if options.get("fsdp_sync_module_states") else None, sharding=engine, quant_storage="bf16",
          loading=options)


@pytest.mark.parametrize("engine", recipes.ENGINES)
@STORAGE
@TWO_RANKS
def test_each_rank_holds_its_share_at_rest(ranks, world_size, engine, quant_storage):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])
    reproduces_on_cpu = (engine, quant_storage) == ("fsdp2", "uint8")
    ranks(f"{MODULE}:held_at_rest", world_size, engine=engine, cpu_costly=None if reproduces_on_cpu else CPU_COSTLY,
          sharding=engine, quant_storage=quant_storage)
