"""The 4-bit weights under a sharding engine, for every `bnb_4bit_quant_storage` a user picks (uint8, bf16, fp32):
the packed bytes survive sharding, and sharding saves what the user's arithmetic says.

Properties, on FSDP1 (`use_orig_params`), FSDP2 (`fully_shard`) and, for memory, DeepSpeed ZeRO-3, launched as users
launch them (`accelerate launch --config_file fixtures/distributed/<engine>.yaml`):
- **The forward before any step equals one process's, bit for bit.** The same recipe, prepared by the engine, gives
  the logits the model gives in one process on the same batch, `torch.equal`. An all-gather copies bytes: a packed
  weight that comes back other than it went (a storage cast, a lost quant state, a re-quantization) shows here before
  any optimizer could hide it. On every loading path users set in the config too (bf16 storage): FSDP1 with flat
  parameters (`fsdp_use_orig_params: false`, with PEFT's wrap policy, as the Trainer sets it), FSDP1 and FSDP2 with
  RAM-efficient loading (`fsdp_cpu_ram_efficient_loading: true`; FSDP1 then with `fsdp_sync_module_states`, which
  broadcasts rank 0's parameters; FSDP2 loads rank 0's full state dict into the shards). One process's model is loaded
  before the process group exists, so only the sharded model takes transformers' FSDP loading path.
- **At rest, each rank holds about 1/world size of what the engine was told to shard.** The engine is told to shard
  the whole model (FSDP wraps every decoder layer and the root, ZeRO-3 partitions every parameter), so the user's
  arithmetic (`stackcheck.distributed.memory.users_arithmetic`) is every parameter's bytes / world size by part (the
  4-bit weights, the other frozen parameters, the LoRA weights), the 4-bit quant states whole (they are attributes,
  no engine shards them). FSDP1 shards each unit's flat parameter in contiguous slices, so one rank may hold all of a
  unit's LoRA weights and the other more of its 4-bit weights (measured: 7168 and 0 LoRA bytes, 73728 and 76800
  4-bit bytes, on the CPU's two ranks): there the parameters are judged by their sum. A part held above its share is a finding: the rank keeps it whole. Known to break it:
  accelerate >= 1.14 leaves uint8 4-bit weights out of FSDP2's sharding (`ignored_params`, accelerate PR#3987, its fix
  for accelerate#3983), so every rank holds them whole (`fsdp2_uint8_params4bit_unsharded`).

Known bugs met on the way: FSDP1 refuses uint8 storage (`fsdp1_uint8_quant_storage`); FSDP2 on torch 2.11 with
accelerate 1.13 refuses uint8 storage (`fsdp2_uint8_params4bit_requires_grad`); FSDP1 at world size 1 cannot step
(not met here: no step before the forward); FSDP2's RAM-efficient loading of a 4-bit model fails at `prepare` on
accelerate < 1.14 (`fsdp2_ram_efficient_loading_params4bit`).

Recipes (`stackcheck.distributed.recipes.storage_model`): NF4 with double quant in the cell's storage on the tiny
Llama 3; FSDP1 with a float storage casts every other float parameter to it (one dtype per flattened unit); ZeRO-3 loads
without a device map. Precondition proven on every rank: every 4-bit weight is stored in the cell's dtype, `prepare`
returned the engine's sharded module (an FSDP1 module, an FSDP2 module, DeepSpeed's engine at stage 3), and the
memory cell runs at world size 2 (at 1 every rank holds everything by definition). A loading cell proves its options
in force: accelerate's FSDP plugin has the config's `cpu_ram_efficient_loading`, `use_orig_params` and
`sync_module_states`, transformers' FSDP loading path (`is_fsdp_enabled`) is on exactly where RAM-efficient loading is,
and every FSDP1 unit has the config's `use_orig_params`.

Judged by mechanism: no tolerance on the forward (bytes gathered are bytes sent, and the kernels are the same), and
on memory 5% over each part's share for padding (FSDP2 pads dim 0 to the world size, ZeRO-3 the flat partition). A
part held whole is 100% over at world size 2.

Measured on two H200s (torch 2.11, both sets, world sizes 1 and 2): every forward that prepares equals one process's
bit for bit (FSDP1 and FSDP2 in bf16 and fp32, FSDP2 in uint8 on latest; on the CPU, seed, FSDP2 bf16 and FSDP1 fp32
too); at rest FSDP1 and FSDP2 in bf16 and fp32, and ZeRO-3 in every storage (uint8 included), hold their share; FSDP2
in uint8 on latest holds every 4-bit weight whole (147456 bytes on each rank where the share is 73728). On the CPU
(seed, accelerate 1.13, torch 2.13) FSDP2 shards the uint8 weights to exactly their share.

Measured on the CPU (two gloo ranks, bf16 storage): FSDP1 with flat parameters bit-equal on seed and latest; FSDP2 with
RAM-efficient loading fails at `prepare` on seed (accelerate 1.13.0) and is bit-equal on latest (1.15.0).

CPU lane (CI): the memory cell of FSDP2 in uint8 storage (accelerate's exclusion, or on 1.13 its share) and FSDP2's
RAM-efficient first forward (accelerate 1.13's failure), two gloo ranks each. The other cells' gloo variants reproduce
nothing the GPU lane does not: left out of the default run (STACKCHECK_DIST_CPU=all runs them), FSDP1's RAM-efficient
loading GPU only (accelerate's FSDP plugin asks an accelerator device for sync_module_states).
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
