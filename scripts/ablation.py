#!/usr/bin/env python
"""Beam-search training ablation: one teacher-forcing checkpoint, several fine-tuning arms.

A ``finetune`` config (``configs/*_finetune.yaml``) names its ``pretrain`` config. The
pretrained checkpoint is trained first if it is missing (or given with ``--pretrained``);
every arm (teacher forcing continued = the baseline, beam ``hard``, beam ``soft``, ...) is
then fine-tuned from it with ``--finetune-from-model``, the same update budget, batch size
and seed, and its ``checkpoint_last.pt`` is translated with ``scripts/evaluate.py``. A
``scratch`` config (attention normalisers) trains every arm from scratch instead.
The runner writes ``results.md``, ``results.json`` (BLEU, chrF, sacrebleu signatures,
paired bootstrap against the baseline, mean and spread over ``--seeds``) and ``curves.png``.

Re-running skips finished arms (``done.json``, written atomically after training); a
half-finished arm resumes from its ``checkpoint_last.pt``. A work directory refuses to
continue a run whose fairseq-train arguments have changed.

Example (``DIR`` as written by ``data_prep/prepare_multi30k.sh --out DIR``: ``DIR/bin``
and ``DIR/raw``)::

    python scripts/ablation.py configs/multi30k_en_de_finetune.yaml --data-dir DIR \\
        --work-dir runs/multi30k_ablation --seeds 1 2 3 --set train.max-update=3000
"""

import argparse
import json
import logging
import os
import re
import resource
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from fairseq_commands import fairseq_command, run_logged

logger = logging.getLogger("ablation")

STAGES = ("pretrain", "finetune", "scratch")
HEADER_KEYS = ("description", "stage", "data", "pretrain", "baseline", "compare_to", "default_arms", "notes")
SECTIONS = ("model", "train", "arms", "eval")
#: Flags an arm may not change: every arm gets the same update budget, batches and seed.
BUDGET_FLAGS = ("max-update", "max-epoch", "seed", "max-tokens", "batch-size", "update-freq")
#: Flags the runner sets itself.
MANAGED_FLAGS = ("save-dir", "finetune-from-model", "restore-file", "user-dir")
EVAL_KEYS = ("beam", "batch_size", "subsets", "post_process", "detok_lang", "generate")
DONE, RUN, EVAL = "done.json", "run.json", "eval.json"
TRAIN_STATS = ("wall_seconds", "cpu_seconds", "gnorm_median", "clipped_percent")


# ----------------------------------------------------------------------------- configs

