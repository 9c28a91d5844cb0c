"""The tools that turn a verdict into action: `doctor` (the known bugs of an installed stack), `scan` (a model's
preflight on the meta device) and `repro` (standalone reproductions of failing cells, cut by `repro_script`)."""
