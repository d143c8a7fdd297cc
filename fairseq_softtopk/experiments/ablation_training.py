"""One run of the beam-search training ablation (:mod:`.ablation_runner`): training it with fairseq-train (or
resuming it, or skipping it once finished) into its directory, which records its arguments (``run.json``) and
its end (``done.json``, with the checkpoint's digest) and its data (``data.json``, :mod:`.run_data`), and reading
its training log."""

import json
import logging
import os
import re
import resource
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from .ablation_config import flags_to_args
from .checkpoint_integrity import (BEST, KEY as DIGEST_KEY, LAST, check_resumable, checkpoint_digest, digest_key,
                                   verify_run_checkpoint)
from .fairseq_commands import fairseq_command, run_logged, subprocess_env
from .run_data import check_run_data
from .run_lock import run_lock

logger = logging.getLogger("ablation")

DONE, RUN = "done.json", "run.json"
#: run.json's record of the fairseq process's OMP_NUM_THREADS when the run started
THREADS_KEY = "omp_num_threads"


def write_json_atomic(path: Path, data) -> None:
    """Writes ``data`` as JSON to ``path`` through a temporary file: a reader never sees half of it."""
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
# an interval without a measured batch logs "tf_gnorm=None, beam_gnorm=None": not matched
_TERM_GNORMS = re.compile(r"\btf_gnorm=([0-9.eE+-]+), beam_gnorm=([0-9.eE+-]+)")
_UPDATES = re.compile(r"\bnum_updates=(\d+)")
_TRAIN_WALL = re.compile(r"\btrain_wall=([0-9.]+)")


