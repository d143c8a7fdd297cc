"""The ablation report: ``results.json`` (scores per arm and seed, mean ± sd over seeds, paired
bootstrap against the baseline and the ``compare_to`` arms per seed, a paired t-test over the seeds)
and its ``results.md`` tables (used by :mod:`.ablation_runner`)."""

import json
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

from .ablation_config import flags_to_args, stage_flags
from .fairseq_commands import PACKAGE_DIR

TRAIN_STATS = ("wall_seconds", "cpu_seconds", "gnorm_median", "clipped_percent")
#: further statistics of a run's log (ablation_training.read_train_stats), reported where logged
LOG_STATS = ("tf_gnorm_median", "beam_gnorm_median", "train_seconds", "train_seconds_updates", "updates",
             "valid_bleu")


def display_path(path) -> str:
    """``path`` relative to the repository when inside it (reports are committed under results/:
    no machine's absolute paths), else as given."""
    try:
        return str(Path(path).resolve().relative_to(PACKAGE_DIR.parent))
    except ValueError:
        return str(path)


def _mean_sd(values: Sequence[float]) -> tuple:
    import statistics

    return round(statistics.fmean(values), 2), round(statistics.stdev(values), 2) if len(values) > 1 else 0.0


def paired_ttest(base: Mapping[str, float], other: Mapping[str, float]) -> Optional[dict]:
    """Paired t-test of ``other - base`` over the seeds both have (scipy's ``ttest_rel``, two-sided): the mean
    and sd of the differences, t, p and the number of seeds; None with fewer than 2 seeds."""
    seeds = [seed for seed in base if seed in other]
    if len(seeds) < 2:
        return None
    from scipy import stats

    deltas = [other[seed] - base[seed] for seed in seeds]
    mean, sd = _mean_sd(deltas)
    test = stats.ttest_rel([other[seed] for seed in seeds], [base[seed] for seed in seeds])
    t, p = float(test.statistic), float(test.pvalue)
    return {"delta_mean": mean, "delta_sd": sd, "t": round(t, 3) if t == t else None,
            "p_value": round(p, 4) if p == p else None, "n_seeds": len(seeds)}


