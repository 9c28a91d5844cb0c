"""results/bench.md and one PNG per metric, rendered from each set's bench JSON: every set's numbers side
by side, as ratios against a baseline set measured in the same run, with the gate's verdict, the decode
roofline, expected against measured weight bytes, the repeatability of the 4-bit decode, and the distributed
training case (tokens/s at world sizes 1 and 2, scaling efficiency, per-rank memory against the sharding arithmetic).
"""

from __future__ import annotations

import os
from pathlib import Path

from stackcheck.bench import compare as bench_compare

MIB = 1 << 20


def _number(value: float, scale: float = 1) -> str:
    return f"{value / scale:,.1f}"


# (metric, title, unit, scale: value / scale is in `unit`); the memory keys are stackcheck.bench.harness.MemoryTracker's.
METRICS = (
    ("decode_graph_tokens_per_s", "Decode tokens/s replayed from a CUDA graph (batch 1, the GPU's time)", "tokens/s", 1),
    ("decode_tokens_per_s", "Decode tokens/s, eager as generate() runs it (batch 1, host-bound)", "tokens/s", 1),
    ("prefill_tokens_per_s", "Prefill tokens/s", "tokens/s", 1),
    ("train_tokens_per_s", "QLoRA training tokens/s (one optimizer step on the fixed batch)", "tokens/s", 1),
    ("peak_allocated_bytes", "Peak allocated VRAM above the case's start (torch allocator)", "MiB", MIB),
    ("peak_reserved_bytes", "Peak reserved VRAM above the case's start (torch allocator)", "MiB", MIB),
    ("nvml_used_bytes", "Device memory used (NVML: all processes and the CUDA context)", "MiB", MIB),
    ("host_peak_rss_bytes", "Host peak RSS", "MiB", MIB),
    ("host_rss_delta_bytes", "Host RSS growth over the case (the CPU side of split maps)", "MiB", MIB),
)


def render(runs: dict[str, dict], baseline: str, markdown: Path, plots_dir: Path) -> list[str]:
    """Write `markdown` and a PNG per metric into `plots_dir` from `runs` (set name -> bench JSON, in
    report order, `baseline` among them). Returns notes for the console, such as plots left out."""
    summaries = {name: bench_compare.summarize(run) for name, run in runs.items()}
    cases = list(dict.fromkeys(key for summary in summaries.values() for key in summary))
    notes = []
    plots = _plot(summaries, cases, plots_dir, notes)
    relative = os.path.relpath(plots_dir, markdown.parent)
    lines = [
        "# stackcheck bench",
        "",
        f"Baseline set: **{baseline}**. A ratio is a set's value over the baseline's, both measured in this run; "
        "absolute numbers from different runs are not comparable.",
        "",
        *_runs_table(runs),
        *_gate(runs, baseline),
    ]
    for metric, title, unit, scale in METRICS:
        lines += _metric_table(summaries, cases, baseline, metric, title, unit, scale)
    lines += _roofline(runs, summaries)
    lines += _weights(summaries)
    lines += _repeatability(summaries)
    lines += _distributed(runs, baseline)
    if plots:
        lines += ["## Plots", ""] + [f"![{title}]({relative}/{name})" for name, title in plots] + [""]
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text("\n".join(lines))
    return notes


def _runs_table(runs: dict[str, dict]) -> list[str]:
    lines = ["| set | torch | transformers | peft | accelerate | bitsandbytes | device | mode | copy bandwidth | spec bandwidth | synthetic slowdown |",
             "|---" * 11 + "|"]
    for name, run in runs.items():
        meta = run.get("stackcheck", {})
        versions = meta.get("versions", {})
        bandwidth = meta.get("bandwidth") or {}
        measured, spec = bandwidth.get("measured_bytes_per_s"), bandwidth.get("spec_bytes_per_s")
        slowdown = meta.get("synthetic_slowdown", 1.0)
        cols = [versions.get(k, "") for k in ("torch", "transformers", "peft", "accelerate", "bitsandbytes")]
        cols += [meta.get("device", ""), meta.get("mode", ""),
                 f"{measured / 1e12:.3f} TB/s" if measured else "", f"{spec / 1e12:.2f} TB/s" if spec else "",
                 "none" if slowdown == 1.0 else f"**{slowdown} (test-only)**"]
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    return lines + [""]


