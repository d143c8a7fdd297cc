"""The finished runs of an ablation's work directory kept without their checkpoints, so that the schedule can
go on elsewhere: on a machine whose scratch disk is wiped between jobs, or on another machine.

A finished run needs no checkpoint any more: its scores are cached in ``eval.json`` (with the hypotheses the
paired tests resample), its training in ``train.log`` and ``done.json``, and the runner skips a run with
``done.json`` and ``eval.json`` (:mod:`.ablation_evaluation`). :func:`save_records` copies those files of every
finished run (and the scores of ``--score-pretrained``) to a records directory, gzipped, with the machine's
absolute paths cut (:func:`.publish.strip_absolute_paths`; the runner ignores paths when it compares a run's
arguments; the scores name their checkpoint and reference file by name). The references are not kept (they
are the corpus, which a record must not redistribute): each subset's scores keep their SHA-256 instead, and
:func:`restore_records` reads them again from the prepared data (the raw reference file, or the binarised target
as fairseq-generate prints it: :func:`.scoring.binarised_references`), checks the digest and writes the runs back
into a work directory, where the runner then trains only the runs that are missing and writes the report over all
of them.

    python -m fairseq_softtopk.experiments.run_records save WORK_DIR RECORDS_DIR
    python -m fairseq_softtopk.experiments.run_records restore RECORDS_DIR WORK_DIR --data-dir DATA_DIR

Neither overwrites: a record or run that exists with other contents is an error naming it; one with the same
contents is left as it is, so both can be repeated (save after each session, restore before the next).
"""

import argparse
import gzip
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .ablation_evaluation import EVAL
from .ablation_training import DONE, RUN
from .publish import strip_absolute_paths
from .source_translation import TRANSLATIONS, TRANSLATIONS_JSON

LOG = "train.log"
#: the files a finished run is kept by (with its ``translations/`` where it has them: :func:`_record_texts`)
RECORDED = (RUN, DONE, EVAL, LOG, TRANSLATIONS_JSON)
#: what a subset's scores say instead of a reference file where they were scored against the binarised target
BINARISED_TARGET = "fairseq-generate T- lines (binarised target)"


class RecordConflict(FileExistsError):
    """A record, or a run directory, exists with contents other than those it would be given."""


def references_digest(references: Sequence[str]) -> str:
    """SHA-256 of a subset's references, one per line."""
    return hashlib.sha256("\n".join(references).encode("utf-8")).hexdigest()


def _scores_as_recorded(text: str) -> str:
    """``eval.json`` as a record keeps it: each subset's ``references`` replaced by ``references_sha256`` (in its
    place), ``checkpoint`` and ``reference`` by the file's name (a restored run names the file it was restored
    from: saved again, it is the same record); the hypotheses byte for byte."""
    scores = json.loads(text)
    for name, entry in scores.get("subsets", {}).items():
        kept = {}
        for key, value in entry.items():
            if key == "references":
                kept["references_sha256"] = references_digest(value)
            elif key in ("checkpoint", "reference") and isinstance(value, str) and value != BINARISED_TARGET:
                kept[key] = Path(value).name
            else:
                kept[key] = value
        scores["subsets"][name] = kept
    return json.dumps(scores, indent=2)


def _scores_restored(text: str, references: Callable[[str, dict, dict], Tuple[List[str], str]], where: Path) -> str:
    """A recorded ``eval.json`` with each subset's references back in place of their digest (from
    ``references(subset, settings, subset's scores)``: the lines and where they were read), which they must
    match; ``reference`` names the file read."""
    scores = json.loads(text)
    for name, entry in scores.get("subsets", {}).items():
        if "references_sha256" not in entry:
            continue
        found, source = references(name, scores.get("settings") or {}, entry)
        if references_digest(found) != entry["references_sha256"]:
            raise ValueError(f"{where}: the {name} references read from the data ({len(found)} lines, sha256 "
                             f"{references_digest(found)}) are not those the run was scored against (sha256 "
                             f"{entry['references_sha256']}): another corpus or preparation")
        scores["subsets"][name] = {("references" if key == "references_sha256" else key):
                                   found if key == "references_sha256" else source if key == "reference" else value
                                   for key, value in entry.items()}
    return json.dumps(scores, indent=2)