def summarise(config: dict, runs: dict, arms: Sequence[str], seeds: Sequence[int], bootstrap_samples: int,
              skipped: Optional[Mapping[str, str]] = None) -> dict:
    """Scores per arm/seed/subset, mean and spread over seeds, and paired bootstrap of every
    arm against the baseline of the same seed (``bootstrap``) and against each of the config's
    ``compare_to`` arms (``bootstrap_vs``); ``skipped``: requested arms that did not run, arm -> reason."""
    from .paired_bootstrap import paired_bootstrap
    from .scoring import output_length

    baseline = config["baseline"]
    # paired bootstrap against the baseline, and against each compare_to arm that ran
    references = [baseline] + [a for a in config.get("compare_to") or [] if a in runs and a != baseline]
    scores, summary, train, signatures = {}, {}, {}, {}
    against: Dict[str, dict] = {ref: {} for ref in references}
    for arm, by_seed in runs.items():
        for seed, run in by_seed.items():
            train.setdefault(arm, {})[seed] = {k: run["train"].get(k) for k in TRAIN_STATS}
            train[arm][seed].update({k: run["train"][k] for k in LOG_STATS if run["train"].get(k) is not None})
            for subset, ev in run["eval"].items():
                signatures = {"bleu": ev["bleu_signature"], "chrf": ev["chrf_signature"]}
                scores.setdefault(arm, {}).setdefault(seed, {})[subset] = {
                    k: ev[k] for k in ("bleu", "chrf", "n_sentences", "reference", "lenpen", "lenpen_valid_bleu",
                                      "at_lenpen")
                    if k in ev}
                if ev.get("hypotheses") is not None and ev.get("references") is not None:
                    scores[arm][seed][subset].update(output_length(ev["hypotheses"], ev["references"]))
                for ref in references:
                    if arm in (ref, "pretrained"):
                        continue
                    base = runs[ref].get(seed, {}).get("eval", {}).get(subset)
                    if base is None:
                        continue
                    if base["references"] != ev["references"]:
                        raise ValueError(f"{arm} and {ref} (seed {seed}) were scored against different {subset} "
                                         f"references ({ev['reference']} / {base['reference']})")
                    against[ref].setdefault(arm, {}).setdefault(seed, {})[subset] = paired_bootstrap(
                        base["hypotheses"], ev["hypotheses"], ev["references"], n_samples=bootstrap_samples)
        for subset in next(iter(by_seed.values()))["eval"]:
            per_seed = [scores[arm][s][subset] for s in by_seed]
            (bleu, bleu_sd), (chrf, chrf_sd) = (_mean_sd([r[m] for r in per_seed]) for m in ("bleu", "chrf"))
            summary.setdefault(arm, {})[subset] = {"bleu_mean": bleu, "bleu_sd": bleu_sd, "chrf_mean": chrf,
                                                   "chrf_sd": chrf_sd, "n_seeds": len(per_seed)}
    bootstrap = against.pop(baseline)
    ttest = {ref: {arm: {subset: paired_ttest({seed: scores[ref][seed][subset]["bleu"] for seed in scores[ref]},
                                              {seed: scores[arm][seed][subset]["bleu"] for seed in scores[arm]})
                         for subset in summary[arm] if subset in summary[ref]}
                   for arm in arms if arm != ref and arm in scores}
             for ref in references}
    return {
        "description": " ".join(str(config.get("description", "")).split()), "config": display_path(config["path"]),
        "stage": config["stage"], "baseline": baseline, "arms": list(arms), "skipped": dict(skipped or {}),
        "seeds": list(seeds),
        "arm_flags": {arm: flags_to_args(config["arms"][arm]) for arm in arms},
        "common_flags": flags_to_args(stage_flags(config)), "eval": config.get("eval") or {},
        "signatures": signatures, "scores": scores, "summary": summary, "bootstrap": bootstrap,
        "bootstrap_vs": against, "ttest": ttest, "train": train,
        "bootstrap_method": f"paired bootstrap resampling, {bootstrap_samples} resamples, numpy seed 12345, "
                            f"two-sided p, percentile 95% CI of the difference "
                            f"(fairseq_softtopk/experiments/paired_bootstrap.py)",
        "notes": [" ".join(str(n).split()) for n in config.get("notes") or []],
    }


def _mean_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _seconds(value) -> str:
    """Seconds as a whole number; ``-`` where not measured (CPU seconds of runs trained side by side)."""
    return "-" if value is None else f"{value:.0f}"


def _fmt_delta(arm_boot: Dict[str, dict], subset: str, metric: str) -> tuple:
    """(difference cell, p cell) over seeds."""
    rows = [by_subset[subset][metric] for by_subset in arm_boot.values()]
    if len(rows) == 1:
        lo, hi = rows[0]["delta_ci95"]
        return f"{rows[0]['delta']:+.2f} [{lo:+.2f}, {hi:+.2f}]", f"{rows[0]['p_value']:.3g}"
    mean, sd = _mean_sd([r["delta"] for r in rows])
    return f"{mean:+.2f} ± {sd:.2f}", ", ".join(f"{r['p_value']:.3g}" for r in rows)


def _scored_checkpoint(results: dict) -> str:
    """What the report scores, in words (the eval settings' ``checkpoint`` and ``lenpen_grid``)."""
    eval_cfg = results.get("eval") or {}
    which = ("checkpoint_best (by the validation metric of fairseq-train) within the same update budget"
             if eval_cfg.get("checkpoint") == "best" else "checkpoint_last after the same update budget")
    if eval_cfg.get("lenpen_grid"):
        which += (f", decoded at the length penalty of {eval_cfg['lenpen_grid']} that scores best on valid "
                  f"(per run; valid's scores are at that choice)")
    return which


def _ttest_cell(test: Optional[dict]) -> str:
    """A :func:`paired_ttest` as a table cell: mean ± sd of the differences (p); empty without a test."""
    if not test:
        return ""
    return (f"{test['delta_mean']:+.2f} ± {test['delta_sd']:.2f} "
            f"({'-' if test['p_value'] is None else format(test['p_value'], '.3g')})")


