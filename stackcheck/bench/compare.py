"""Reading and comparing bench JSON, without torch: `compare` is the pure function a gate runs on a
candidate and a baseline run, against the documented THRESHOLDS.

A bench JSON is pytest-benchmark's `--benchmark-json` output of tests/benchmarks, plus a top-level `stackcheck`
block (set, versions, device, the distributed case's cells). Its fields: docs/internals.md, "bench/compare.py".
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from numbers import Real
from pathlib import Path

from stackcheck.core import protocol
from stackcheck.core.results import read_checked_json

# The test-only switch read by stackcheck.bench.harness.timed; see stackcheck.bench.harness.synthetic_slowdown.
SYNTHETIC_SLOWDOWN_ENV = protocol.BENCH_SLOWDOWN_ENV


@dataclass(frozen=True)
class Threshold:
    metric: str
    limit: float  # on the ratio candidate / baseline
    higher_is_better: bool
    sizes: tuple[str, ...] = ("tiny", "realistic")  # the model sizes whose cases it checks
    devices: tuple[str, ...] = ("gpu", "cpu")  # the runs it checks, by where they ran

    def breached(self, ratio: float) -> bool:
        return ratio < self.limit if self.higher_is_better else ratio > self.limit


# A candidate fails when a case loses more than 10% of its tokens/s or needs 10% more VRAM than the
# baseline measured in the same run. On a GPU, speed is gated only where the GPU, not the host, sets it:
# the decode replayed from a CUDA graph (its rounds within 0.05% of each other) and the realistic model's
# long prefill. There eager decode and the tiny model's prefill are host-bound: on the device tool's VMs
# the host's speed drifts up to threefold within a minute, so they are reported with their spread, never
# gated. So is the QLoRA training step on a GPU: the families' fixed batch (scenario.training_batch) is a
# dozen tokens, too few for the GPU's work to outlast the launches. On a CPU the host is the device, and
# eager is all there is. Host-side numbers and NVML are reported, not gated: they include other processes
# and the CUDA context.
THRESHOLDS = (
    Threshold("decode_graph_tokens_per_s", 0.90, higher_is_better=True, devices=("gpu",)),
    Threshold("prefill_tokens_per_s", 0.90, higher_is_better=True, sizes=("realistic",), devices=("gpu",)),
    Threshold("decode_tokens_per_s", 0.90, higher_is_better=True, devices=("cpu",)),
    Threshold("prefill_tokens_per_s", 0.90, higher_is_better=True, devices=("cpu",)),
    Threshold("train_tokens_per_s", 0.90, higher_is_better=True, devices=("cpu",)),
    Threshold("peak_allocated_bytes", 1.10, higher_is_better=False),
    Threshold("peak_reserved_bytes", 1.10, higher_is_better=False),
)
# The distributed case, per (size, engine, world size): the job's tokens/s is gated on a GPU at the realistic size
# only, where the batch (4 x 2048 tokens a rank) is long enough for the GPU to set the speed; the tiny size's and the
# CPU's (two gloo ranks sharing a CI machine's cores) are reported, never gated. The highest peak allocated of any
# rank is gated on a GPU (the CPU has none).
DISTRIBUTED_THRESHOLDS = (
    Threshold("train_tokens_per_s", 0.90, higher_is_better=True, sizes=("realistic",), devices=("gpu",)),
    Threshold("peak_allocated_bytes", 1.10, higher_is_better=False, devices=("gpu",)),
)


def device_kind(run: dict) -> str:
    """'cpu' or 'gpu': where a bench JSON's run took place (stackcheck.core.hostinfo.device_name)."""
    return "cpu" if run.get("stackcheck", {}).get("device", "cpu").startswith("cpu") else "gpu"


def coefficient_of_variation(values: list[float]) -> float:
    return statistics.stdev(values) / statistics.mean(values)