def _finished_runs(work_dir: Path) -> List[Path]:
    """Run directories under ``work_dir`` that have finished: ``done.json`` and ``eval.json``, and no live process
    holding the run (a runner still translating ``--translate-sources`` after the scores: saved once it is done);
    and the scored pretrained checkpoint's directory (``eval.json`` with the checkpoint's digest, no ``done.json``)."""
    from .run_lock import lock_owner

    found = []
    for scores in sorted(work_dir.rglob(EVAL)):
        run_dir = scores.parent
        if (run_dir / DONE).is_file() or "sha256" in json.loads(scores.read_text(encoding="utf-8")):
            if lock_owner(run_dir) is None:
                found.append(run_dir)
    return found


def _recorded(name: str) -> bool:
    """Whether a run's file (its path relative to the run directory) belongs to its record: the
    :data:`RECORDED` files and the translations of ``--translate-sources`` that ``translations.json`` lists."""
    return name in RECORDED or (name.startswith(f"{TRANSLATIONS}/") and name.count("/") == 1)


def _record_texts(run_dir: Path) -> Dict[str, str]:
    """``{file name: text as recorded}`` of the :data:`RECORDED` files ``run_dir`` has, and of the translations
    its ``translations.json`` lists (``translations/NAME.TGT``: hypotheses, kept byte for byte)."""
    texts = {}
    for name in RECORDED:
        if (run_dir / name).is_file():
            text = (run_dir / name).read_text(encoding="utf-8", errors="replace")
            texts[name] = _scores_as_recorded(text) if name == EVAL else strip_absolute_paths(text)
    for entry in json.loads(texts.get(TRANSLATIONS_JSON, "{}")).values():
        if _recorded(entry["translation"]) and (run_dir / entry["translation"]).is_file():
            texts[entry["translation"]] = (run_dir / entry["translation"]).read_text(encoding="utf-8")
    return texts


def _read_record(record_dir: Path) -> Dict[str, str]:
    """``{file name: text}`` of a run's record (its ``NAME.gz`` files, ``translations/`` included)."""
    return {path.relative_to(record_dir).as_posix()[:-3]: gzip.decompress(path.read_bytes()).decode("utf-8")
            for path in sorted(record_dir.rglob("*.gz")) if _recorded(path.relative_to(record_dir).as_posix()[:-3])}