def best_checkpoint_update(valid_bleu: Optional[Sequence[Sequence[float]]]) -> Optional[int]:
    """The update whose validation fairseq-train kept as checkpoint_best from ``[[update, BLEU], ...]``
    (``read_train_stats``'s ``valid_bleu``): the highest BLEU, the later one on a tie (fairseq's
    ``save_checkpoint`` replaces the best when a score is at least the best; its BLEU is rounded as logged)."""
    if not valid_bleu:
        return None
    top = max(bleu for _, bleu in valid_bleu)
    return max(int(update) for update, bleu in valid_bleu if bleu == top)


def _per_seed_markdown(results: dict) -> list:
    """BLEU / chrF of each arm, subset and seed as scored (the tables above give their means); nothing for one seed."""
    arms, seeds, scores = results["arms"], [str(seed) for seed in results["seeds"]], results["scores"]
    if len(seeds) < 2:
        return []
    lines = ["BLEU / chrF per seed, as scored:", "",
             "| arm | subset | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|---|" + "---|" * len(seeds)]
    for arm in arms:
        for subset in results["summary"].get(arm, {}):
            cells = []
            for seed in seeds:
                score = scores.get(arm, {}).get(seed, {}).get(subset)
                cells.append(f"{score['bleu']:.2f} / {score['chrf']:.2f}" if score else "-")
            lines.append(f"| {arm} | {subset} | {' | '.join(cells)} |")
    return lines + [""]