# What summarize and bench_report read from a bench JSON with no default to fall back on.
ENTRY_KEYS = {"stats": ("median", "iqr"), "extra_info": ("size", "case", "phase", "tokens", "parameters", "weights")}
NOT_MEASURED_KEYS = ("size", "case", "phase", "reason")
DISTRIBUTED_KEYS = ("size", "engine", "world_size")
DISTRIBUTED_WORKLOAD_KEYS = ("model", "rows", "sequence", "steps", "ranks")
DISTRIBUTED_RANK_KEYS = ("rank", "job_tokens_per_s", "step_seconds", "half_batch_time_ratio", "arithmetic",
                         "expected_on_rank_bytes", "held_bytes")


def load(path: Path) -> dict:
    """A bench JSON from disk, checked for everything summarize and the report read; a usage error names the file."""
    return read_checked_json(path, _shape_problem, "bench JSON")


def _shape_problem(run) -> str | None:
    if not isinstance(run, dict) or not isinstance(run.get("benchmarks"), list):
        return "it has no `benchmarks` list"
    meta = run.get("stackcheck", {})
    if not (isinstance(meta, dict) and all(isinstance(meta.get(key) or {}, dict) for key in ("versions", "bandwidth"))):
        return "`stackcheck`, or its `versions` or `bandwidth`, is not an object"
    skipped = meta.get("not_measured", [])
    if not (isinstance(skipped, list) and all(_has(item, NOT_MEASURED_KEYS) for item in skipped)):
        return f"`stackcheck.not_measured` is not a list of objects with {', '.join(NOT_MEASURED_KEYS)}"
    cells = meta.get("distributed", [])
    if not (isinstance(cells, list) and all(_has(cell, DISTRIBUTED_KEYS) and (isinstance(cell.get("not_measured"), str) or (
            _has(cell, DISTRIBUTED_WORKLOAD_KEYS) and isinstance(cell["ranks"], list) and cell["ranks"]
            and all(_has(r, DISTRIBUTED_RANK_KEYS) for r in cell["ranks"]))) for cell in cells)):
        return (f"`stackcheck.distributed` is not a list of objects with {', '.join(DISTRIBUTED_KEYS)} and either "
                f"`not_measured` or {', '.join(DISTRIBUTED_WORKLOAD_KEYS)}, each rank with {', '.join(DISTRIBUTED_RANK_KEYS)}")
    for index, entry in enumerate(run["benchmarks"]):
        if not (isinstance(entry, dict) and all(_has(entry.get(block), keys) for block, keys in ENTRY_KEYS.items())):
            return f"benchmark {index} has no " + " and ".join(f"`{b}` with {', '.join(k)}" for b, k in ENTRY_KEYS.items())
        stats, info = entry["stats"], entry["extra_info"]
        if not (all(isinstance(value, Real) for value in (stats["median"], stats["iqr"], info["tokens"])) and stats["median"] > 0):
            return f"benchmark {index}: its median (> 0), iqr and tokens are not all numbers"
        weights = info["weights"]
        if not (isinstance(info.get("memory", {}), dict) and _has(weights, ("expected", "stored"))
                and isinstance(weights["expected"], dict) and isinstance(weights["stored"], dict)):
            return f"benchmark {index}: its `memory`, or its `weights` with `expected` and `stored`, is not an object"
    return None


def _has(value, keys) -> bool:
    return isinstance(value, dict) and all(key in value for key in keys)


