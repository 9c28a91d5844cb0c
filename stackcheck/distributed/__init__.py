"""The distributed lane: a family test launches a job as users launch it (`accelerate launch --config_file` with
FSDP1, FSDP2 or DeepSpeed ZeRO-3, or torchrun), each rank runs a function of the test's module, and the cell's
verdict combines every rank's outcome.

- `launcher`: builds the launch command, runs the job in a session of its own, dumps a hung rank's stacks, reaps
  every process;
- `rank`: what runs on each rank (a supervisor and the worker), and the helpers a rank's function uses;
- `outcome`: each rank's outcome, its judgement by the ledger, and the combination (pure functions);
- `cells`: the pytest side, the `ranks` fixture's job and the world sizes a test runs at.

The CPU lane runs 2 ranks over gloo; the GPU lane world sizes 1 and 2 over NCCL, 2 skipped (with the count) on a
host with fewer GPUs, as `gpus(2)` does. A part of the harness beside `scenario`: it uses the ledger, nothing above.
"""