def _over_seeds_markdown(results: dict) -> list:
    """The report's tables across seeds: paired t-tests against the baseline and the ``compare_to`` arms, the
    scores per seed, the length penalty chosen per run, the update of the scored checkpoint_best, the untuned length
    penalties, the output's length, the loss terms' gradient norms, the cost per update and the validation BLEU
    during training; each where its numbers exist."""
    lines, arms, seeds = [], results["arms"], [str(seed) for seed in results["seeds"]]
    ttest = results.get("ttest") or {}
    if any(test for by_arm in ttest.values() for by_subset in by_arm.values() for test in by_subset.values()):
        refs = list(ttest)
        lines += ["## Over the seeds", "", "Paired t-test of the per-seed BLEU (scipy `ttest_rel`, two-sided): "
                  "mean ± sd of the differences, p.", "",
                  "| arm | subset | " + " | ".join(f"ΔBLEU vs {ref} (p)" for ref in refs) + " |",
                  "|---|---|" + "---|" * len(refs)]
        for arm in arms:
            for subset in results["summary"].get(arm, {}):
                cells = [_ttest_cell(ttest[ref].get(arm, {}).get(subset)) for ref in refs]
                if any(cells):
                    lines.append(f"| {arm} | {subset} | {' | '.join(cells)} |")
        lines.append("")
    scores = results["scores"]
    lines += _per_seed_markdown(results)
    chosen = {arm: [scores[arm][seed][next(iter(scores[arm][seed]))].get("lenpen") for seed in seeds
                    if seed in scores.get(arm, {})] for arm in arms}
    if any(value is not None for values in chosen.values() for value in values):
        lines += ["Length penalty chosen on valid, per seed:", "", "| arm | " + " | ".join(f"seed {s}" for s in seeds)
                  + " |", "|---|" + "---|" * len(seeds)]
        lines += [f"| {arm} | {' | '.join(str(v) for v in values)} |" for arm, values in chosen.items()]
        lines.append("")
    train = results["train"]
    best = {arm: [best_checkpoint_update(train[arm][seed].get("valid_bleu")) for seed in seeds
                  if seed in train.get(arm, {})] for arm in arms}
    scored_best = (results.get("eval") or {}).get("checkpoint") == "best"
    if scored_best and any(u is not None for values in best.values() for u in values):
        lines += ["The update of the scored checkpoint_best (fairseq-train's best validation BLEU; the later one on a "
                  "tie, as fairseq), per seed:", "", "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |",
                  "|---|" + "---|" * len(seeds)]
        lines += [f"| {arm} | {' | '.join('-' if u is None else str(u) for u in values)} |"
                  for arm, values in best.items()]
        lines.append("")
    lines += _fixed_lenpen_markdown(results)
    lines += _length_markdown(results)

    def mean_of(arm, key):
        return _mean_or_none([train[arm][seed].get(key) for seed in train.get(arm, {})])

    if any(mean_of(arm, "beam_gnorm_median") is not None for arm in arms):
        lines += ["Gradient norms of the two weighted loss terms apart (medians over the measured batches, mean over "
                  "seeds; divided by the sample size, as fairseq's gnorm):", "",
                  "| arm | token term (tf_gnorm) | beam term (beam_gnorm) | beam / token |", "|---|---|---|---|"]
        for arm in arms:
            tf, beam = mean_of(arm, "tf_gnorm_median"), mean_of(arm, "beam_gnorm_median")
            if beam is not None:
                lines.append(f"| {arm} | {tf:.3g} | {beam:.3g} | {beam / tf:.2f} |" if tf else
                             f"| {arm} | - | {beam:.3g} | - |")
        lines.append("")
    def seconds_per_update(arm):
        return _mean_or_none([t["train_seconds"] / t["train_seconds_updates"] for t in train.get(arm, {}).values()
                              if t.get("train_seconds") is not None and t.get("train_seconds_updates")])

    if any(seconds_per_update(arm) is not None for arm in arms):
        lines += ["Cost: seconds of training per update (fairseq's train_wall: validation and saving excluded; an "
                  "interval redone after a resume counted once), mean over seeds (runs side by side share the "
                  "machine):", "", "| arm | updates | s / update |", "|---|---|---|"]
        for arm in arms:
            cost = seconds_per_update(arm)
            if cost is not None:
                lines.append(f"| {arm} | {mean_of(arm, 'updates'):.0f} | {cost:.2f} |")
        lines.append("")
    curves = {arm: [train[arm][seed].get("valid_bleu") or [] for seed in train.get(arm, {})] for arm in arms}
    points = sorted({u for runs in curves.values() for run in runs for u, _ in run})
    if points:
        lines += ["Validation BLEU during training (fairseq-train `--eval-bleu`, mean over seeds):", "",
                  "| arm | " + " | ".join(f"update {u}" for u in points) + " |", "|---|" + "---|" * len(points)]
        for arm, runs in curves.items():
            cells = []
            for u in points:
                values = [b for run in runs for at, b in run if at == u]
                cells.append(f"{sum(values) / len(values):.2f}" if values else "")
            lines.append(f"| {arm} | {' | '.join(cells)} |")
        lines.append("")
    return lines


def _length_markdown(results: dict) -> list:
    """The output's length per arm: on each subset as scored (at the length penalty chosen on valid where one
    was), and at each untuned length penalty (``eval.fixed_lenpens``) where every seed's score has it;
    hypothesis / reference tokens of corpus BLEU and its brevity penalty, means over seeds."""
    scores = results["scores"]
    arms = [arm for arm in ["pretrained"] + results["arms"] if arm in scores]
    subsets = list(results["summary"][results["arms"][0]])
    columns = [(subset, None) for subset in subsets]
    columns += sorted({(subset, value) for arm in arms for by_subset in scores[arm].values()
                       for subset, entry in by_subset.items() for value in entry.get("at_lenpen") or {}})
    cells = {}
    for arm in arms:
        for subset, value in columns:
            runs = [by_subset[subset] if value is None else (by_subset[subset].get("at_lenpen") or {}).get(value)
                    for by_subset in scores[arm].values() if subset in by_subset]
            if runs and all(run and "length_ratio" in run for run in runs):  # every seed's, or none shown
                cells[arm, subset, value] = (sum(run["length_ratio"] for run in runs) / len(runs),
                                             sum(run["brevity_penalty"] for run in runs) / len(runs))
    columns = [column for column in columns if any((arm, *column) in cells for arm in arms)]
    if not columns:
        return []
    labels = [subset if value is None else f"{subset} at lenpen {value}" for subset, value in columns]
    lines = ["Output length (hypothesis / reference tokens of corpus BLEU, and its brevity penalty BP; mean over "
             "seeds), as scored and at the untuned length penalties:", "",
             "| arm | " + " | ".join(f"{label} length | {label} BP" for label in labels) + " |",
             "|---|" + "---:|---:|" * len(columns)]
    for arm in arms:
        row = [f"{cells[arm, subset, value][0]:.3f} | {cells[arm, subset, value][1]:.3f}"
               if (arm, subset, value) in cells else " | " for subset, value in columns]
        lines.append(f"| {arm} | {' | '.join(row)} |")
    return lines + [""]