def _read_yaml(path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise FileNotFoundError(f"config not found: {path}")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config must be a YAML mapping, got {type(config).__name__}")
    for name, flags in (config.get("arms") or {}).items():
        config["arms"][name] = flags or {}  # an arm without flags is written "name:"
    config["path"] = str(path)
    return config


def apply_override(config: dict, item: str) -> None:
    """Applies ``section.key=value`` (value parsed as YAML; empty: null, which drops a flag).

    Examples: ``train.max-update=300``, ``arms.soft.topk-epsilon=0.05``,
    ``pretrain.train.max-epoch=2``, ``eval.beam=1``.
    """
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key or key.startswith(".") or key.endswith("."):
        raise ValueError(f"an override looks like section.flag=value, got {item!r}")
    *parents, leaf = key.split(".")
    node = config
    for i, part in enumerate(parents):
        if not isinstance(node.get(part), dict):
            raise ValueError(f"override {item!r}: {'.'.join(parents[:i + 1])!r} is not a section of "
                             f"{config.get('path', 'the config')}")
        node = node[part]
    node[leaf] = yaml.safe_load(raw) if raw.strip() else None


def validate_config(config: dict, _nested: bool = False) -> None:
    """Raises ``ValueError`` naming the first problem of a (resolved) config."""
    where = config.get("path", "config")
    unknown = sorted(set(config) - set(HEADER_KEYS) - set(SECTIONS) - {"path"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (header: {HEADER_KEYS}, sections: {SECTIONS})")
    stage = config.get("stage")
    if stage not in STAGES:
        raise ValueError(f"{where}: stage must be one of {STAGES}, got {stage!r}")
    for section in ("model", "train", "arms", "eval"):
        if not isinstance(config.get(section) or {}, dict):
            raise ValueError(f"{where}: {section!r} must be a mapping")
    if not config.get("train"):
        raise ValueError(f"{where}: needs a 'train' mapping of fairseq-train flags")
    if stage == "finetune":
        if not isinstance(config.get("pretrain"), dict) or config["pretrain"].get("stage") != "pretrain":
            raise ValueError(f"{where}: a finetune config needs 'pretrain': the file name of a pretrain-stage config")
        validate_config(config["pretrain"], _nested=True)
    elif not (config.get("model") or {}).get("arch"):
        raise ValueError(f"{where}: a {stage} config needs model.arch")
    if stage == "pretrain":
        return
    arms = config.get("arms") or {}
    if config.get("baseline") not in arms:
        raise ValueError(f"{where}: baseline {config.get('baseline')!r} is not one of the arms {sorted(arms)}")
    for key in ("default_arms", "compare_to"):
        missing = [a for a in config.get(key) or [] if a not in arms]
        if missing:
            raise ValueError(f"{where}: {key} {missing} are not defined under 'arms'")
    for name, flags in arms.items():
        if not isinstance(flags, dict):
            raise ValueError(f"{where}: arm {name!r} must be a mapping of flags, got {flags!r}")
        budget = sorted(set(flags) & set(BUDGET_FLAGS))
        if budget:
            raise ValueError(f"{where}: arm {name!r} sets {budget}; arms share the update budget, batches and "
                             f"seed (set them under 'train' or with --seeds)")
    for section in ("model", "train", "arms"):
        flags = config.get(section) or {}
        names = [f for arm in flags.values() for f in arm] if section == "arms" else list(flags)
        managed = sorted(set(names) & set(MANAGED_FLAGS))
        if managed:
            raise ValueError(f"{where}: {section} sets {managed}; the runner sets these itself")
    unknown_eval = sorted(set(config.get("eval") or {}) - set(EVAL_KEYS))
    if unknown_eval:
        raise ValueError(f"{where}: unknown eval keys {unknown_eval} (known: {EVAL_KEYS})")


def load_config(path, overrides: Sequence[str] = ()) -> dict:
    """Reads a stage config, resolves its ``pretrain`` config (a path relative to it), applies
    ``overrides`` (see :func:`apply_override`) and validates the result."""
    path = Path(path)
    config = _read_yaml(path)
    if config.get("pretrain"):
        pretrain = Path(config["pretrain"])
        config["pretrain"] = _read_yaml(pretrain if pretrain.is_absolute() else path.parent / pretrain)
    for item in overrides:
        apply_override(config, item)
    validate_config(config)
    return config


def stage_flags(config: dict, arm: Optional[str] = None) -> Dict[str, object]:
    """fairseq-train flags of a stage (and arm): model flags (a finetune stage inherits its
    pretrain config's, so the checkpoint fits), then ``train``, then the arm's."""
    flags = dict(config["pretrain"].get("model") or {}) if config.get("stage") == "finetune" else {}
    flags.update(config.get("model") or {})
    flags.update(config["train"])
    if arm is not None:
        if arm not in config.get("arms", {}):
            raise ValueError(f"unknown arm {arm!r}; {config['path']} defines {sorted(config.get('arms', {}))}")
        flags.update(config["arms"][arm])
    return flags


def flags_to_args(flags: Mapping[str, object]) -> List[str]:
    """``{"lr": 0.1, "no-epoch-checkpoints": True, "x": False, "y": None}`` -> ``["--lr", "0.1",
    "--no-epoch-checkpoints"]``; lists become several values."""
    args: List[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        if isinstance(value, dict):
            raise ValueError(f"flag {name!r}: a value must be a scalar or a list, got the mapping {value!r}")
        if value is True:
            args.append(f"--{name}")
        elif isinstance(value, (list, tuple)):
            args += [f"--{name}", *map(str, value)]
        else:
            args += [f"--{name}", str(value)]
    return args


def config_train_args(path, arm: Optional[str] = None, overrides: Sequence[str] = ()) -> List[str]:
    """fairseq-train arguments (without data, save dir and seed) of a config file and arm."""
    return flags_to_args(stage_flags(load_config(path, overrides), arm))


# ----------------------------------------------------------------------------- data

def language_pair(data_bin: Path, flags: Mapping[str, object]) -> tuple:
    """``(source, target)`` language of a fairseq-preprocess directory (or the flags')."""
    if flags.get("source-lang") and flags.get("target-lang"):
        return str(flags["source-lang"]), str(flags["target-lang"])
    pairs = {p.name.split(".")[1] for p in data_bin.glob("train.*-*.*.idx")}
    if len(pairs) != 1:
        raise ValueError(f"{data_bin}: cannot tell the language pair from train.*.idx ({sorted(pairs)}); "
                         f"set train.source-lang and train.target-lang")
    src, tgt = pairs.pop().split("-")
    return src, tgt


def check_data_bin(data_bin: Path) -> None:
    if not data_bin.is_dir():
        raise FileNotFoundError(f"data directory not found: {data_bin} (fairseq-preprocess output; see the "
                                f"data_prep/prepare_*.sh scripts or scripts/run_main_job.py)")
    if not list(data_bin.glob("dict.*.txt")) or not list(data_bin.glob("train.*.idx")):
        raise FileNotFoundError(f"{data_bin} holds no fairseq-preprocess output (dict.*.txt, train.*.idx)")


def subset_size(data_bin: Path, subset: str, src: str, tgt: str) -> int:
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    prefix = data_bin / f"{subset}.{src}-{tgt}.{tgt}"
    if not Path(f"{prefix}.idx").is_file():
        raise FileNotFoundError(f"{data_bin} has no binarised '{subset}' subset ({prefix}.idx)")
    return len(MMapIndexedDataset(str(prefix)))


def reference_file(ref_dir: Optional[Path], subset: str, tgt: str, n_sentences: int) -> Optional[str]:
    """The raw reference of ``subset`` if it is line-aligned with the binarised subset, else None
    (the evaluation then scores against the binarised target)."""
    if ref_dir is None:
        return None
    path = ref_dir / f"{subset}.{tgt}"
    if not path.is_file():
        logger.warning("no raw reference %s: scoring %s against the binarised target", path, subset)
        return None
    with open(path, encoding="utf-8") as f:
        n_lines = sum(1 for _ in f)
    if n_lines != n_sentences:
        logger.warning("%s has %d lines but the binarised %s subset %d sentences (cleaned?): scoring against "
                       "the binarised target instead", path, n_lines, subset, n_sentences)
        return None
    return str(path)


# ----------------------------------------------------------------------------- running

def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_flags(args: Sequence[str]) -> List[str]:
    """fairseq-train arguments without the paths (data, save dir, pretrained checkpoint), so that a
    run directory moved or copied elsewhere (results/ in git) is recognised as the same run."""
    paths = {"--save-dir", "--finetune-from-model"}
    return [arg for i, arg in enumerate(args[1:], 1) if args[i - 1] not in paths]


def train_run(data_bin: Path, flags: Mapping[str, object], save_dir: Path,
              finetune_from: Optional[Path] = None) -> dict:
    """Trains (or resumes, or skips when ``done.json`` exists) one run into ``save_dir``.

    ``run.json`` records the fairseq-train arguments when the run starts; a later call with
    different arguments raises ``ValueError`` instead of mixing two settings in one directory.
    Returns the contents of ``done.json`` (arguments, wall and CPU seconds of this call).
    """
    flags = {"required-batch-size-multiple": 1, "log-format": "simple", **flags}
    args = [str(data_bin), *flags_to_args(flags), "--save-dir", str(save_dir)]
    if finetune_from is not None:
        args += ["--finetune-from-model", str(finetune_from)]
    save_dir.mkdir(parents=True, exist_ok=True)
    if (save_dir / RUN).exists():
        earlier = json.loads((save_dir / RUN).read_text())["args"]
        if _run_flags(earlier) != _run_flags(args):
            changed = sorted(set(_run_flags(earlier)) ^ set(_run_flags(args)))
            raise ValueError(f"{save_dir} holds a run with other fairseq-train arguments (differing: {changed}); "
                             f"use another --work-dir or remove {save_dir}")
    else:
        _write_json_atomic(save_dir / RUN, {"args": args})
    if (save_dir / DONE).exists():
        logger.info("%s: finished earlier, skipping training", save_dir)
        return json.loads((save_dir / DONE).read_text())
    if (save_dir / "checkpoint_last.pt").exists():
        logger.info("%s: resuming from checkpoint_last.pt", save_dir)
    logger.info("training %s", save_dir)
    start, cpu = time.time(), _children_cpu_seconds()
    device = [] if _has_cuda() else ["--cpu"]  # not in run.json: a run may resume on another device
    run_logged(fairseq_command("train", [*args, *device]), log_path=save_dir / "train.log")
    done = {"args": args, "wall_seconds": round(time.time() - start, 1),
            "cpu_seconds": round(_children_cpu_seconds() - cpu, 1), "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not (save_dir / "checkpoint_last.pt").exists():
        raise RuntimeError(f"fairseq-train finished without writing {save_dir / 'checkpoint_last.pt'}")
    _write_json_atomic(save_dir / DONE, done)
    return done


def evaluate_run(run_dir: Path, data_bin: Path, ref_dir: Optional[Path], eval_cfg: Mapping, pair: tuple) -> dict:
    """Scores ``run_dir/checkpoint_last.pt`` on every eval subset; cached in ``eval.json``."""
    from evaluate import evaluate_checkpoint

    settings = {key: eval_cfg.get(key) for key in EVAL_KEYS}
    cache = run_dir / EVAL
    # the training run it scores, by done.json's finishing time: a copy of the run directory
    # without checkpoints (results/ in git) keeps its scores
    trained = json.loads((run_dir / DONE).read_text()).get("finished")
    if cache.exists():
        cached = json.loads(cache.read_text())
        same_run = cached.get("trained") == trained if "trained" in cached else \
            cached.get("done_mtime") == (run_dir / DONE).stat().st_mtime  # caches written before "trained"
        if cached.get("settings") == settings and same_run:
            if "trained" not in cached:
                _write_json_atomic(cache, {"settings": settings, "trained": trained, "subsets": cached["subsets"]})
            return cached["subsets"]
    subsets = {}
    for subset in eval_cfg.get("subsets") or ["valid", "test"]:
        n = subset_size(data_bin, subset, *pair)
        logger.info("evaluating %s on %s (%d sentences)", run_dir, subset, n)
        subsets[subset] = evaluate_checkpoint(
            str(data_bin), str(run_dir / "checkpoint_last.pt"), reference_file(ref_dir, subset, pair[1], n),
            subset=subset, beam=eval_cfg.get("beam", 5), batch_size=eval_cfg.get("batch_size", 64),
            post_process=eval_cfg.get("post_process"), detok_lang=eval_cfg.get("detok_lang"),
            hyp_out=str(run_dir / f"{subset}.hyp"), extra_args=flags_to_args(eval_cfg.get("generate") or {}),
            keep_hypotheses=True)
        if subsets[subset]["n_sentences"] != n:  # the T- lines can miss dropped inputs too
            raise RuntimeError(f"{run_dir}: {subsets[subset]['n_sentences']} of the {n} {subset} sentences "
                               f"were translated")
    _write_json_atomic(cache, {"settings": settings, "trained": trained, "subsets": subsets})
    return subsets


def select_arms(config: dict, arms: Optional[Sequence[str]]) -> List[str]:
    """The arms to run, baseline first (added if missing)."""
    chosen = list(arms or config.get("default_arms") or config["arms"])
    unknown = [a for a in chosen if a not in config["arms"]]
    if unknown:
        raise ValueError(f"unknown arms {unknown}; {config['path']} defines {sorted(config['arms'])}")
    baseline = config["baseline"]
    return [baseline] + [a for a in dict.fromkeys(chosen) if a != baseline]


def run_ablation(config: dict, data_bin, work_dir, ref_dir=None, seeds: Sequence[int] = (1,),
                 arms: Optional[Sequence[str]] = None, pretrained=None, bootstrap_samples: int = 1000) -> dict:
    """Pretrains (if needed), trains and evaluates every arm and seed, writes the report.

    Args:
        config: from :func:`load_config`, stage ``finetune`` or ``scratch``.
        data_bin: fairseq-preprocess output directory.
        work_dir: where checkpoints, logs and the report go.
        ref_dir: directory of raw references ``{subset}.{target language}`` (None: score
            against the binarised target).
        pretrained: use this teacher-forcing checkpoint instead of training ``pretrain``.
    Returns:
        the ``results.json`` contents.
    """
    if config["stage"] == "pretrain":
        raise ValueError(f"{config['path']} is a pretrain config; pass its finetune config (which names it)")
    data_bin, work_dir = Path(data_bin), Path(work_dir)
    ref_dir = Path(ref_dir) if ref_dir is not None else None
    check_data_bin(data_bin)
    pair = language_pair(data_bin, stage_flags(config))
    eval_cfg = config.get("eval") or {}
    arms = select_arms(config, arms)
    runs: Dict[str, dict] = {}
    start_ckpt = None
    if config["stage"] == "finetune":
        if pretrained is not None:
            start_ckpt = Path(pretrained)
            if not start_ckpt.is_file():
                raise FileNotFoundError(f"pretrained checkpoint not found: {start_ckpt}")
        else:
            pre_dir = work_dir / "pretrain"
            train = train_run(data_bin, stage_flags(config["pretrain"]), pre_dir)
            runs["pretrained"] = {"0": {"train": {**train, **read_train_stats(pre_dir / "train.log")},
                                        "eval": evaluate_run(pre_dir, data_bin, ref_dir, eval_cfg, pair)}}
            start_ckpt = pre_dir / "checkpoint_last.pt"
    for seed in seeds:
        for arm in arms:
            run_dir = work_dir / f"seed{seed}" / arm
            flags = {**stage_flags(config, arm), "seed": seed}
            train = train_run(data_bin, flags, run_dir, finetune_from=start_ckpt)
            runs.setdefault(arm, {})[str(seed)] = {"train": {**train, **read_train_stats(run_dir / "train.log")},
                                                   "eval": evaluate_run(run_dir, data_bin, ref_dir, eval_cfg, pair)}
    results = summarise(config, runs, arms, list(seeds), bootstrap_samples)
    results.update({"data_bin": str(data_bin), "work_dir": str(work_dir),
                    "pretrained_checkpoint": str(start_ckpt) if start_ckpt else None})
    results["curves_png"] = plot_curves(work_dir, arms, seeds, work_dir / "curves.png")
    _write_json_atomic(work_dir / "results.json", results)
    (work_dir / "results.md").write_text(results_markdown(results), encoding="utf-8")
    logger.info("wrote %s, %s and %s", work_dir / "results.md", work_dir / "results.json", work_dir / "curves.png")
    return results


# ----------------------------------------------------------------------------- results

def _mean_sd(values: Sequence[float]) -> tuple:
    import statistics

    return round(statistics.fmean(values), 2), round(statistics.stdev(values), 2) if len(values) > 1 else 0.0


def summarise(config: dict, runs: dict, arms: Sequence[str], seeds: Sequence[int], bootstrap_samples: int) -> dict:
    """Scores per arm/seed/subset, mean and spread over seeds, and paired bootstrap of every
    arm against the baseline of the same seed (``bootstrap``) and against each of the config's
    ``compare_to`` arms (``bootstrap_vs``)."""
    from evaluate import paired_bootstrap

    baseline = config["baseline"]
    # paired bootstrap against the baseline, and against each compare_to arm that ran
    references = [baseline] + [a for a in config.get("compare_to") or [] if a in runs and a != baseline]
    scores, summary, train, signatures = {}, {}, {}, {}
    against: Dict[str, dict] = {ref: {} for ref in references}
    for arm, by_seed in runs.items():
        for seed, run in by_seed.items():
            train.setdefault(arm, {})[seed] = {k: run["train"].get(k) for k in TRAIN_STATS}
            for subset, ev in run["eval"].items():
                signatures = {"bleu": ev["bleu_signature"], "chrf": ev["chrf_signature"]}
                scores.setdefault(arm, {}).setdefault(seed, {})[subset] = {
                    k: ev[k] for k in ("bleu", "chrf", "n_sentences", "reference")}
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
    return {
        "description": " ".join(str(config.get("description", "")).split()), "config": config["path"],
        "stage": config["stage"], "baseline": baseline, "arms": list(arms), "seeds": list(seeds),
        "arm_flags": {arm: flags_to_args(config["arms"][arm]) for arm in arms},
        "common_flags": flags_to_args(stage_flags(config)), "eval": config.get("eval") or {},
        "signatures": signatures, "scores": scores, "summary": summary, "bootstrap": bootstrap,
        "bootstrap_vs": against, "train": train,
        "bootstrap_method": f"paired bootstrap resampling, {bootstrap_samples} resamples, numpy seed 12345, "
                            f"two-sided p, percentile 95% CI of the difference (scripts/evaluate.py)",
        "notes": [" ".join(str(n).split()) for n in config.get("notes") or []],
    }


def _mean_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _fmt_delta(arm_boot: Dict[str, dict], subset: str, metric: str) -> tuple:
    """(difference cell, p cell) over seeds."""
    rows = [by_subset[subset][metric] for by_subset in arm_boot.values()]
    if len(rows) == 1:
        lo, hi = rows[0]["delta_ci95"]
        return f"{rows[0]['delta']:+.2f} [{lo:+.2f}, {hi:+.2f}]", f"{rows[0]['p_value']:.3g}"
    mean, sd = _mean_sd([r["delta"] for r in rows])
    return f"{mean:+.2f} ± {sd:.2f}", ", ".join(f"{r['p_value']:.3g}" for r in rows)


def results_markdown(results: dict) -> str:
    """The ``results.md`` report: one table per evaluated subset, then settings and notes."""
    base, multi = results["baseline"], len(results["seeds"]) > 1
    lines = [f"# Ablation: {Path(results['config']).stem}", "", results["description"], "",
             f"Seeds: {', '.join(map(str, results['seeds']))}" + (" (mean ± sd over seeds; one p per seed)"
                                                                   if multi else "")
             + f". Baseline arm: `{base}`. Every arm: checkpoint_last after the same update budget.", ""]
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
            bleu = f"{s['bleu_mean']:.2f}" + (f" ± {s['bleu_sd']:.2f}" if multi and arm != "pretrained" else "")
            chrf = f"{s['chrf_mean']:.2f}" + (f" ± {s['chrf_sd']:.2f}" if multi and arm != "pretrained" else "")
            cells = ["", "", "", ""]
            if arm in results["bootstrap"]:
                cells[0:2], cells[2:4] = _fmt_delta(results["bootstrap"][arm], subset, "bleu"), \
                    _fmt_delta(results["bootstrap"][arm], subset, "chrf")
            stats = {key: _mean_or_none([t.get(key) for t in results["train"][arm].values()]) for key in TRAIN_STATS}
            grad = "" if stats["gnorm_median"] is None else f"{stats['gnorm_median']:.3g} ({stats['clipped_percent']:.0f}%)"
            name = {"pretrained": "pretrained (no fine-tuning)", base: f"{base} (baseline)"}.get(arm, arm)
            lines.append(f"| {name} | {bleu} | {chrf} | {' | '.join(cells)} | {grad} | "
                         f"{stats['wall_seconds'] or 0:.0f} ({stats['cpu_seconds'] or 0:.0f}) |")
        for ref, arms_vs in (results.get("bootstrap_vs") or {}).items():
            lines += ["", f"Against `{ref}` ({subset}):", "",
                      f"| arm | ΔBLEU vs {ref} {spread} | {p} | ΔchrF vs {ref} {spread} | {p} |", "|---|---|---|---|---|"]
            for arm in results["arms"]:
                if arm in arms_vs:
                    cells = [*_fmt_delta(arms_vs[arm], subset, "bleu"), *_fmt_delta(arms_vs[arm], subset, "chrf")]
                    lines.append(f"| {arm} | {' | '.join(cells)} |")
        reference = results["scores"][base][str(results["seeds"][0])][subset]["reference"]
        lines += ["", f"Reference: `{reference}`.", ""]
    lines += ["## Settings", "", f"- config: `{results['config']}`; data: `{results['data_bin']}`",
              f"- common fairseq-train flags: `{' '.join(results['common_flags'])}`"]
    lines += [f"- arm `{arm}`: `{' '.join(flags) or '(none)'}`" for arm, flags in results["arm_flags"].items()]
    lines += [f"- evaluation: {json.dumps(results['eval'])}",
              f"- BLEU: `{results['signatures'].get('bleu')}`", f"- chrF: `{results['signatures'].get('chrf')}`",
              f"- significance: {results['bootstrap_method']}",
              "- grad norm: median over fairseq's logging intervals of the gradient norm before clipping, with the "
              "share of updates clipped (--clip-norm); train s: wall-clock seconds of training (the machine may be "
              "shared), CPU s: CPU seconds of its processes; both means over seeds", "", "## Notes", ""]
    lines += [f"- {note}" for note in results["notes"]] or ["- (none)"]
    lines += ["", "![validation curves](curves.png)", ""]
    return "\n".join(lines)


_VALID_LINE = re.compile(r"\| valid on '([^']+)' subset \| (.*)$")


def read_valid_curve(log_path: Path, subset: str = "valid") -> List[dict]:
    """``[{"num_updates", "loss", "nll_loss"}]`` from a fairseq-train log (``--log-format simple``),
    sorted by updates; a resumed run's repeated points keep the last value."""
    points = {}
    if not Path(log_path).exists():
        return []
    for line in Path(log_path).read_text(encoding="utf-8", errors="replace").splitlines():
        match = _VALID_LINE.search(line.rstrip())
        if not match or match.group(1) != subset:
            continue
        fields = dict(part.partition(" ")[::2] for part in match.group(2).split(" | "))
        n = int(float(fields["num_updates"]))
        points[n] = {"num_updates": n, "loss": float(fields["loss"]), "nll_loss": float(fields.get("nll_loss", "nan"))}
    return [points[n] for n in sorted(points)]


_TRAIN_INNER = re.compile(r"\| train_inner \| .*\bgnorm=([^,]+), clip=([^,]+)")


def read_train_stats(log_path: Path) -> dict:
    """Median gradient norm (before clipping) and mean share of clipped updates over the
    ``train_inner`` lines of a fairseq-train log (empty values when it logged none)."""
    import statistics

    gnorms, clips = [], []
    if Path(log_path).exists():
        for line in Path(log_path).read_text(encoding="utf-8", errors="replace").splitlines():
            match = _TRAIN_INNER.search(line)
            if match:
                gnorms.append(float(match.group(1)))
                clips.append(float(match.group(2)))
    return {"gnorm_median": round(statistics.median(gnorms), 4) if gnorms else None,
            "clipped_percent": round(statistics.fmean(clips), 1) if clips else None}


def plot_curves(work_dir: Path, arms: Sequence[str], seeds: Sequence[int], png: Path) -> str:
    """Validation NLL (teacher forced: comparable across arms) and validation loss (each arm's
    own objective) per update, every arm and seed, to ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = read_valid_curve(work_dir / "pretrain" / "train.log")[-1:]
    fig, (ax_nll, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for i, arm in enumerate(arms):
        for j, seed in enumerate(seeds):
            points = read_valid_curve(work_dir / f"seed{seed}" / arm / "train.log")
            label = f"{arm} (seed {seed})" if len(seeds) > 1 else arm
            style = dict(color=f"C{i}", linestyle=("-", "--", ":", "-.")[j % 4], marker=".")
            nll = [{**start[0], "num_updates": 0}] + points if start else points
            ax_nll.plot([p["num_updates"] for p in nll], [p["nll_loss"] for p in nll], label=label, **style)
            ax_loss.plot([p["num_updates"] for p in points], [p["loss"] for p in points], label=label, **style)
    xlabel = "fine-tuning updates" if start else "updates"
    ax_nll.set(xlabel=xlabel + (" (0: pretrained)" if start else ""), ylabel="bits/token",
               title="valid NLL, teacher forced")
    ax_loss.set(xlabel=xlabel, ylabel="bits/token", title="valid loss (each arm's training objective)")
    for ax in (ax_nll, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return str(png)


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a finetune (or scratch) stage config, e.g. configs/toy_finetune.yaml")
    parser.add_argument("--data-dir", help="prepared data: DIR/bin (fairseq-preprocess) and DIR/raw (references)")
    parser.add_argument("--data-bin", help="fairseq-preprocess directory (default: DATA_DIR/bin)")
    parser.add_argument("--ref-dir", help="raw references {subset}.{tgt} (default: DATA_DIR/raw; "
                                          "none: score against the binarised target)")
    parser.add_argument("--work-dir", required=True, help="checkpoints, logs, results.{md,json}, curves.png")
    parser.add_argument("--pretrained", help="teacher-forcing checkpoint to fine-tune (default: train the "
                                             "config's pretrain stage into WORK_DIR/pretrain if missing)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="fine-tuning seeds (default: 1)")
    parser.add_argument("--arms", nargs="+", help="arms to run (default: the config's default_arms)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FLAG=VALUE",
                        help="override a config value, e.g. train.max-update=300 or pretrain.train.max-epoch=2")
    parser.add_argument("--bootstrap-samples", type=int, default=1000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    try:
        config = load_config(args.config, args.set)
        if not (args.data_dir or args.data_bin):
            raise ValueError(f"pass --data-dir or --data-bin ({args.config} expects: {config.get('data')})")
        data_bin = Path(args.data_bin or Path(args.data_dir) / "bin")
        ref_dir = args.ref_dir or (Path(args.data_dir) / "raw" if args.data_dir else None)
        results = run_ablation(config, data_bin, args.work_dir, ref_dir, args.seeds, args.arms, args.pretrained,
                               args.bootstrap_samples)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        parser.exit(1 if isinstance(error, RuntimeError) else 2, f"ablation.py: error: {error}\n")
    print(results_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
