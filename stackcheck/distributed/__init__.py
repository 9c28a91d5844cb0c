"""The distributed lane: a family test launches a job as users launch it (`accelerate launch --config_file` with
FSDP1, FSDP2 or DeepSpeed ZeRO-3, or torchrun), each rank runs a function of the test's module, and the cell's
verdict combines every rank's outcome: `launcher`, `rank`, `outcome` (pure), `cells` (the pytest side).
The CPU lane runs 2 ranks over gloo; the GPU lane world sizes 1 and 2 over NCCL. A part of the harness beside
`scenario`: it uses the ledger, nothing above. The parts: docs/internals.md, "distributed/"; docs/running.md.
"""