def _fixed_lenpen_markdown(results: dict) -> list:
    """The table of ``eval.fixed_lenpens``: each subset other than valid decoded at each of those length penalties
    (untuned), mean ± sd over seeds, and the paired t-test of the per-seed BLEU against the baseline and the
    ``compare_to`` arms."""
    scores, arms = results["scores"], [arm for arm in ["pretrained"] + results["arms"] if arm in results["scores"]]
    refs = list(results.get("ttest") or {}) or [results["baseline"]]
    # (subset, lenpen) -> arm -> seed -> {"bleu", "chrf"}
    at: Dict[tuple, Dict[str, dict]] = {}
    for arm in arms:
        for seed, by_subset in scores[arm].items():
            for subset, entry in by_subset.items():
                for value, result in (entry.get("at_lenpen") or {}).items():
                    at.setdefault((subset, value), {}).setdefault(arm, {})[seed] = result
    rows = []
    for (subset, value), by_arm in at.items():
        bleu = {arm: {seed: r["bleu"] for seed, r in by_seed.items()} for arm, by_seed in by_arm.items()}
        for arm, by_seed in by_arm.items():
            (mean, sd), (chrf, chrf_sd) = (_mean_sd([r[metric] for r in by_seed.values()])
                                           for metric in ("bleu", "chrf"))
            cells = [_ttest_cell(paired_ttest(bleu[ref], bleu[arm]) if arm not in (ref, "pretrained") and ref in bleu
                                 else None) for ref in refs]
            rows.append(f"| {subset} | {value} | {arm} | {mean:.2f} ± {sd:.2f} | {chrf:.2f} ± {chrf_sd:.2f} | "
                        + " | ".join(cells) + " |")
    if not rows:
        return []
    return ["Untuned length penalties (`eval.fixed_lenpens`: decoded at each, whatever valid chose; mean ± sd over "
            "seeds, and the paired t-test of the per-seed BLEU: mean ± sd of the differences, p):", "",
            "| subset | lenpen | arm | BLEU | chrF | " + " | ".join(f"ΔBLEU vs {ref} (p)" for ref in refs) + " |",
            "|---|---|---|---|---|" + "---|" * len(refs), *rows, ""]