def _gate(runs: dict[str, dict], baseline: str) -> list[str]:
    def rules(thresholds) -> str:
        return "; ".join(f"{t.metric} ratio {'<' if t.higher_is_better else '>'} {t.limit} fails "
                         f"({'/'.join(t.sizes)} on {'/'.join(t.devices)})" for t in thresholds)

    lines = ["## Gate", "", f"Thresholds (stackcheck.bench.compare.THRESHOLDS): {rules(bench_compare.THRESHOLDS)}.", "",
             "The distributed training case, per size, engine and world size (DISTRIBUTED_THRESHOLDS; tokens/s is the job's, "
             f"peak allocated the highest of any rank): {rules(bench_compare.DISTRIBUTED_THRESHOLDS)}.", ""]
    for name, run in runs.items():
        if name == baseline:
            continue
        problems = bench_compare.compare(run, runs[baseline])
        lines.append(f"- **{name}** against {baseline}: " + ("pass" if not problems else f"**fail**, {len(problems)} problem(s)"))
        lines += [f"  - {problem}" for problem in problems]
    unmeasured = [f"- {item['size']}/{item['case']} {item['phase']}: {item['reason']}"
                  for item in runs[baseline].get("stackcheck", {}).get("not_measured", [])]
    unmeasured += [f"- distributed {key}: {row['not_measured']['train']}"
                   for key, row in bench_compare.summarize_distributed(runs[baseline]).items() if "not_measured" in row]
    if unmeasured:
        lines += ["", "Not compared, because the baseline could not measure them:", *unmeasured]
    return lines + [""]


def _cases_with(summaries, cases, metric) -> list[str]:
    """The cases that have `metric` in some set, or whose benchmark of it said why it measured nothing: an
    inference case has no training tokens/s and the training case no prefill or decode."""
    return [key for key in cases if any(metric in summary.get(key, {}) or bench_compare.not_measured_reason(summary.get(key, {}), metric)
                                        for summary in summaries.values())]


def _metric_table(summaries, cases, baseline, metric, title, unit, scale) -> list[str]:
    cases = _cases_with(summaries, cases, metric)
    if not cases:
        return []
    spread = metric.replace("tokens_per_s", "spread") if metric.endswith("tokens_per_s") else None
    lines = [f"## {title}", "", f"{unit}" + (", median of the timed rounds ± IQR/median" if spread else ""), "",
             "| case | " + " | ".join(summaries) + " |", "|---" * (len(summaries) + 1) + "|"]
    for key in cases:
        reference = summaries[baseline].get(key, {}).get(metric)
        cells = []
        for name, summary in summaries.items():
            row = summary.get(key, {})
            if metric not in row:
                why = bench_compare.not_measured_reason(row, metric)
                cells.append(f"not measured: {why}" if why else "")
                continue
            cell = _number(row[metric], scale)
            if spread:
                cell += f" ±{row[spread]:.0%}"
            if name != baseline and reference:
                cell += f" (×{row[metric] / reference:.3f})"
            cells.append(cell)
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines + [""]


def _roofline(runs, summaries) -> list[str]:
    lines = ["## Decode roofline (batch 1)", "",
             "Upper bound = copy bandwidth measured in the same run / weight bytes one decode step reads (every "
             "parameter of each module the step runs, 4-bit quant state included, one row of each embedding "
             "table, all of the tied lm_head). KV-cache and activation traffic are left out, so the bound is "
             "optimistic; the spec column divides the datasheet bandwidth instead. Graph = the decode replayed "
             "from a CUDA graph, eager = as generate() runs it.", "",
             "| set | case | weight MiB/token | bound tokens/s | graph tokens/s | graph / bound | graph / spec bound "
             "| eager tokens/s | eager / bound |",
             "|---" * 9 + "|"]
    for name, summary in summaries.items():
        bandwidth = runs[name].get("stackcheck", {}).get("bandwidth") or {}
        measured_bw, spec_bw = bandwidth.get("measured_bytes_per_s"), bandwidth.get("spec_bytes_per_s")
        for key, row in summary.items():
            per_token = row.get("decode_weight_bytes_per_token")
            graph, eager = row.get("decode_graph_tokens_per_s"), row.get("decode_tokens_per_s")
            if not (per_token and measured_bw and (graph or eager)):
                continue
            bound = measured_bw / per_token
            cells = [_number(per_token, MIB), _number(bound),
                     _number(graph) if graph else "", f"{graph / bound:.1%}" if graph else "",
                     f"{graph / (spec_bw / per_token):.1%}" if graph and spec_bw else "",
                     _number(eager) if eager else "", f"{eager / bound:.1%}" if eager else ""]
            lines.append(f"| {name} | {key} | " + " | ".join(cells) + " |")
    return lines + [""]


