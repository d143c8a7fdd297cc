"""The beam-search training ablation runner behind ``fairseq-softtopk-ablation``
(:mod:`fairseq_softtopk.cli.ablation`, whose docstring describes a run): the data checks, the arms and seeds
to run, scheduling every stage, arm and seed (each run trained by :mod:`.ablation_training` and scored by
:mod:`.ablation_evaluation`) and writing the report (:mod:`.ablation_report`, :mod:`.ablation_plot`)."""

import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..checkpoint_safety import check_whole_checkpoint
from ..number_checks import is_integer
from .ablation_config import check_train_flags, stage_flags
from .ablation_evaluation import evaluate_pretrained, evaluate_run, translate_scored_run
from .ablation_plot import plot_curves
from .ablation_report import results_markdown, summarise
from .ablation_training import read_train_stats, train_run, write_json_atomic
from .checkpoint_integrity import LAST, checkpoint_digest
from .child_processes import RunStopped, check_not_stopping, stop_on_signals
from .fairseq_commands import PACKAGE_DIR, intra_op_threads
from .run_lock import WORK_DIR_IN_USE, run_lock
from .run_status import describe_runs

logger = logging.getLogger("ablation")


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


# ----------------------------------------------------------------------------- running

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


def check_jobs(jobs: int) -> None:
    """``ValueError`` unless ``jobs`` (runs trained at the same time) is an integer >= 1."""
    if not is_integer(jobs) or jobs < 1:
        raise ValueError(f"runs trained at the same time must be an integer >= 1, got {jobs!r}")


def check_work_dir(work_dir: Path, writable: bool = True) -> None:
    """``ValueError`` where ``work_dir`` cannot serve as a work directory (it is created when missing): it is a
    file, or under one; with ``writable``, a file cannot be created in it (or, while it is missing, in its
    nearest existing parent). That is found by trying (a probe file, removed at once): ``os.access`` says yes to
    root whatever the mode, and knows nothing of other reasons a write fails."""
    work_dir = Path(work_dir)
    existing = work_dir
    try:
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing == work_dir and not work_dir.is_dir():
            raise ValueError(f"work directory {work_dir} is a file: pass a directory (created if missing)")
        if not existing.is_dir():
            raise ValueError(f"work directory {work_dir} cannot be created: {existing} is a file, not a directory")
        if writable:
            descriptor, probe = tempfile.mkstemp(prefix=".write-probe-", dir=existing)
            os.close(descriptor)
            os.unlink(probe)
    except OSError as error:
        what = "be written: creating a file in it" if existing == work_dir else \
            f"be created: creating a file in {existing}"
        raise ValueError(f"work directory {work_dir} cannot {what} failed ({error.strerror or error}); pass a "
                         f"directory you can write") from None


def check_translate_sources(translate_sources, bpe_dir, pair: tuple) -> Dict[str, Path]:
    """``{NAME: path}`` of the sources to translate (:func:`.source_translation.source_files`; ``{}`` for None),
    checked before anything trains: the files exist, and the corpus's BPE model to segment them with."""
    if translate_sources is None:
        return {}
    from .source_segmentation import corpus_segmenter
    from .source_translation import source_files

    if bpe_dir is None:
        raise ValueError("--translate-sources segments the sources as the corpus was, with DATA_DIR/bpe: "
                         "pass --data-dir")
    sources = source_files(Path(translate_sources), pair[0])
    corpus_segmenter(Path(bpe_dir), pair[0])  # the model is there and loads
    return sources