def results_markdown(results: dict) -> str:
    """The ``results.md`` report: one table per evaluated subset, then settings and notes."""
    base, multi = results["baseline"], len(results["seeds"]) > 1
    pretraining = ("Each seed pretrains its own model (seed s: pretraining and fine-tuning with seed s), so the "
                   "spread covers the pretraining too. " if results.get("pretrain_per_seed") else "")
    lines = [f"# Ablation: {Path(results['config']).stem}", "", results["description"], "",
             f"Seeds: {', '.join(map(str, results['seeds']))}" + (" (mean ± sd over seeds; one p per seed)"
                                                                   if multi else "")
             + f". {pretraining}Baseline arm: `{base}`. Every arm: {_scored_checkpoint(results)}.", ""]
    skipped = results.get("skipped") or {}  # absent from results.json written before arms were skipped
    if skipped:
        lines += ["Skipped arms (requested, not run):", "", *(f"- `{arm}`: {why}" for arm, why in skipped.items()), ""]
    rows = ["pretrained"] * ("pretrained" in results["summary"]) + results["arms"]
    spread, p = ("(mean ± sd)", "p per seed") if multi else ("[95% CI]", "p")
    subsets = list(results["summary"][results["arms"][0]])
    for subset in subsets:
        n = results["scores"][base][str(results["seeds"][0])][subset]["n_sentences"]
        lines += [f"## {subset} ({n} sentences)", "",
                  f"| arm | BLEU | chrF | ΔBLEU vs {base} {spread} | {p} | ΔchrF vs {base} {spread} | {p} "
                  f"| grad norm (clipped) | train s (CPU s) |", "|---|---|---|---|---|---|---|---|---|"]
        for arm in rows:
            s = results["summary"][arm][subset]
            spread_shown = s["n_seeds"] > 1  # one pretrained model for every seed, or one per seed
            bleu = f"{s['bleu_mean']:.2f}" + (f" ± {s['bleu_sd']:.2f}" if spread_shown else "")
            chrf = f"{s['chrf_mean']:.2f}" + (f" ± {s['chrf_sd']:.2f}" if spread_shown else "")
            cells = ["", "", "", ""]
            if arm in results["bootstrap"]:
                cells[0:2], cells[2:4] = _fmt_delta(results["bootstrap"][arm], subset, "bleu"), \
                    _fmt_delta(results["bootstrap"][arm], subset, "chrf")
            stats = {key: _mean_or_none([t.get(key) for t in results["train"][arm].values()])
                     for key in (*TRAIN_STATS, "train_seconds")}
            grad = "" if stats["gnorm_median"] is None else f"{stats['gnorm_median']:.3g} ({stats['clipped_percent']:.0f}%)"
            name = {"pretrained": "pretrained (no fine-tuning)", base: f"{base} (baseline)"}.get(arm, arm)
            lines.append(f"| {name} | {bleu} | {chrf} | {' | '.join(cells)} | {grad} | "
                         f"{_seconds(stats['train_seconds'])} ({_seconds(stats['cpu_seconds'])}) |")
        for ref, arms_vs in (results.get("bootstrap_vs") or {}).items():
            lines += ["", f"Against `{ref}` ({subset}):", "",
                      f"| arm | ΔBLEU vs {ref} {spread} | {p} | ΔchrF vs {ref} {spread} | {p} |", "|---|---|---|---|---|"]
            for arm in results["arms"]:
                if arm in arms_vs:
                    cells = [*_fmt_delta(arms_vs[arm], subset, "bleu"), *_fmt_delta(arms_vs[arm], subset, "chrf")]
                    lines.append(f"| {arm} | {' | '.join(cells)} |")
        reference = results["scores"][base][str(results["seeds"][0])][subset]["reference"]
        lines += ["", f"Reference: `{reference}`.", ""]
    lines += _over_seeds_markdown(results)
    lines += ["## Settings", ""]
    if results.get("command") or results.get("commit"):
        lines += [f"- command: `{results.get('command') or '(not recorded)'}` at commit "
                  f"`{results.get('commit') or '(not a git checkout)'}`"]
    lines += [f"- config: `{results['config']}`; data: `{results['data_bin']}`",
              f"- common fairseq-train flags: `{' '.join(results['common_flags'])}`"]
    lines += [f"- arm `{arm}`: `{' '.join(flags) or '(none)'}`" for arm, flags in results["arm_flags"].items()]
    lines += [f"- evaluation: {json.dumps(results['eval'])}",
              f"- BLEU: `{results['signatures'].get('bleu')}`", f"- chrF: `{results['signatures'].get('chrf')}`",
              f"- significance: {results['bootstrap_method']}",
              "- grad norm: median over fairseq's logging intervals of the gradient norm before clipping, with the "
              "share of updates clipped (--clip-norm); train s: seconds of training (fairseq's train_wall summed over "
              "the logged intervals: validation and saving excluded; the machine may be shared), CPU s: CPU seconds "
              "of its processes (where the run trained alone); both means over seeds", "", "## Notes", ""]
    lines += [f"- {note}" for note in results["notes"]] or ["- (none)"]
    lines += ["", "![validation curves](curves.png)", ""]
    return "\n".join(lines)
