"""The training benchmark's summary (``scripts/bench/bench_train.py``): each update's fastest run, and the
Markdown tables of times and shares, and of launches and syncs per decoding step."""

import statistics
from typing import Dict, List

from .bench_passes import RANGE_KEYS

BASELINE = "beam_hard"
TARGET_RATIO = 1.25  # the target: soft <= 1.25x the time of hard at k=5 on the Multi30k-sized model


def summarize(results: List[dict]) -> dict:
    """Totals over the updates (fastest run of each update), the largest memory of the runs and
    the range shares of the fastest profiled pass."""
    fastest = [min(update, key=lambda r: r["seconds"]) for update in zip(*(r["updates"] for r in results))]
    seconds = sum(r["seconds"] for r in fastest)
    profile = min((r["profile"] for r in results), key=lambda p: p["profiled_seconds"])
    peaks = [r["peak_mib"] for r in results if r["peak_mib"] is not None]
    growths = [r["growth_mib"] for r in results if r["growth_mib"] is not None]
    solves = sum(r["solves"] for r in fastest)
    # the median and the slowest update tell a steady cost from one-off costs inside the timed updates (a Triton
    # kernel compiled for a newly met specialisation takes seconds once)
    return {"tokens_per_s": sum(r["tokens"] for r in fastest) / seconds, "ms_per_update": 1e3 * seconds / len(fastest),
            "median_ms": 1e3 * statistics.median(r["seconds"] for r in fastest),
            "slowest_ms": 1e3 * max(r["seconds"] for r in fastest),
            "peak_mib": max(peaks, default=float("nan")), "growth_mib": max(growths, default=float("nan")),
            "newton_per_call": sum(r["newton_iters"] for r in fastest) / solves if solves else float("nan"),
            **{f"{key}_share": profile[key] / profile["profiled_seconds"] for key in RANGE_KEYS},
            "cuda_launches_per_step": profile.get("cuda_launches_per_step"),
            "counts": results[0].get("counts")}  # counts do not depend on timing: the first run's


def format_table(summary: Dict[str, dict], memory: str) -> str:
    """Markdown table; ``time vs hard`` is the time per update over that of :data:`BASELINE`."""
    base = summary.get(BASELINE, {}).get("ms_per_update", float("nan"))
    lines = [f"| config | target tokens/s | ms/update | median ms | slowest ms | {memory} | top-k fwd | top-k bwd | "
             "select | mix | Newton it. | time vs hard |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in summary.items():
        if "skipped" in r:
            lines.append(f"| {name} | {r['skipped']} |" + " - |" * 10)
            continue
        newton = "-" if r["newton_per_call"] != r["newton_per_call"] else f"{r['newton_per_call']:.1f}"  # nan: none
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['ms_per_update']:.1f} | {r['median_ms']:.1f} | "
                     f"{r['slowest_ms']:.1f} | "
                     f"{r['peak_mib']:.0f} (+{r['growth_mib']:.0f}) | {100 * r['topk_fwd_share']:.1f}% | "
                     f"{100 * r['topk_bwd_share']:.1f}% | {100 * r['select_share']:.1f}% | {100 * r['mix_share']:.1f}% | {newton} | "
                     f"{r['ms_per_update'] / base:.2f}x |")
    for name in ("beam_soft", "beam_soft_pool", "beam_soft_fixed"):
        if name in summary and BASELINE in summary:
            ratio = summary[name]["ms_per_update"] / base
            verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
            lines.append(f"\n{name} / {BASELINE} = {ratio:.2f}x (target <= {TARGET_RATIO}x): {verdict}")
    return "\n".join(lines)


def format_count_table(summary: Dict[str, dict]) -> str:
    """Markdown table of launches and syncs per decoding step (:func:`~fairseq_softtopk.experiments.bench_passes.count_dispatches`), by part; on CUDA with
    the kernel launches and host syncs that CUDA saw, elsewhere a line that says they are n/a; then the kernel
    fallbacks per step of the rows that had any."""
    parts = ["step", "select", "solve", "mix", "solve bwd", "other bwd", "per batch"]
    cuda = any(r.get("cuda_launches_per_step") is not None for r in summary.values())
    head = ("| config | launches/step | vs hard | syncs/step | syncs/batch | " + " | ".join(parts)
            + " | fused solve | fused vs hard |" + (" CUDA launches/step | CUDA syncs/step |" if cuda else ""))
    lines = [head, "|---|" + "---:|" * (len(parts) + 6 + 2 * cuda)]
    base = summary.get(BASELINE, {}).get("counts")
    base_total = sum(base["launches"].values()) if base else float("nan")
    fallbacks = []
    for name, r in summary.items():
        counts = r.get("counts")
        if "skipped" in r and not counts:
            lines.append(f"| {name} | {r['skipped']} |" + " - |" * (len(parts) + 5 + 2 * cuda))
            continue
        if not counts:
            continue
        if counts.get("fallbacks"):
            fallbacks.append(f"{name}: " + ", ".join(f"{reason} {n:.1f}" for reason, n in counts["fallbacks"].items()))
        launches = counts["launches"]
        total = sum(launches.values())
        fused = total - launches.get("solve", 0.0) - launches.get("solve bwd", 0.0) + 2 * ("solve" in launches)
        cells = [f"{total:.0f}", f"{total / base_total:.2f}x", f"{counts['syncs_step']:.1f}",
                 f"{counts['syncs_batch']:.1f}", *(f"{launches.get(part, 0.0):.0f}" for part in parts),
                 f"{fused:.0f}", f"{fused / base_total:.2f}x"]
        if cuda:
            cuda_launches = r.get("cuda_launches_per_step")
            cells += ["-" if cuda_launches is None else f"{cuda_launches:.0f}",
                      "-" if counts["cuda_syncs_step"] is None else f"{counts['cuda_syncs_step']:.1f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if not cuda:
        lines.append("\nCUDA launches/step and CUDA syncs/step: n/a (not on CUDA)")
    if fallbacks:
        lines.append("\nkernel fallbacks per step (calls that asked for the Triton kernels and ran on the torch path, "
                     "by reason): " + "; ".join(fallbacks))
    return "\n".join(lines)