def _weights(summaries) -> list[str]:
    lines = ["## Weights: expected and measured", "",
             "Expected = the arithmetic (NF4: 0.5 byte/parameter + one fp32 absmax per 64-value block, or with "
             "double quant one 8-bit absmax per block + one fp32 absmax per 256 blocks; everything else numel × "
             "its dtype's size). Stored = the tensors really held: the gap stored − expected is what the "
             "arithmetic leaves out, the quant states' code tables and offsets and the model's buffers. "
             "Allocated = torch allocator growth over the load (GPU only): the gap allocated − stored is the "
             "allocator's rounding of each tensor up to 512 bytes plus anything the load left allocated. "
             "Host-side = weights on the CPU or offloaded by accelerate (`meta`).", "",
             "| set | case | expected MiB | stored MiB | allocated MiB | allocated / expected | stored − expected KiB "
             "| allocated − stored KiB | host-side expected MiB |",
             "|---" * 9 + "|"]
    for name, summary in summaries.items():
        for key, row in summary.items():
            weights = row["weights"]
            main = "cuda" if "cuda" in weights["expected"] else "cpu"
            expected, stored = weights["expected"].get(main, 0), weights["stored"].get(main, 0)
            allocated = weights.get("allocated_after_load")
            host = sum(v for device, v in weights["expected"].items() if device != main)
            on_gpu = allocated is not None
            cells = [_number(expected, MIB), _number(stored, MIB), _number(allocated, MIB) if on_gpu else "",
                     f"{allocated / expected:.4f}" if on_gpu and expected else "", _number(stored - expected, 1024),
                     _number(allocated - stored, 1024) if on_gpu else "", _number(host, MIB) if host else ""]
            lines.append(f"| {name} | {key} | " + " | ".join(cells) + " |")
    return lines + [""]


def _repeatability(summaries) -> list[str]:
    modes = {"decode_graph_repeat_tokens_per_s": "graph", "decode_repeat_tokens_per_s": "eager"}
    rows = [(name, key, mode, row[metric]) for metric, mode in modes.items() for name, summary in summaries.items()
            for key, row in summary.items() if len(row.get(metric, [])) >= 2]
    if not rows:
        return []
    lines = ["## Repeatability of the 4-bit decode", "",
             "Independent measurements in one sitting (each its own warm-up and timed rounds; in graph mode each "
             "its own capture); target CV ≤ 3%.", "",
             "| set | case | decode | N | tokens/s (median of each) | coefficient of variation |", "|---" * 6 + "|"]
    for name, key, mode, values in rows:
        lines.append(f"| {name} | {key} | {mode} | {len(values)} | {', '.join(_number(v) for v in values)} | "
                     f"{bench_compare.coefficient_of_variation(values):.2%} |")
    return lines + [""]


def _distributed(runs: dict[str, dict], baseline: str) -> list[str]:
    """The distributed training case (stackcheck.bench.distributed): the job's tokens/s at world sizes 1 and 2 with
    the scaling efficiency, then every rank's memory against the sharding arithmetic."""
    cells = {name: bench_compare.summarize_distributed(run) for name, run in runs.items()}
    pairs = list(dict.fromkeys((row["size"], row["engine"]) for rows in cells.values() for row in rows.values()))
    if not pairs:
        return []
    lines = ["## Distributed QLoRA training (FSDP2, DeepSpeed ZeRO-3)", "",
             "Launched as users launch them (`accelerate launch --config_file fixtures/distributed/<engine>.yaml`), the "
             "families' recipes, each rank training its own micro batch. Tokens/s of the job = tokens a rank's step x world "
             "size / the median synchronized step, its slowest rank's, ± IQR/median of its steps; the ratio is against the "
             "baseline set. [half batch r]: the step time on half the batch over the full one's, the highest of any rank "
             "(0.5: the GPU sets the speed; 1: the host does). Scaling efficiency = world size 2's tokens/s / (2 x world "
             f"size 1's); \"host-bound\" where a world size's half-batch ratio is above {bench_compare.HOST_BOUND_RATIO}: "
             "there the host's launches set the speed, and the ratio of two host-bound speeds is no efficiency.", "",
             "| set | size | engine | workload | ws1 tokens/s | ws2 tokens/s | scaling efficiency |", "|---" * 7 + "|"]
    for name, rows in cells.items():
        for size, engine in pairs:
            cols = []
            for world_size in (1, 2):
                key = bench_compare.distributed_key(size, engine, world_size)
                row, reference = rows.get(key, {}), cells[baseline].get(key, {}).get("train_tokens_per_s")
                if "train_tokens_per_s" not in row:
                    why = bench_compare.not_measured_reason(row, "train_tokens_per_s")
                    cols.append(f"not measured: {why}" if why else "")
                    continue
                ratio = f" (×{row['train_tokens_per_s'] / reference:.3f})" if name != baseline and reference else ""
                cols.append(f"{_number(row['train_tokens_per_s'])} ±{row['train_spread']:.0%}{ratio} "
                            f"[half batch {row['half_batch_time_ratio']:.2f}]")
            workload = next((row["workload"] for row in rows.values() if (row["size"], row["engine"]) == (size, engine)
                             and "workload" in row), "")
            lines.append(f"| {name} | {size} | {engine} | {workload} | " + " | ".join(cols)
                         + f" | {_efficiency(rows, size, engine)} |")
    lines += ["", "Per rank: peak allocated (torch allocator) from the rank's start through `prepare` (load and sharding), "
              "and over the timed steps (reset at their start); allocated at rest after `prepare`; the arithmetic of what the "
              "rank should hold at rest: the user's (every parameter / world size: the engine was told to shard the whole "
              "model; the 4-bit quant states whole, as they are no parameters) and the engine's (each part's bytes / world "
              "size where the engine really shards it, whole where it does not), beside what its parameters hold (shards "
              "padded); held / user's is flagged where a part is held above the user's arithmetic. The peaks' excess over "
              "the arithmetic is the step's: activations, gradients, the layers an engine gathers, AdamW's moments.", "",
              "| set | size | engine | ws | rank | peak load+prepare MiB | peak steps MiB | allocated at rest MiB "
              "| user's arithmetic MiB | engine's arithmetic MiB | held MiB | held / user's | sharded | whole |", "|---" * 14 + "|"]
    for name, rows in cells.items():
        for row in rows.values():
            for rank in row["record"].get("ranks", []):
                memory = [rank.get(key) for key in ("peak_allocated_load_prepare_bytes", "peak_allocated_steps_bytes",
                                                    "allocated_after_prepare_bytes")]
                parts = rank["arithmetic"]
                sharded = [part for part, sizes in parts.items() if sizes["sharded_bytes"]]
                whole = [part for part, sizes in parts.items() if sizes["whole_bytes"] > sizes["sharded_bytes"]]
                users = rank.get("users_expected_on_rank_bytes")
                cols = [str(row["world_size"]), str(rank["rank"]), *(_number(v, MIB) if v is not None else "" for v in memory),
                        _number(users, MIB) if users is not None else "", _number(rank["expected_on_rank_bytes"], MIB),
                        _number(rank["held_bytes"], MIB), _held_against_users(rank), ", ".join(sharded), ", ".join(whole)]
                lines.append(f"| {name} | {row['size']} | {row['engine']} | " + " | ".join(cols) + " |")
    return lines + [""]