def run_ablation(config: dict, data_bin, work_dir, ref_dir=None, seeds: Sequence[int] = (1,),
                 arms: Optional[Sequence[str]] = None, pretrained=None, bootstrap_samples: int = 1000,
                 verbose: bool = True, jobs: int = 1, command: Optional[str] = None,
                 score_pretrained: bool = False, translate_sources=None, bpe_dir=None) -> dict:
    """Pretrains (if needed), trains and evaluates every arm and seed, writes the report. A requested
    arm that cannot train here (:func:`unavailable_arms`) is skipped before anything runs, with a
    warning, and the report names it with the reason.

    ``work_dir`` is locked (``run.lock``, :mod:`.run_lock`) before anything trains or is scored: a second
    runner there is refused at once (:class:`.run_lock.RunDirectoryInUse`, naming the process).

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
        translate_sources: a directory of source files without references (``NAME.SRC`` or
            ``NAME.SRC.gz``) that every finished run's scored checkpoint also translates at its chosen
            length penalty, into ``RUN/translations/NAME.TGT`` (:mod:`.source_translation`); not scored.
        bpe_dir: the corpus's BPE model (``DATA_DIR/bpe``), with which ``translate_sources`` are segmented.
        verbose: print fairseq's logs (else one line per validation; the logs are kept in
            each run's ``train.log`` either way).
        jobs: fine-tuning runs trained (and evaluated) at the same time (>= 1), each its own
            fairseq-train process; results do not depend on it.
    Returns:
        the ``results.json`` contents.
    Raises:
        RunStopped: on SIGINT or SIGTERM; its ``lines`` say what finished and what will resume.
        RunDirectoryInUse: another live process holds ``work_dir`` (or a run directory in it).
    """
    if config["stage"] == "pretrain":
        raise ValueError(f"{config['path']} is a pretrain config; pass its finetune config (which names it)")
    data_bin, work_dir = Path(data_bin), Path(work_dir)
    ref_dir = Path(ref_dir) if ref_dir is not None else None
    check_seeds(seeds)
    check_jobs(jobs)
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
    if pretrained is not None:  # whole, before anything trains from it or scores it (torch checks no CRC)
        check_whole_checkpoint(pretrained, "Nothing was trained or scored: pass a whole copy of it as --pretrained.")
    sources = check_translate_sources(translate_sources, bpe_dir, pair)

    def train_and_score(run_dir: Path, flags: dict, finetune_from: Optional[Path], side_by_side: int) -> dict:
        """Trains one run (the cores shared among ``side_by_side`` runs) and scores it."""
        check_not_stopping()  # a run still queued when a stop came does not start
        run_dir.mkdir(parents=True, exist_ok=True)
        with run_lock(run_dir), intra_op_threads(_threads_per_run(side_by_side)):
            train = train_run(data_bin, flags, run_dir, finetune_from=finetune_from, verbose=verbose,
                              alone=side_by_side <= 1)
            scores = evaluate_run(run_dir, data_bin, ref_dir, eval_cfg, pair)
            if sources:
                translate_scored_run(run_dir, scores, eval_cfg, sources, Path(bpe_dir), data_bin, pair)
            return {"train": {**train, **read_train_stats(run_dir / "train.log")}, "eval": scores}

    per_seed, shared_pretrain = _pretraining(config, pretrained)
    start_ckpt = None if config["stage"] != "finetune" else \
        Path(pretrained) if pretrained is not None else work_dir / "pretrain" / LAST if shared_pretrain else None
    plan = run_plan(config, work_dir, seeds, arms, pretrained)
    work_dir.mkdir(parents=True, exist_ok=True)
    with stop_on_signals(), run_lock(work_dir, WORK_DIR_IN_USE):  # one runner per work directory, from the start
        try:
            scored = None
            if score_pretrained and pretrained is not None:  # beside the fine-tuning runs, on a run's threads

                def score() -> dict:
                    with intra_op_threads(_threads_per_run(jobs)):
                        return evaluate_pretrained(Path(pretrained), work_dir / "pretrained", data_bin, ref_dir,
                                                   eval_cfg, pair)

                scored = ThreadPoolExecutor(max_workers=1).submit(score)
                scored.add_done_callback(_log_failure)  # now, not when every run has trained and result() raises
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
            write_json_atomic(work_dir / "results.json", results)
            (work_dir / "results.md").write_text(results_markdown(results), encoding="utf-8")
        except RunStopped as stop:
            raise RunStopped(stop.signum, describe_runs(plan)) from None
    logger.info("wrote %s, %s and %s", work_dir / "results.md", work_dir / "results.json", work_dir / "curves.png")
    return results


def _pretraining(config: dict, pretrained) -> Tuple[bool, bool]:
    """(each seed pretrains its own model, one pretrained model is trained for every seed)."""
    per_seed = config["stage"] == "finetune" and pretrained is None and bool(config.get("pretrain_per_seed"))
    return per_seed, config["stage"] == "finetune" and pretrained is None and not per_seed


def run_plan(config: dict, work_dir, seeds: Sequence[int], arms: Sequence[str], pretrained=None) -> List[tuple]:
    """The runs of :func:`run_ablation` in schedule order: ``[(label, run directory)]``, label
    ``pretrain``, ``seedS/pretrain`` or ``seedS/ARM``."""
    work_dir = Path(work_dir)
    per_seed, shared_pretrain = _pretraining(config, pretrained)
    plan = [("pretrain", work_dir / "pretrain")] if shared_pretrain else []
    plan += [(f"seed{seed}/pretrain", work_dir / f"seed{seed}" / "pretrain") for seed in seeds if per_seed]
    return plan + [(f"seed{seed}/{arm}", work_dir / f"seed{seed}" / arm) for seed in seeds for arm in arms]


def _log_failure(future) -> None:
    """Logs the error of the pretrained checkpoint's scoring as soon as it fails (the report needs it)."""
    if not future.cancelled() and future.exception() is not None:
        error = future.exception()
        logger.error("scoring the pretrained checkpoint failed (the report will stop on it once the runs have "
                     "trained; they go on meanwhile): %s: %s", type(error).__name__, error)


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