def _differing(one: Dict[str, str], other: Dict[str, str]) -> str:
    return ", ".join(sorted(name for name in set(one) | set(other) if one.get(name) != other.get(name)))


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
                raise RecordConflict(f"{record_dir} records another run than {run_dir} (differing: "
                                     f"{_differing(texts, recorded)}); remove the record to save this run there")
            present.append(str(rel))
            continue
        # written aside, then renamed: a save cut short leaves no half record
        tmp = record_dir.with_name(f".{record_dir.name}.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for name, text in texts.items():
            # mtime 0: saving the same run again writes the same bytes
            (tmp / f"{name}.gz").parent.mkdir(exist_ok=True)
            (tmp / f"{name}.gz").write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
        tmp.rename(record_dir)
        saved.append(str(rel))
    return saved, present


def _reference_reader(data_bin: Optional[Path], ref_dir: Optional[Path]):
    """``references(subset, settings, entry)``: a subset's references as its scoring read them, and the file
    read (:data:`BINARISED_TARGET` for the binarised target); cached per subset and source."""
    cache: Dict[tuple, Tuple[List[str], str]] = {}

    def references(subset: str, settings: dict, entry: dict) -> Tuple[List[str], str]:
        from .ablation_runner import language_pair
        from .scoring import binarised_references, read_lines

        if data_bin is None:
            raise FileNotFoundError(f"the records keep the {subset} references' digest only: pass the prepared "
                                    f"data (--data-dir, or --data-bin and --ref-dir) to read them again")
        target = language_pair(data_bin, {})[1]
        from_file = entry.get("reference") != BINARISED_TARGET
        key = (subset, from_file, settings.get("post_process"), settings.get("detok_lang"))
        if key not in cache:
            if from_file:
                if ref_dir is None or not (ref_dir / f"{subset}.{target}").is_file():
                    raise FileNotFoundError(f"the {subset} scores were read against a reference file "
                                            f"({entry.get('reference')}): not found in --ref-dir {ref_dir}")
                path = str(ref_dir / f"{subset}.{target}")
                cache[key] = read_lines(path), path
            else:
                cache[key] = binarised_references(str(data_bin), subset, *language_pair(data_bin, {}),
                                                  settings.get("post_process"), settings.get("detok_lang")), \
                    BINARISED_TARGET
        return cache[key]

    return references


def restore_records(records_dir, work_dir, data_bin=None, ref_dir=None) -> Tuple[List[str], List[str]]:
    """Writes every run recorded in ``records_dir`` into ``work_dir`` (created if missing), the references
    read from ``data_bin`` (fairseq-preprocess output) and ``ref_dir`` (raw references ``{subset}.{tgt}``).
    Returns ``(restored, already there)``: run paths relative to ``work_dir``. Every run is checked (and its
    references read) before anything is written.

    Raises:
        FileNotFoundError: ``records_dir`` holds no records, or the data to read the references from is missing.
        ValueError: the references read differ from those a run was scored against (their SHA-256).
        RecordConflict: the run's directory exists in ``work_dir`` with other contents (a finished run with
            other files, or a run that is training or stopped there: finish or remove it first).
    """
    records_dir, work_dir = Path(records_dir), Path(work_dir)
    data_bin, ref_dir = (Path(data_bin) if data_bin else None), (Path(ref_dir) if ref_dir else None)
    records = sorted({path.parent for path in records_dir.rglob(f"{EVAL}.gz")  # not a save cut short
                      if not any(part.startswith(".") for part in path.relative_to(records_dir).parts)})
    if not records:
        raise FileNotFoundError(f"{records_dir} holds no run records ({EVAL}.gz files)")
    references = _reference_reader(data_bin, ref_dir)
    plan = []
    for record_dir in records:
        rel = record_dir.relative_to(records_dir)
        texts, run_dir = _read_record(record_dir), work_dir / rel
        if run_dir.exists() and any(run_dir.iterdir()):
            here = _record_texts(run_dir)
            if here != texts:
                raise RecordConflict(f"{run_dir} exists and differs from its record in {record_dir} (differing: "
                                     f"{_differing(texts, here)}); remove {run_dir} to restore the finished run")
            plan.append((rel, run_dir, None))
            continue
        plan.append((rel, run_dir, {**texts, EVAL: _scores_restored(texts[EVAL], references, record_dir)}))
    restored, present = [], []
    for rel, run_dir, texts in plan:
        if texts is None:
            present.append(str(rel))
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        # eval.json last: a run directory is finished only once its scores are there
        for name in sorted(texts, key=lambda name: name == EVAL):
            target = run_dir / name
            target.parent.mkdir(exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_text(texts[name], encoding="utf-8")
            tmp.replace(target)
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
    restore.add_argument("--data-dir", help="prepared data, as the runner's: DIR/bin and DIR/raw")
    restore.add_argument("--data-bin", help="fairseq-preprocess directory (default: DATA_DIR/bin)")
    restore.add_argument("--ref-dir", help="raw references {subset}.{tgt} (default: DATA_DIR/raw)")
    args = parser.parse_args(argv)
    try:
        if args.action == "save":
            done, present = save_records(args.work_dir, args.records_dir)
            verb = "saved"
        else:
            data_dir = Path(args.data_dir) if args.data_dir else None
            data_bin = args.data_bin or (data_dir / "bin" if data_dir else None)
            ref_dir = args.ref_dir or (data_dir / "raw" if data_dir else None)
            done, present = restore_records(args.records_dir, args.work_dir, data_bin, ref_dir)
            verb = "restored"
    except (FileNotFoundError, RecordConflict, ValueError) as error:
        parser.exit(2, f"run_records: error: {error}\n")
    print(f"{verb} {len(done)} run(s){': ' + ', '.join(done) if done else ''}; "
          f"{len(present)} already there{': ' + ', '.join(present) if present else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
