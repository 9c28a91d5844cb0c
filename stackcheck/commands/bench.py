"""`bench`: VRAM and tokens/s of each set, as ratios against a baseline set (stackcheck/bench/; docs/bench.md)."""

from __future__ import annotations

import sys

from stackcheck.bench import compare as bench_compare, report as bench_report
from stackcheck.commands.matrix import gpu_device
from stackcheck.core.versions import UsageError
from stackcheck.runner import envs
from stackcheck.runner.inputs import check_folder_option, selected_sets
from stackcheck.runner.lane import bench_set, build_all


def run(args) -> int:
    """Per set: build its environment with the bench extras and run tests/benchmarks into <set>.json;
    then render the report and the plots from every set's JSON, as ratios against the baseline set."""
    check_folder_option("--results", args.results)
    sets = selected_sets(args)
    baseline = args.baseline or sets[0].name
    if baseline not in [vset.name for vset in sets]:
        raise UsageError(f"--baseline '{baseline}' is not among the sets run ({', '.join(v.name for v in sets)})")
    if args.repeat < 0 or args.repeat == 1:
        raise UsageError(f"--repeat {args.repeat}: a coefficient of variation needs N >= 2 measurements")
    size = args.size or ("tiny" if args.smoke else "all")
    if not (args.smoke or args.render_only):
        print(f"== device: {gpu_device('`bench --smoke` runs on the CPU')}", flush=True)
    args.results.mkdir(parents=True, exist_ok=True)
    pythons = {} if args.render_only else build_all(sets, args.find_links, args.no_index, envs.BENCH_GROUPS)
    failed = [] if args.render_only else [v.name for v in sets if not bench_set(
        v, pythons[v.name], size, args.results, args.repeat, args.smoke, args.pytest_args)]
    runs = {vset.name: bench_compare.load(path) for vset in sets if (path := args.results / f"{vset.slug}.json").exists()}
    if baseline not in runs:
        print(f"stackcheck: no bench results for the baseline set '{baseline}' in {args.results}", file=sys.stderr)
        return 1
    markdown = args.results.with_suffix(".md")
    for note in bench_report.render(runs, baseline, markdown, args.results):
        print(f"stackcheck: {note}", file=sys.stderr)
    print(f"wrote {markdown}")
    if failed:
        print(f"stackcheck: sets with failed or missing benchmarks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