def read_train_stats(log_path: Path) -> dict:
    """From the ``train_inner`` lines of a fairseq-train log: the median gradient norm (before clipping),
    the mean share of clipped updates, the medians of the two loss terms' gradient norms where the
    criterion logged them (``--log-term-gnorm-interval``), the training seconds (fairseq's ``train_wall``
    summed: validation and saving excluded) with the updates they cover, and the last update; and the
    validation BLEU per update where fairseq-train logged it (``--eval-bleu``). Empty values where it
    logged none.

    A resumed run logs again the intervals it redoes after its last save: each interval counts once,
    as last logged (fairseq restores the interval's meters from the checkpoint, so the line after a
    resume covers the whole interval)."""
    import statistics

    from .ablation_plot import read_valid_curve

    intervals: Dict[int, dict] = {}  # num_updates -> the last train_inner line logged at it
    if Path(log_path).exists():
        for line in Path(log_path).read_text(encoding="utf-8", errors="replace").splitlines():
            match = _TRAIN_INNER.search(line)
            update = _UPDATES.search(line) if match else None
            if update:
                term, wall = _TERM_GNORMS.search(line), _TRAIN_WALL.search(line)
                intervals[int(update.group(1))] = {
                    "gnorm": float(match.group(1)), "clip": float(match.group(2)),
                    "terms": (float(term.group(1)), float(term.group(2))) if term else None,
                    "train_wall": float(wall.group(1)) if wall else None}
    logged = [intervals[n] for n in sorted(intervals)]
    terms = [i["terms"] for i in logged if i["terms"]]
    walls = [i["train_wall"] for i in logged]

    def median(values):
        return round(statistics.median(values), 4) if values else None

    updates = max(intervals) if intervals else None
    curve = read_valid_curve(log_path)
    if curve:  # the last update is validated, the train_inner lines come every --log-interval updates
        updates = max(updates or 0, curve[-1]["num_updates"])
    bleu = [[p["num_updates"], p["bleu"]] for p in curve if "bleu" in p]
    timed = bool(walls) and None not in walls
    return {"gnorm_median": median([i["gnorm"] for i in logged]),
            "clipped_percent": round(statistics.fmean(i["clip"] for i in logged), 1) if logged else None,
            "tf_gnorm_median": median([t for t, _ in terms]), "beam_gnorm_median": median([b for _, b in terms]),
            "train_seconds": round(sum(walls), 1) if timed else None,
            "train_seconds_updates": max(intervals) if timed else None,
            "updates": updates, "valid_bleu": bleu or None}


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
    different arguments raises ``ValueError`` instead of mixing two settings in one directory, and so does
    one on other data (``data.json``: :mod:`.run_data`, recorded when the run starts or, for a run from
    before it, when it next trains).
    It also records the ``OMP_NUM_THREADS`` of the fairseq process (None: unset, torch's default):
    a run resumed with another thread count is named in a warning, since the count changes the
    float arithmetic (resumed with the same count, a run ends bit for bit as one never stopped).
    A ``finetune_from`` that is a finished run's ``checkpoint_last.pt`` is checked against the
    digest in that run's ``done.json`` first (:mod:`.checkpoint_integrity`).
    Returns the contents of ``done.json`` (arguments, wall and CPU seconds of this call, and the
    SHA-256 of ``checkpoint_last.pt``, and of ``checkpoint_best.pt`` where fairseq-train wrote one).

    Raises:
        RunDirectoryInUse: another live process trains in ``save_dir``.
        CheckpointChanged: ``finetune_from`` differs from the file its run finished with.
        RunStopped: a stop was requested (the run resumes on the next call).
    """
    flags = {"required-batch-size-multiple": 1, "log-format": "simple", **flags}
    args = [str(data_bin), *flags_to_args(flags), "--save-dir", str(save_dir)]
    if finetune_from is not None:
        args += ["--finetune-from-model", str(finetune_from)]
    threads = subprocess_env().get("OMP_NUM_THREADS")  # what the fairseq process will get
    save_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(save_dir) as record_child:
        if (save_dir / RUN).exists():
            record = json.loads((save_dir / RUN).read_text())
            earlier = record["args"]
            if _run_flags(earlier) != _run_flags(args):
                changed = differing_flags(earlier, args) or ["the same flags in another order"]
                raise ValueError(f"{save_dir} holds a run with other fairseq-train arguments (differing, earlier -> "
                                 f"now: {'; '.join(changed)}); use another --work-dir or remove {save_dir}")
        else:
            record = {"args": args, THREADS_KEY: threads}
            write_json_atomic(save_dir / RUN, record)
        # run.json's arguments leave the data's path out (a moved copy is the same run): its contents are checked
        check_run_data(save_dir, data_bin, flags, record=not (save_dir / DONE).exists())
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
            if (save_dir / LAST).exists() and THREADS_KEY in record and record[THREADS_KEY] != threads:
                logger.warning("%s resumes with OMP_NUM_THREADS=%s where it started with %s: the thread count changes "
                               "the float arithmetic, so from here on it is not the run an unstopped one would have "
                               "been (--jobs sets the count where OMP_NUM_THREADS is unset)", save_dir,
                               threads or "unset", record[THREADS_KEY] or "unset")
            _train(args, save_dir, verbose, record_child)
        done = {"args": args, "wall_seconds": round(time.time() - start, 1) if start else None,
                "cpu_seconds": round(_children_cpu_seconds() - cpu, 1) if alone and cpu is not None else None,
                "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
        if not (save_dir / LAST).exists():
            raise RuntimeError(f"fairseq-train finished without writing {save_dir / LAST}")
        done[DIGEST_KEY] = checkpoint_digest(save_dir / LAST)
        if (save_dir / BEST).exists():  # written where fairseq-train validated: an evaluation may score it
            done[digest_key(BEST)] = checkpoint_digest(save_dir / BEST)
        write_json_atomic(save_dir / DONE, done)
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
        from .eval_inputs import refused_checkpoint

        refused = refused_checkpoint(str(error))
        if refused:  # alone: the rest of the output is fairseq's config, not the cause
            raise RuntimeError(f"fairseq-train ({save_dir}) refused a checkpoint: {refused}") from None
        raise