def _efficiency(rows: dict[str, dict], size: str, engine: str) -> str:
    """The scaling efficiency, or "host-bound" where a world size's half-batch ratio says the host sets the speed."""
    if bench_compare.host_bound(rows, size, engine):
        return "host-bound"
    efficiency = bench_compare.scaling_efficiency(rows, size, engine)
    return f"{efficiency:.1%}" if efficiency is not None else ""


def _held_against_users(rank: dict) -> str:
    """What the rank holds over the user's arithmetic, and the parts it holds more of than that arithmetic allows."""
    users = rank.get("users_arithmetic")
    if not users or not rank.get("users_expected_on_rank_bytes"):
        return ""
    ratio = f"{rank['held_bytes'] / rank['users_expected_on_rank_bytes']:.2f}"
    over = [part for part, held in rank.get("held_by_part", {}).items()
            if part in users and held > users[part]["on_rank_bytes"] * (1 + bench_compare.HELD_SLACK)]
    return f"{ratio}: **{', '.join(over)} over the user's arithmetic**" if over else ratio


def _plot(summaries, cases, plots_dir: Path, notes: list[str]) -> list[tuple[str, str]]:
    """One PNG per metric with data: a panel per model size, a group of bars per case, a bar per set."""
    try:
        import matplotlib
    except ImportError:
        notes.append("matplotlib is not installed: wrote the report without plots (pip install 'stackcheck[bench]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, title, unit, scale in METRICS:
        measured = [k for k in cases if any(metric in s.get(k, {}) for s in summaries.values())]
        sizes = list(dict.fromkeys(k.split("/")[0] for k in measured))
        if not sizes:
            continue
        figure, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 4.5), squeeze=False)
        for axis, size in zip(axes[0], sizes):
            keys = [k for k in measured if k.startswith(size + "/")]
            width = 0.8 / len(summaries)
            for index, (name, summary) in enumerate(summaries.items()):
                values = [summary.get(k, {}).get(metric, 0) / scale for k in keys]
                axis.bar([i + index * width for i in range(len(keys))], values, width, label=name)
            axis.set_xticks([i + width * (len(summaries) - 1) / 2 for i in range(len(keys))])
            axis.set_xticklabels([k.split("/", 1)[1] for k in keys], rotation=30, ha="right")
            axis.set_title(f"{size} model")
            axis.set_ylabel(unit)
            axis.legend()
        figure.suptitle(title)
        figure.tight_layout()
        filename = f"{metric}.png"
        figure.savefig(plots_dir / filename, dpi=100)
        plt.close(figure)
        written.append((filename, title))
    return written