def summarize(run: dict) -> dict[str, dict]:
    """Per case, keyed 'size/case': tokens/s of each phase (tokens per round over the median round) and
    its spread (IQR over median), each repeated phase's list of tokens/s, memory (each metric's highest
    sample over the case's benchmarks), parameters, weight bytes, decode weight bytes per token, and
    `not_measured`: phase -> why its benchmark recorded no number."""
    cases: dict[str, dict] = {}
    for entry in run["benchmarks"]:
        info, stats = entry["extra_info"], entry["stats"]
        row = cases.setdefault(f"{info['size']}/{info['case']}", {"size": info["size"], "case": info["case"]})
        tokens_per_s = info["tokens"] / stats["median"]
        if info["phase"].endswith("_repeat"):
            row.setdefault(f"{info['phase']}_tokens_per_s", []).append(tokens_per_s)
        else:
            row[f"{info['phase']}_tokens_per_s"] = tokens_per_s
            row[f"{info['phase']}_spread"] = stats["iqr"] / stats["median"]
        for metric, value in info.get("memory", {}).items():
            if value is not None:
                row[metric] = max(row.get(metric, value), value)
        row["parameters"] = info["parameters"]
        row["weights"] = info["weights"]
        if "decode_weight_bytes_per_token" in info:
            row["decode_weight_bytes_per_token"] = info["decode_weight_bytes_per_token"]
    for skipped in run.get("stackcheck", {}).get("not_measured", []):
        row = cases.get(f"{skipped['size']}/{skipped['case']}")
        if row is not None:
            row.setdefault("not_measured", {})[skipped["phase"]] = skipped["reason"]
    return cases


def distributed_key(size: str, engine: str, world_size: int) -> str:
    return f"{size}/{engine}/ws{world_size}"


def summarize_distributed(run: dict) -> dict[str, dict]:
    """Per cell of the distributed case, keyed 'size/engine/wsN': the job's tokens/s (`train_tokens_per_s`, its
    slowest rank's) and that rank's step times' spread (IQR over median), the highest half-batch time ratio of any
    rank (stackcheck.bench.distributed: 0.5 when the GPU sets the speed, 1 when the host does), the highest peak
    allocated of any rank over load and prepare or the timed steps (`peak_allocated_bytes`, GPU only), `workload`
    (what makes two runs comparable: model, batch, steps), the cell's record, and `not_measured` as summarize has it."""
    cells: dict[str, dict] = {}
    for record in run.get("stackcheck", {}).get("distributed", []):
        row = {key: record[key] for key in DISTRIBUTED_KEYS} | {"record": record}
        cells[distributed_key(record["size"], record["engine"], record["world_size"])] = row
        if "not_measured" in record:
            row["not_measured"] = {"train": record["not_measured"]}
            continue
        row["workload"] = f"{record['model']}, {record['rows']} x {record['sequence']} tokens a rank, {record['steps']} steps"
        slowest = min(record["ranks"], key=lambda rank: rank["job_tokens_per_s"])
        row["train_tokens_per_s"] = slowest["job_tokens_per_s"]
        row["train_spread"] = relative_spread(slowest["step_seconds"])
        row["half_batch_time_ratio"] = max(rank["half_batch_time_ratio"] for rank in record["ranks"])
        peaks = [rank[key] for rank in record["ranks"] for key in ("peak_allocated_load_prepare_bytes", "peak_allocated_steps_bytes")
                 if rank.get(key) is not None]
        if peaks:
            row["peak_allocated_bytes"] = max(peaks)
    return cells


def relative_spread(values: list[float]) -> float:
    """IQR over median, as pytest-benchmark's stats give it for the other cases."""
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return (quartiles[2] - quartiles[0]) / statistics.median(values)


# A step timed on half the batch takes half as long when the GPU sets the speed (ratio 0.5) and as long when the host's
# kernel launches do (ratio 1): above the midpoint the host dominates, and a scaling efficiency is the ratio of two
# host-bound speeds (the tiny case's 129% to 149%, with 12% to 28% spread), not the engine's.
HOST_BOUND_RATIO = 0.75
# Shards are padded to divide evenly: a part held within 5% of its share is held as the arithmetic says.
HELD_SLACK = 0.05


def host_bound(cells: dict[str, dict], size: str, engine: str) -> bool:
    """Whether either world size of the case measured a half-batch time ratio above HOST_BOUND_RATIO."""
    return any(cells.get(distributed_key(size, engine, world_size), {}).get("half_batch_time_ratio", 0) > HOST_BOUND_RATIO
               for world_size in (1, 2))


