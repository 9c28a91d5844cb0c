"""The step gate and bisect repeat: chosen family tests of one set, on the CPU lane, in the set's own
environment, read back as the cells the plugin recorded."""

from __future__ import annotations

from pathlib import Path

from stackcheck import REPO_ROOT, cli, envs, results
from stackcheck.ledger import Ledger
from stackcheck.versions import UsageError, VersionSet

FAMILIES_DIR = REPO_ROOT / "tests" / "families"
# GPU-marked tests would only be skipped cells on a CPU host; the cache plugin would share state between runs.
CPU_LANE_ARGS = ["-q", "-p", "no:cacheprovider", "-m", "not gpu"]


def family_targets(families: list[str] | None) -> list[str]:
    """Test module paths of the named families (every family in the ledger when None)."""
    known = [f for f in Ledger().families if (FAMILIES_DIR / f"test_{f}.py").exists()]
    for family in families or []:
        if family not in known:
            raise UsageError(f"unknown family '{family}' (families: {', '.join(known)})")
    return [f"tests/families/test_{f}.py" for f in families or known]


def one_test(node_id: str) -> tuple[str, str]:
    """(family, node id) of one family test given as `tests/families/test_<family>.py::<test>`."""
    module, _, name = node_id.partition("::")
    if not name or Path(module).parent != Path("tests/families") or not Path(module).name.startswith("test_"):
        raise UsageError(f"'{node_id}' is not a family test id such as tests/families/test_<family>.py::<test>")
    family = Path(module).stem.removeprefix("test_")
    family_targets([family])  # an unknown family is a usage error
    return family, node_id


def run(vset: VersionSet, targets: list[str], results_path: Path, find_links=(), no_index: bool = False) -> list[dict]:
    """Run `targets` for `vset` into results_path and return its cells. An environment that cannot be
    built gets an `error` cell in every family instead, as in the matrix."""
    try:
        python = envs.build(vset, find_links, no_index)
    except envs.EnvBuildError as exc:
        cli.record_unbuildable(results_path, vset, str(exc))
    else:
        cli.run_pytest(python, vset, targets, CPU_LANE_ARGS, results_path)
    return [c for c in results.load(results_path)["cells"] if c["set"] == vset.name]
