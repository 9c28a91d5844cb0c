"""The benchmarks: `harness` (the cases, timing, memory and weight sizes the benchmark tests measure), `plugin` (their
pytest options and JSON), `compare` (reading and comparing bench JSON, the gate's check, no torch) and `report`
(bench.md and its plots)."""
