"""The finished runs of an ablation's work directory kept without their checkpoints, so that the schedule can
go on elsewhere: on a machine whose scratch disk is wiped between jobs, or on another machine.

A finished run needs no checkpoint any more: its scores are cached in ``eval.json`` (with the hypotheses the
paired tests resample), its training in ``train.log`` and ``done.json``, and the runner skips a run with
``done.json`` and ``eval.json`` (:mod:`.ablation_evaluation`). :func:`save_records` copies those files of every
finished run (and the scores of ``--score-pretrained``) to a records directory, gzipped, with the machine's
absolute paths cut from the arguments and the log (:func:`.publish.strip_absolute_paths`; the runner ignores
paths when it compares a run's arguments); :func:`restore_records` writes them back into a work directory, where
the runner then trains only the runs that are missing and writes the report over all of them.

    python -m fairseq_softtopk.experiments.run_records save WORK_DIR RECORDS_DIR
    python -m fairseq_softtopk.experiments.run_records restore RECORDS_DIR WORK_DIR

Neither overwrites: a record or run that exists with other contents is an error naming it; one with the same
contents is left as it is, so both can be repeated (save after each session, restore before the next).
"""

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from .ablation_evaluation import EVAL
from .ablation_training import DONE, RUN
from .publish import strip_absolute_paths

LOG = "train.log"
#: the files a finished run is kept by; the scores are kept byte for byte (their hypotheses are the data)
RECORDED = (RUN, DONE, EVAL, LOG)
STRIPPED = (RUN, DONE, LOG)


class RecordConflict(FileExistsError):
    """A record, or a run directory, exists with contents other than those it would be given."""


def _finished_runs(work_dir: Path) -> List[Path]:
    """Run directories under ``work_dir`` that have finished: ``done.json`` and ``eval.json``; and the scored
    pretrained checkpoint's directory (``eval.json`` with the checkpoint's digest, no ``done.json``)."""
    found = []
    for scores in sorted(work_dir.rglob(EVAL)):
        run_dir = scores.parent
        if (run_dir / DONE).is_file() or "sha256" in json.loads(scores.read_text(encoding="utf-8")):
            found.append(run_dir)
    return found


def _record_texts(run_dir: Path) -> Dict[str, str]:
    """``{file name: text as recorded}`` of the :data:`RECORDED` files ``run_dir`` has."""
    texts = {}
    for name in RECORDED:
        if (run_dir / name).is_file():
            text = (run_dir / name).read_text(encoding="utf-8", errors="replace")
            texts[name] = strip_absolute_paths(text) if name in STRIPPED else text
    return texts


def _read_record(record_dir: Path) -> Dict[str, str]:
    """``{file name: text}`` of a run's record (its ``NAME.gz`` files)."""
    return {path.name[:-3]: gzip.decompress(path.read_bytes()).decode("utf-8")
            for path in sorted(record_dir.glob("*.gz")) if path.name[:-3] in RECORDED}


def save_records(work_dir, records_dir) -> Tuple[List[str], List[str]]:
    """Copies every finished run of ``work_dir`` (:func:`_finished_runs`) to ``records_dir`` (same relative
    path, each file gzipped). Returns ``(saved, already there)``: run paths relative to ``work_dir``.

    Raises:
        FileNotFoundError: ``work_dir`` is not a directory.
        RecordConflict: a run's record exists with other contents (nothing of that run is written).
    """
    work_dir, records_dir = Path(work_dir), Path(records_dir)
    if not work_dir.is_dir():
        raise FileNotFoundError(f"work directory not found: {work_dir}")
    saved, present = [], []
    for run_dir in _finished_runs(work_dir):
        rel = run_dir.relative_to(work_dir)
        texts, record_dir = _record_texts(run_dir), records_dir / rel
        if record_dir.exists():
            recorded = _read_record(record_dir)
            if recorded != texts:
                differing = sorted(name for name in set(texts) | set(recorded) if texts.get(name) != recorded.get(name))
                raise RecordConflict(f"{record_dir} records another run than {run_dir} (differing: "
                                     f"{', '.join(differing)}); remove the record to save this run there")
            present.append(str(rel))
            continue
        # written aside, then renamed: a save cut short leaves no half record
        tmp = record_dir.with_name(f".{record_dir.name}.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for name, text in texts.items():
            # mtime 0: saving the same run again writes the same bytes
            (tmp / f"{name}.gz").write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
        tmp.rename(record_dir)
        saved.append(str(rel))
    return saved, present


def restore_records(records_dir, work_dir) -> Tuple[List[str], List[str]]:
    """Writes every run recorded in ``records_dir`` into ``work_dir`` (created if missing). Returns
    ``(restored, already there)``: run paths relative to ``work_dir``.

    Raises:
        FileNotFoundError: ``records_dir`` holds no records.
        RecordConflict: the run's directory exists in ``work_dir`` with other contents (a finished run with
            other files, or a run that is training or stopped there: finish or remove it first).
    """
    records_dir, work_dir = Path(records_dir), Path(work_dir)
    records = sorted({path.parent for path in records_dir.rglob(f"{EVAL}.gz")  # not a save cut short
                      if not any(part.startswith(".") for part in path.relative_to(records_dir).parts)})
    if not records:
        raise FileNotFoundError(f"{records_dir} holds no run records ({EVAL}.gz files)")
    plan = []
    for record_dir in records:
        rel = record_dir.relative_to(records_dir)
        texts, run_dir = _read_record(record_dir), work_dir / rel
        if run_dir.exists() and any(run_dir.iterdir()):
            here = _record_texts(run_dir)
            if here != texts:
                differing = sorted(name for name in set(texts) | set(here) if texts.get(name) != here.get(name))
                raise RecordConflict(f"{run_dir} exists and differs from its record in {record_dir} (differing: "
                                     f"{', '.join(differing)}); remove {run_dir} to restore the finished run")
        plan.append((rel, run_dir, texts))
    restored, present = [], []
    for rel, run_dir, texts in plan:  # every conflict found before anything is written
        if run_dir.exists() and any(run_dir.iterdir()):
            present.append(str(rel))
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        # eval.json last: a run directory is finished only once its scores are there
        for name in sorted(texts, key=lambda name: name == EVAL):
            tmp = run_dir / f".{name}.tmp"
            tmp.write_text(texts[name], encoding="utf-8")
            tmp.replace(run_dir / name)
        restored.append(str(rel))
    return restored, present


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    save = sub.add_parser("save", help="copy the finished runs of WORK_DIR to RECORDS_DIR")
    save.add_argument("work_dir")
    save.add_argument("records_dir")
    restore = sub.add_parser("restore", help="write the runs of RECORDS_DIR into WORK_DIR")
    restore.add_argument("records_dir")
    restore.add_argument("work_dir")
    args = parser.parse_args(argv)
    try:
        if args.action == "save":
            done, present = save_records(args.work_dir, args.records_dir)
            verb = "saved"
        else:
            done, present = restore_records(args.records_dir, args.work_dir)
            verb = "restored"
    except (FileNotFoundError, RecordConflict) as error:
        parser.exit(2, f"run_records: error: {error}\n")
    print(f"{verb} {len(done)} run(s){': ' + ', '.join(done) if done else ''}; "
          f"{len(present)} already there{': ' + ', '.join(present) if present else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