def scaling_efficiency(cells: dict[str, dict], size: str, engine: str) -> float | None:
    """World size 2's tokens/s over twice world size 1's (1.0: perfect data-parallel scaling), where both were measured."""
    one = cells.get(distributed_key(size, engine, 1), {}).get("train_tokens_per_s")
    two = cells.get(distributed_key(size, engine, 2), {}).get("train_tokens_per_s")
    return two / (2 * one) if one and two else None


def not_measured_reason(row: dict, metric: str) -> str | None:
    """Why a case's benchmark of `metric`'s phase recorded no number, when it said so (see summarize)."""
    return row.get("not_measured", {}).get(metric.removesuffix("_tokens_per_s"))


def compare(candidate: dict, baseline: dict, thresholds: tuple[Threshold, ...] = THRESHOLDS) -> list[str]:
    """Problems of a candidate bench JSON against a baseline one, as one line each (none: it passes).

    Ratios are candidate / baseline per case and metric, checked against `thresholds` (the distributed case's cells
    against DISTRIBUTED_THRESHOLDS); a metric the
    baseline could not measure (VRAM on a CPU run) is not compared, one only the candidate lacks fails. Also a problem: a case the
    baseline has and the candidate lacks, a different model (or distributed workload), runs of different modes or devices, and a
    candidate measured with the test-only synthetic slowdown."""
    problems = []
    ours, theirs = candidate.get("stackcheck", {}), baseline.get("stackcheck", {})
    slowdown = ours.get("synthetic_slowdown", 1.0)
    if slowdown != 1.0:
        problems.append(f"candidate was measured with the test-only synthetic slowdown {slowdown} ({SYNTHETIC_SLOWDOWN_ENV})")
    for field in ("mode", "device"):
        if ours.get(field) != theirs.get(field):
            problems.append(f"not comparable: candidate {field} {ours.get(field)!r}, baseline {theirs.get(field)!r}")
    kind = device_kind(baseline)
    for measured, references, checked in ((summarize(candidate), summarize(baseline), thresholds),
                                          (summarize_distributed(candidate), summarize_distributed(baseline), DISTRIBUTED_THRESHOLDS)):
        for key, reference in references.items():
            problems += _ratio_problems(key, measured.get(key), reference, checked, kind)
    return problems


def _ratio_problems(key: str, row: dict | None, reference: dict, thresholds: tuple[Threshold, ...], kind: str) -> list[str]:
    """One case's (or distributed cell's) problems against the baseline's."""
    if row is None:
        return [f"{key}: in the baseline, missing from the candidate (its benchmark failed or did not run)"]
    if row.get("parameters") != reference.get("parameters"):
        return [f"{key}: not comparable: {row.get('parameters')} parameters, baseline {reference.get('parameters')}"]
    if "workload" in row and "workload" in reference and row["workload"] != reference["workload"]:
        return [f"{key}: not comparable: {row['workload']}, baseline {reference['workload']}"]
    problems = []
    for threshold in thresholds:
        applies = reference["size"] in threshold.sizes and kind in threshold.devices
        if not applies or not reference.get(threshold.metric):
            continue
        if not row.get(threshold.metric):
            why = not_measured_reason(row, threshold.metric) or "its benchmark failed or did not run"
            problems.append(f"{key}: {threshold.metric} measured in the baseline, not in the candidate: {why}")
            continue
        ratio = row[threshold.metric] / reference[threshold.metric]
        if threshold.breached(ratio):
            sign = "<" if threshold.higher_is_better else ">"
            problems.append(
                f"{key}: {threshold.metric} ratio {ratio:.3f} {sign} {threshold.limit} "
                f"({row[threshold.metric]:.4g} vs baseline {reference[threshold.metric]:.4g})"
            )
    return problems
