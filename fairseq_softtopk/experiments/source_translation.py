"""Translating source files that have no references (held-out test sets, scored elsewhere) with a run's scored
checkpoint at its chosen length penalty: ``fairseq-softtopk-ablation --translate-sources DIR``.

Each ``NAME.SRC`` (or ``NAME.SRC.gz``) of ``DIR`` is segmented as the corpus was (:mod:`.source_segmentation`:
Moses, then ``DATA_DIR/bpe``'s model), binarised with the corpus's source dictionary (``fairseq-preprocess
--only-source``, in a temporary directory), decoded by ``fairseq-generate`` with the run's evaluation settings
(beam, generation flags, post-processing) at the length penalty the run chose on valid, and detokenised into
``RUN/translations/NAME.TGT``: one line a source line, in order; a missing or duplicated hypothesis is an error.
``RUN/translations.json`` records what each file translated (the source's SHA-256 and line count, the checkpoint's
digest, the length penalty, the settings), so a rerun translates again only what changed."""

import gzip
import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from .ablation_config import eval_settings, flags_to_args
from .ablation_training import write_json_atomic
from .child_processes import run_captured
from .fairseq_commands import fairseq_command, subprocess_env

logger = logging.getLogger("ablation")

TRANSLATIONS = "translations"
TRANSLATIONS_JSON = "translations.json"


def source_files(directory: Path, lang: str) -> Dict[str, Path]:
    """``{NAME: path}`` of the ``NAME.LANG`` and ``NAME.LANG.gz`` files of ``directory``, sorted by name.

    Raises:
        FileNotFoundError: no such directory, or none of its files is in ``lang``.
        ValueError: a name given both plain and gzipped.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"--translate-sources {directory}: no such directory")
    found: Dict[str, List[Path]] = {}
    for path in sorted(directory.iterdir()):
        for suffix in (f".{lang}", f".{lang}.gz"):
            if path.is_file() and path.name.endswith(suffix) and len(path.name) > len(suffix):
                found.setdefault(path.name[:-len(suffix)], []).append(path)
    if not found:
        raise FileNotFoundError(f"--translate-sources {directory} holds no NAME.{lang} or NAME.{lang}.gz file "
                                f"(sources in the data's source language, {lang})")
    twice = [name for name, paths in found.items() if len(paths) > 1]
    if twice:
        raise ValueError(f"--translate-sources {directory}: {', '.join(twice)} given both plain and gzipped: keep one")
    return {name: paths[0] for name, paths in found.items()}


def read_source(path: Path) -> List[str]:
    """The lines of a UTF-8 text file, gzipped or not, without their line ends."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def _digest(lines: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


def binarise_source(lines: Sequence[str], segment, data_bin: Path, pair: tuple, dest: Path) -> Path:
    """``dest``: a fairseq data directory whose ``test`` split holds the raw source ``lines``, segmented by
    ``segment`` and binarised with ``data_bin``'s source dictionary (``fairseq-preprocess --only-source``), beside
    ``data_bin``'s dictionaries. ``pair``: ``(source, target)`` language of ``data_bin``."""
    src, tgt = pair
    dest.mkdir(parents=True, exist_ok=True)
    text = dest / f"source.{src}"
    text.write_text("".join(segment(line) + "\n" for line in lines), encoding="utf-8")
    proc = run_captured(fairseq_command("preprocess", [
        "--only-source", "--srcdict", data_bin / f"dict.{src}.txt", "--testpref", dest / "source",
        "--destdir", dest, "--source-lang", src, "--target-lang", tgt]), env=subprocess_env())
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-preprocess failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    text.unlink()
    shutil.copyfile(data_bin / f"dict.{tgt}.txt", dest / f"dict.{tgt}.txt")
    return dest


def translate_lines(checkpoint: Path, data_bin: Path, lines: Sequence[str], segment, pair: tuple, beam: int,
                    lenpen: Optional[float], eval_cfg: Mapping) -> List[str]:
    """Detokenised translations of the raw source ``lines`` (one per line, in order) by ``checkpoint``, trained
    with ``data_bin``'s dictionaries (:func:`binarise_source`; ``segment``: raw line -> corpus tokens,
    :func:`.source_segmentation.corpus_segmenter`), decoded as ``eval_cfg`` decodes a subset."""
    from .fairseq_generate import parse_hypotheses, run_fairseq_generate
    from .scoring import detokenize

    with tempfile.TemporaryDirectory(prefix="translate-") as tmp:
        binarised = binarise_source(lines, segment, data_bin, pair, Path(tmp) / "bin")
        extra = flags_to_args(eval_cfg.get("generate") or {}) + ["--source-lang", pair[0], "--target-lang", pair[1]]
        if lenpen is not None:
            extra += ["--lenpen", str(lenpen)]
        stdout = run_fairseq_generate(str(binarised), str(checkpoint), "test", beam, eval_cfg.get("batch_size"),
                                      eval_cfg.get("post_process"), extra)
    return detokenize(parse_hypotheses(stdout, len(lines)), eval_cfg.get("detok_lang"))


def translate_run(run_dir: Path, checkpoint: Path, checkpoint_sha256: str, lenpen: Optional[float],
                  sources: Mapping[str, Path], segment, data_bin: Path, eval_cfg: Mapping, pair: tuple) -> dict:
    """Translates every source of ``sources`` (:func:`source_files`) with ``checkpoint`` (the run's scored one, by
    its digest) at ``lenpen`` into ``run_dir/translations/NAME.TGT``; returns ``translations.json``'s contents,
    ``{NAME: what was translated}``. A file whose record matches (the same source, checkpoint, length penalty and
    settings) and whose translation is still there is not translated again."""
    out_dir = run_dir / TRANSLATIONS
    record_path = run_dir / TRANSLATIONS_JSON
    records = json.loads(record_path.read_text()) if record_path.exists() else {}
    settings = eval_settings(eval_cfg)
    for name, path in sources.items():
        lines = read_source(path)
        wanted = {"source": path.name, "source_sha256": _digest(lines), "lines": len(lines),
                  "checkpoint": checkpoint.name, "checkpoint_sha256": checkpoint_sha256, "lenpen": lenpen,
                  "settings": settings, "translation": f"{TRANSLATIONS}/{name}.{pair[1]}"}
        target = run_dir / wanted["translation"]
        if records.get(name) == wanted and target.is_file():
            continue
        logger.info("%s: translating %s (%d lines) at lenpen %s", run_dir, path.name, len(lines), lenpen)
        hypotheses = translate_lines(checkpoint, data_bin, lines, segment, pair, eval_cfg.get("beam", 5), lenpen,
                                     eval_cfg)
        out_dir.mkdir(exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
        partial.replace(target)  # a stopped translation leaves no half file under the final name
        records[name] = wanted
        write_json_atomic(record_path, records)
    return records
