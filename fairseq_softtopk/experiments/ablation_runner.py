"""The beam-search training ablation runner behind ``fairseq-softtopk-ablation``
(:mod:`fairseq_softtopk.cli.ablation`, whose docstring describes a run): the data checks, training
(or resuming, or skipping) every stage, arm and seed with fairseq-train, scoring each run
(:mod:`.scoring`) and writing the report (:mod:`.ablation_report`, :mod:`.ablation_plot`)."""

import json
import logging
import os
import re
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .ablation_config import EVAL_KEYS, check_train_flags, flags_to_args, stage_flags
from .ablation_plot import plot_curves
from .ablation_report import results_markdown, summarise
from .checkpoint_integrity import KEY as DIGEST_KEY, LAST, check_resumable, checkpoint_digest, verify_run_checkpoint
from .child_processes import RunStopped, check_not_stopping, stop_on_signals
from .fairseq_commands import PACKAGE_DIR, fairseq_command, intra_op_threads, run_logged
from .run_lock import run_lock
from .run_status import describe_runs

logger = logging.getLogger("ablation")

DONE, RUN, EVAL = "done.json", "run.json", "eval.json"


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
                                f"data_prep/prepare_*.sh scripts or fairseq-softtopk-main-job)")
    if not list(data_bin.glob("dict.*.txt")) or not list(data_bin.glob("train.*.idx")):
        raise FileNotFoundError(f"{data_bin} holds no fairseq-preprocess output (dict.*.txt, train.*.idx)")


def subset_size(data_bin: Path, subset: str, src: str, tgt: str) -> int:
    """Sentences of the binarised ``subset`` (:func:`.scoring.binarised_subset_size`), which must exist."""
    from .scoring import binarised_subset_size

    size = binarised_subset_size(str(data_bin), subset, src, tgt)
    if size is None:
        raise FileNotFoundError(f"{data_bin} has no binarised '{subset}' subset "
                                f"({Path(data_bin) / f'{subset}.{src}-{tgt}.{tgt}'}.idx)")
    return size


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


def _cores() -> int:
    """CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _threads_per_run(jobs: int) -> int:
    """Intra-op threads of each fairseq process when ``jobs`` run side by side: the cores shared
    among them (a user's ``OMP_NUM_THREADS`` wins). Fixed for the whole schedule, so that a
    run's float arithmetic does not depend on which runs happened to overlap it."""
    return int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, _cores() // max(1, jobs))


def source_commit() -> Optional[str]:
    """The git commit of the checkout this package was imported from (``+dirty`` with uncommitted
    changes to tracked files), or None outside a git checkout."""
    import subprocess

    root = PACKAGE_DIR.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_flags(args: Sequence[str]) -> List[str]:
    """fairseq-train arguments without the paths (data, save dir, pretrained checkpoint), so that a
    run directory moved or copied elsewhere (results/ in git) is recognised as the same run; a
    renamed option's old name (:mod:`fairseq_softtopk.renamed_options`) is read as its new one, so
    that a run started before the rename is the same run."""
    from fairseq_softtopk.renamed_options import RENAMED_OPTIONS, flag

    renamed = {flag(old): flag(new) for old, new in RENAMED_OPTIONS.items()}
    paths = {"--save-dir", "--finetune-from-model"}
    return [renamed.get(arg, arg) for i, arg in enumerate(args[1:], 1) if args[i - 1] not in paths]


def _flag_values(args: Sequence[str]) -> Dict[str, str]:
    """``--flag value...`` arguments as ``{"--flag": "value ..."}`` (``"(set)"`` for a flag without values)."""
    values: Dict[str, List[str]] = {}
    flag = None
    for arg in args:
        if arg.startswith("--"):
            flag = arg
            values[flag] = []
        elif flag is not None:
            values[flag].append(arg)
    return {name: " ".join(vals) if vals else "(set)" for name, vals in values.items()}


def differing_flags(earlier: Sequence[str], now: Sequence[str]) -> List[str]:
    """``"--flag: old -> new"`` for every fairseq-train flag whose value differs (``(not set)`` where absent)."""
    old, new = _flag_values(_run_flags(earlier)), _flag_values(_run_flags(now))
    return [f"{name}: {old.get(name, '(not set)')} -> {new.get(name, '(not set)')}"
            for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]


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



def _fairseq_finished(log_path: Path) -> bool:
    """Whether the last fairseq-train of ``log_path`` ended normally (its last line: ``done training``)."""
    if not log_path.is_file():
        return False
    lines = [line for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return bool(lines) and "| done training in " in lines[-1]


def train_run(data_bin: Path, flags: Mapping[str, object], save_dir: Path,
              finetune_from: Optional[Path] = None, verbose: bool = True, alone: bool = True) -> dict:
    """Trains (or resumes, or skips when ``done.json`` exists) one run into ``save_dir``.

    fairseq's output goes to ``save_dir/train.log`` (appended: a resumed run keeps every part);
    ``verbose`` also prints it, otherwise one line per validation is printed. ``alone``: no other
    run trains meanwhile, so this process's children's CPU time is this run's (else
    ``cpu_seconds`` is None). The run holds ``save_dir/run.lock`` (:mod:`.run_lock`) meanwhile.

    ``run.json`` records the fairseq-train arguments when the run starts; a later call with
    different arguments raises ``ValueError`` instead of mixing two settings in one directory.
    A ``finetune_from`` that is a finished run's ``checkpoint_last.pt`` is checked against the
    digest in that run's ``done.json`` first (:mod:`.checkpoint_integrity`).
    Returns the contents of ``done.json`` (arguments, wall and CPU seconds of this call, and the
    SHA-256 of ``checkpoint_last.pt``).

    Raises:
        RunDirectoryInUse: another live process trains in ``save_dir``.
        CheckpointChanged: ``finetune_from`` differs from the file its run finished with.
        RunStopped: a stop was requested (the run resumes on the next call).
    """
    flags = {"required-batch-size-multiple": 1, "log-format": "simple", **flags}
    args = [str(data_bin), *flags_to_args(flags), "--save-dir", str(save_dir)]
    if finetune_from is not None:
        args += ["--finetune-from-model", str(finetune_from)]
    save_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(save_dir) as record_child:
        if (save_dir / RUN).exists():
            earlier = json.loads((save_dir / RUN).read_text())["args"]
            if _run_flags(earlier) != _run_flags(args):
                changed = differing_flags(earlier, args) or ["the same flags in another order"]
                raise ValueError(f"{save_dir} holds a run with other fairseq-train arguments (differing, earlier -> "
                                 f"now: {'; '.join(changed)}); use another --work-dir or remove {save_dir}")
        else:
            _write_json_atomic(save_dir / RUN, {"args": args})
        if (save_dir / DONE).exists():
            logger.info("%s: finished earlier, skipping training", save_dir)
            return json.loads((save_dir / DONE).read_text())
        if finetune_from is not None and finetune_from.name == LAST and (finetune_from.parent / DONE).exists():
            verify_run_checkpoint(finetune_from.parent)
        start, cpu = time.time(), _children_cpu_seconds()
        if (save_dir / LAST).exists() and _fairseq_finished(save_dir / "train.log"):
            # stopped after fairseq-train ended but before done.json: resuming would train one update too many
            logger.info("%s: fairseq-train had finished; recording it", save_dir)
            start = cpu = None
        else:
            _train(args, save_dir, verbose, record_child)
        done = {"args": args, "wall_seconds": round(time.time() - start, 1) if start else None,
                "cpu_seconds": round(_children_cpu_seconds() - cpu, 1) if alone and cpu is not None else None,
                "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
        if not (save_dir / LAST).exists():
            raise RuntimeError(f"fairseq-train finished without writing {save_dir / LAST}")
        done[DIGEST_KEY] = checkpoint_digest(save_dir / LAST)
        _write_json_atomic(save_dir / DONE, done)
        return done


def _train(args: Sequence[str], save_dir: Path, verbose: bool, record_child) -> None:
    """Runs fairseq-train ``args`` (resuming from ``save_dir/checkpoint_last.pt`` if there)."""
    if (save_dir / LAST).exists():
        check_resumable(save_dir)
        logger.info("%s: resuming from checkpoint_last.pt", save_dir)
    logger.info("training %s", save_dir)
    device = [] if _has_cuda() else ["--cpu"]  # not in run.json: a run may resume on another device
    try:
        run_logged(fairseq_command("train", [*args, *device]), log_path=save_dir / "train.log", echo=verbose,
                   progress=f"{save_dir.parent.name}/{save_dir.name}", on_start=record_child)
    except RuntimeError as error:
        from .scoring import refused_checkpoint

        refused = refused_checkpoint(str(error))
        if refused:  # alone: the rest of the output is fairseq's config, not the cause
            raise RuntimeError(f"fairseq-train ({save_dir}) refused a checkpoint: {refused}") from None
        raise


def evaluate_run(run_dir: Path, data_bin: Path, ref_dir: Optional[Path], eval_cfg: Mapping, pair: tuple) -> dict:
    """Scores ``run_dir/checkpoint_last.pt`` on every eval subset; cached in ``eval.json`` (a cached
    score needs no checkpoint). Before scoring, the checkpoint is checked against the digest in
    ``done.json`` (``CheckpointChanged`` where it differs; :mod:`.checkpoint_integrity`)."""
    from .scoring import evaluate_checkpoint

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
    verify_run_checkpoint(run_dir)  # the file scored is the one its run finished with
    subsets = {}
    for subset in eval_cfg.get("subsets") or ["valid", "test"]:
        n = subset_size(data_bin, subset, *pair)
        logger.info("evaluating %s on %s (%d sentences)", run_dir, subset, n)
        subsets[subset] = evaluate_checkpoint(
            str(data_bin), str(run_dir / "checkpoint_last.pt"), reference_file(ref_dir, subset, pair[1], n),
            subset=subset, beam=eval_cfg.get("beam", 5), batch_size=eval_cfg.get("batch_size"),
            post_process=eval_cfg.get("post_process"), detok_lang=eval_cfg.get("detok_lang"),
            hyp_out=str(run_dir / f"{subset}.hyp"), extra_args=flags_to_args(eval_cfg.get("generate") or {}),
            keep_hypotheses=True)
        if subsets[subset]["n_sentences"] != n:  # the T- lines can miss dropped inputs too
            raise RuntimeError(f"{run_dir}: {subsets[subset]['n_sentences']} of the {n} {subset} sentences "
                               f"were translated")
    _write_json_atomic(cache, {"settings": settings, "trained": trained, "subsets": subsets})
    return subsets


def evaluate_pretrained(checkpoint: Path, out_dir: Path, data_bin: Path, ref_dir: Optional[Path], eval_cfg: Mapping,
                        pair: tuple) -> dict:
    """Scores a given teacher-forcing checkpoint (``pretrained=``) as :func:`evaluate_run` scores a
    run: the scores are cached in ``out_dir/eval.json`` under the checkpoint's SHA-256 (a changed
    file is scored again). Returns ``{subset: scores}``."""
    from .scoring import evaluate_checkpoint

    settings = {key: eval_cfg.get(key) for key in EVAL_KEYS}
    digest = checkpoint_digest(checkpoint)
    cache = out_dir / EVAL
    if cache.exists():
        cached = json.loads(cache.read_text())
        if cached.get("settings") == settings and cached.get("sha256") == digest:
            return cached["subsets"]
    out_dir.mkdir(parents=True, exist_ok=True)
    subsets = {}
    for subset in eval_cfg.get("subsets") or ["valid", "test"]:
        n = subset_size(data_bin, subset, *pair)
        logger.info("evaluating %s on %s (%d sentences)", checkpoint, subset, n)
        subsets[subset] = evaluate_checkpoint(
            str(data_bin), str(checkpoint), reference_file(ref_dir, subset, pair[1], n), subset=subset,
            beam=eval_cfg.get("beam", 5), batch_size=eval_cfg.get("batch_size"),
            post_process=eval_cfg.get("post_process"), detok_lang=eval_cfg.get("detok_lang"),
            hyp_out=str(out_dir / f"{subset}.hyp"), extra_args=flags_to_args(eval_cfg.get("generate") or {}),
            keep_hypotheses=True)
    _write_json_atomic(cache, {"settings": settings, "sha256": digest, "subsets": subsets})
    return subsets


def unavailable_arms(config: dict, arms: Sequence[str]) -> Dict[str, str]:
    """The arms of ``arms`` that cannot train here, each with the reason: those of ``--criterion
    beamgrad_risk`` where the optional package beamgrad does not import."""
    needing = [arm for arm in arms if stage_flags(config, arm).get("criterion") == "beamgrad_risk"]
    if not needing:
        return {}
    from fairseq_softtopk.criterions.beamgrad_risk import import_beamgrad

    try:
        import_beamgrad()
    except ImportError as error:
        return dict.fromkeys(needing, f"{error}; import beamgrad: {error.__cause__}")
    return {}


def select_arms(config: dict, arms: Optional[Sequence[str]]) -> Tuple[List[str], Dict[str, str]]:
    """The arms to run, baseline first (added if missing), and the requested arms left out because
    they cannot train here (:func:`unavailable_arms`: arm -> reason); ``ValueError`` where that
    leaves none of the requested arms, or not the baseline."""
    chosen = list(arms or config.get("default_arms") or config["arms"])
    unknown = [a for a in chosen if a not in config["arms"]]
    if unknown:
        raise ValueError(f"unknown arms {unknown}; {config['path']} defines {sorted(config['arms'])}")
    baseline = config["baseline"]
    skipped = unavailable_arms(config, list(dict.fromkeys([baseline, *chosen])))
    if baseline in skipped:
        raise ValueError(f"the baseline arm {baseline!r} cannot run here: {skipped[baseline]}")
    if all(arm in skipped for arm in chosen):  # the baseline alone was not asked for
        raise ValueError("none of the requested arms can run here: " +
                         "; ".join(f"arm {arm!r}: {why}" for arm, why in skipped.items()))
    return [baseline] + [a for a in dict.fromkeys(chosen) if a not in (baseline, *skipped)], skipped


def check_seeds(seeds: Sequence[int]) -> None:
    """``ValueError`` naming the seeds given more than once (each seed is one run per arm)."""
    twice = sorted({seed for seed in seeds if list(seeds).count(seed) > 1})
    if twice:
        raise ValueError(f"seeds {twice} are given more than once ({' '.join(map(str, seeds))}): "
                         f"list each seed once")


def check_work_dir(work_dir: Path) -> None:
    """``ValueError`` where ``work_dir`` exists and is not a directory (it is created when missing)."""
    if work_dir.exists() and not work_dir.is_dir():
        raise ValueError(f"work directory {work_dir} is a file: pass a directory (created if missing)")


def run_ablation(config: dict, data_bin, work_dir, ref_dir=None, seeds: Sequence[int] = (1,),
                 arms: Optional[Sequence[str]] = None, pretrained=None, bootstrap_samples: int = 1000,
                 verbose: bool = True, jobs: int = 1, command: Optional[str] = None,
                 score_pretrained: bool = False) -> dict:
    """Pretrains (if needed), trains and evaluates every arm and seed, writes the report. A requested
    arm that cannot train here (:func:`unavailable_arms`) is skipped before anything runs, with a
    warning, and the report names it with the reason.

    Called from the main thread, SIGINT and SIGTERM stop it (:mod:`.child_processes`): every
    fairseq process ends, no run starts after the signal, finished runs are kept and unfinished
    ones resume on the next call.

    Args:
        config: from :func:`.ablation_config.load_config`, stage ``finetune`` or ``scratch``.
        data_bin: fairseq-preprocess output directory.
        work_dir: where checkpoints, logs and the report go.
        ref_dir: directory of raw references ``{subset}.{target language}`` (None: score
            against the binarised target).
        seeds: distinct seeds.
        pretrained: use this teacher-forcing checkpoint instead of training ``pretrain``.
        score_pretrained: also score ``pretrained`` (the report's "pretrained" row; scores cached in
            ``work_dir/pretrained``).
        verbose: print fairseq's logs (else one line per validation; the logs are kept in
            each run's ``train.log`` either way).
        jobs: fine-tuning runs trained (and evaluated) at the same time, each its own
            fairseq-train process; results do not depend on it.
    Returns:
        the ``results.json`` contents.
    Raises:
        RunStopped: on SIGINT or SIGTERM; its ``lines`` say what finished and what will resume.
    """
    if config["stage"] == "pretrain":
        raise ValueError(f"{config['path']} is a pretrain config; pass its finetune config (which names it)")
    data_bin, work_dir = Path(data_bin), Path(work_dir)
    ref_dir = Path(ref_dir) if ref_dir is not None else None
    check_seeds(seeds)
    check_work_dir(work_dir)
    check_data_bin(data_bin)
    check_train_flags(config)  # every stage and arm, before the first one trains
    pair = language_pair(data_bin, stage_flags(config))
    eval_cfg = config.get("eval") or {}
    arms, skipped = select_arms(config, arms)
    for why in dict.fromkeys(skipped.values()):
        logger.warning("skipping arm(s) %s: %s", ", ".join(a for a, w in skipped.items() if w == why), why)
    if pretrained is not None and not Path(pretrained).is_file():
        raise FileNotFoundError(f"pretrained checkpoint not found: {pretrained}")

    def train_and_score(run_dir: Path, flags: dict, finetune_from: Optional[Path], side_by_side: int) -> dict:
        """Trains one run (the cores shared among ``side_by_side`` runs) and scores it."""
        check_not_stopping()  # a run still queued when a stop came does not start
        run_dir.mkdir(parents=True, exist_ok=True)
        with run_lock(run_dir), intra_op_threads(_threads_per_run(side_by_side)):
            train = train_run(data_bin, flags, run_dir, finetune_from=finetune_from, verbose=verbose,
                              alone=side_by_side <= 1)
            return {"train": {**train, **read_train_stats(run_dir / "train.log")},
                    "eval": evaluate_run(run_dir, data_bin, ref_dir, eval_cfg, pair)}

    per_seed = config["stage"] == "finetune" and pretrained is None and bool(config.get("pretrain_per_seed"))
    shared_pretrain = config["stage"] == "finetune" and pretrained is None and not per_seed
    start_ckpt = None if config["stage"] != "finetune" else \
        Path(pretrained) if pretrained is not None else work_dir / "pretrain" / LAST if shared_pretrain else None
    plan = [("pretrain", work_dir / "pretrain")] if shared_pretrain else []
    plan += [(f"seed{seed}/pretrain", work_dir / f"seed{seed}" / "pretrain") for seed in seeds if per_seed]
    plan += [(f"seed{seed}/{arm}", work_dir / f"seed{seed}" / arm) for seed in seeds for arm in arms]
    with stop_on_signals():
        try:
            scored = None
            if score_pretrained and pretrained is not None:  # beside the fine-tuning runs, on a run's threads

                def score() -> dict:
                    with intra_op_threads(_threads_per_run(jobs)):
                        return evaluate_pretrained(Path(pretrained), work_dir / "pretrained", data_bin, ref_dir,
                                                   eval_cfg, pair)

                scored = ThreadPoolExecutor(max_workers=1).submit(score)
            runs = _schedule(config, work_dir, seeds, arms, jobs, per_seed, shared_pretrain, start_ckpt,
                             train_and_score)
            if scored is not None:
                runs = {"pretrained": {"0": {"train": {}, "eval": scored.result()}}, **runs}
            results = summarise(config, runs, arms, list(seeds), bootstrap_samples, skipped)
            results.update({"command": command, "commit": source_commit(),
                            "data_bin": str(data_bin), "work_dir": str(work_dir), "pretrain_per_seed": per_seed,
                            "pretrained_checkpoint": str(start_ckpt) if start_ckpt else None,
                            "pretrained_sha256": checkpoint_digest(Path(pretrained)) if pretrained else None})
            results["curves_png"] = plot_curves(work_dir, arms, seeds, work_dir / "curves.png")
            _write_json_atomic(work_dir / "results.json", results)
            (work_dir / "results.md").write_text(results_markdown(results), encoding="utf-8")
        except RunStopped as stop:
            raise RunStopped(stop.signum, describe_runs(plan)) from None
    logger.info("wrote %s, %s and %s", work_dir / "results.md", work_dir / "results.json", work_dir / "curves.png")
    return results


def _schedule(config: dict, work_dir: Path, seeds: Sequence[int], arms: Sequence[str], jobs: int, per_seed: bool,
              shared_pretrain: bool, start_ckpt: Optional[Path], train_and_score) -> Dict[str, dict]:
    """Trains and scores every run of :func:`run_ablation` in a thread pool; returns ``{arm or
    "pretrained": {seed: result}}``. Every fairseq process runs from a worker thread, so that a
    signal (raised in the main thread) never interrupts a run between its training and its
    ``done.json``; on a stop, queued runs are cancelled."""
    runs: Dict[str, dict] = {}
    order = [(seed, arm) for seed in seeds for arm in arms]

    def pretrain(seed: int) -> dict:
        return train_and_score(work_dir / f"seed{seed}" / "pretrain",
                               {**stage_flags(config["pretrain"]), "seed": seed}, None, jobs)

    def train_and_evaluate(seed: int, arm: str) -> dict:
        if per_seed:
            pretrained_runs[seed].result()  # submitted earlier, so running or done: no deadlock
        start = work_dir / f"seed{seed}" / "pretrain" / LAST if per_seed else start_ckpt
        return train_and_score(work_dir / f"seed{seed}" / arm, {**stage_flags(config, arm), "seed": seed}, start, jobs)

    # threads suffice: each run is a fairseq subprocess. Per-seed pretraining runs go first; a
    # fine-tuning run waits for its own pretraining only.
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        if shared_pretrain:
            shared = pool.submit(train_and_score, work_dir / "pretrain", stage_flags(config["pretrain"]), None, 1)
            runs["pretrained"] = {"0": shared.result()}
        pretrained_runs = {seed: pool.submit(pretrain, seed) for seed in seeds} if per_seed else {}
        finetuned = [pool.submit(train_and_evaluate, *run) for run in order]
        if per_seed:
            runs["pretrained"] = {str(seed): future.result() for seed, future in pretrained_runs.items()}
        for (seed, arm), future in zip(order, finetuned):
            runs.setdefault(arm, {})[str(seed)] = future.result()
    except RunStopped:
        pool.shutdown(wait=True, cancel_futures=True)  # the running ones end with their fairseq processes
        raise
    finally:
        pool.shutdown(wait=True)
    return runs
