"""Publishing a run directory under ``results/``: its summaries, without the machine it ran on.

``results/`` in git holds what a reader needs to check a table (``results.md``, ``results.json``,
figures (re-encoded with a 64-colour palette: a quarter of the bytes, the same picture), and in one
archive, ``runs.tar.xz``, each run's fairseq-train arguments, timings and training log: ``tar xf
runs.tar.xz`` gives ``seed1/ARM/run.json``, ``done.json`` and ``train.log`` as the run directory held them.
One archive, not three files a run: the runs' logs share most of their text, so xz across them takes a
tenth of the bytes of each log gzipped alone, and 100 small files took 400 KB of 4 KB blocks on disk),
not what re-running the command produces again (checkpoints, hypotheses, ``eval.json`` with every
hypothesis). Absolute paths are cut to the part a reader can resolve (from ``runs/``, ``data/``,
``configs/``, ...), so that nothing names the machine that wrote them. A file a reader does not have
(a checkpoint from outside the repository) is named by a placeholder the results' README explains
(``--placeholder PATH=NAME``).

    python -m fairseq_softtopk.experiments.publish RUN_DIR results/NAME     # copy a finished run
    python -m fairseq_softtopk.experiments.publish --in-place results/NAME  # tidy a published one
    ... --placeholder /data/models/tf/checkpoint_best.pt=TF_CHECKPOINT     # and name that file TF_CHECKPOINT
"""

import argparse
import gzip
import io
import logging
import lzma
import re
import sys
import tarfile
from pathlib import Path
from typing import Dict, List, Optional

#: path components from which a path is kept (the first one found, with what follows it)
ANCHORS = ("runs", "data", "results", "configs", "checkpoints", "fairseq_softtopk", "scripts", "shared", "site-packages")
#: what results/ keeps at a run directory's top level and in each run below it
TOP_LEVEL = ("*.md", "*.json", "*.png")
PER_RUN = ("run.json", "done.json", "train.log")
#: the archive of every run's :data:`PER_RUN` files in a published directory
RUNS = "runs.tar.xz"
#: what it never keeps: re-running the command produces them
DROPPED = ("*.pt", "*.hyp", "eval.json")

#: colours a published figure keeps (line plots use a dozen; antialiasing takes the rest)
PNG_COLOURS = 64

logger = logging.getLogger(__name__)

# an absolute path: a slash not preceded by a word character, a dot, a colon or a slash (so not
# a URL, a fraction or a relative path), then one or more components
_ABSOLUTE = re.compile(r"(?<![\w.:/~-])/(?:[\w.+-]+/)*[\w.+-]+")


def _relative(match: re.Match) -> str:
    parts = match.group(0).strip("/").split("/")
    for i, part in enumerate(parts):
        if part in ANCHORS:
            return "/".join(parts[i:])
    return ".../" + parts[-1] if len(parts) > 1 else match.group(0)


def strip_absolute_paths(text: str) -> str:
    """``text`` with every absolute path of two or more components cut to its part from the first
    :data:`ANCHORS` component (``/work/exp/runs/x/bin`` -> ``runs/x/bin``), else to ``.../name``."""
    return _ABSOLUTE.sub(_relative, text)


def absolute_paths(text: str) -> List[str]:
    """The absolute paths (two or more components) that ``text`` still names."""
    return [m.group(0) for m in _ABSOLUTE.finditer(text) if m.group(0).count("/") >= 2]


def placeholder_pattern(path: str) -> re.Pattern:
    """The forms ``path`` takes in a run's text: as given, cut by :func:`strip_absolute_paths`, or relative
    with leading ``../`` (``/m/shared/tf.pt``, ``shared/tf.pt``, ``../shared/tf.pt``), each a whole path.

    Raises:
        ValueError: ``path`` is empty or one component (a word that would match inside other text).
    """
    given = re.sub(r"^(?:\.\./)+", "", path.rstrip("/"))
    if "/" not in given or given.startswith("/") and given.count("/") < 2:
        raise ValueError(f"placeholder path {path!r}: give a file's path with at least one directory")
    # ".../name" (an absolute path with no known anchor, cut) could be any file of that name: not a form
    forms = {given} | {f for f in [strip_absolute_paths(given)] if not f.startswith(".../")}
    alternatives = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
    return re.compile(rf"(?<![\w./~-])(?:\.\./)*(?:{alternatives})(?![\w./-])")


def replace_paths(text: str, placeholders: Optional[Dict[str, str]] = None) -> str:
    """``text`` with absolute paths stripped (:func:`strip_absolute_paths`) and each path of
    ``placeholders`` (``{path: name}``), in any of its forms (:func:`placeholder_pattern`), written as its name."""
    patterns = [(placeholder_pattern(path), name) for path, name in (placeholders or {}).items()]
    for pattern, name in patterns:  # before stripping: the path exactly as given
        text = pattern.sub(name, text)
    text = strip_absolute_paths(text)
    for pattern, name in patterns:  # after: as another machine's path is cut (/m/shared/x -> shared/x)
        text = pattern.sub(name, text)
    return text


def parse_placeholder(spec: str) -> tuple:
    """``"PATH=NAME"`` -> ``(PATH, NAME)``; NAME a word of letters, digits and underscores.

    Raises:
        ValueError: no ``=``, or NAME not such a word, or PATH not a path (:func:`placeholder_pattern`).
    """
    path, sep, name = spec.rpartition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"--placeholder {spec!r}: write PATH=NAME, NAME a word such as TF_CHECKPOINT")
    placeholder_pattern(path)
    return path, name


def _write_text(path: Path, text: str) -> None:
    if path.suffix == ".gz":
        # mtime 0: tidying again rewrites the same bytes (no churn in git)
        path.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        path.write_text(text, encoding="utf-8")


def compact_png(source: Path, dest: Path) -> None:
    """Writes ``source`` to ``dest`` with a :data:`PNG_COLOURS`-colour palette when that is smaller
    (matplotlib writes 32-bit RGBA; a line plot needs a few dozen colours). A file Pillow cannot
    decode is copied as is, with a warning."""
    data = source.read_bytes()
    try:
        from PIL import Image
        with Image.open(io.BytesIO(data)) as image:
            buffer = io.BytesIO()
            image.convert("RGB").quantize(colors=PNG_COLOURS, method=Image.Quantize.MEDIANCUT).save(
                buffer, "PNG", optimize=True)
        if len(buffer.getvalue()) < len(data):
            data = buffer.getvalue()
    except (ImportError, OSError) as error:  # no Pillow, or not an image it reads: keep the bytes
        logger.warning("%s: copied as is (%s)", source, error)
    dest.write_bytes(data)


def _copy_clean(source: Path, dest: Path, placeholders: Optional[Dict[str, str]] = None) -> None:
    """Copies ``source`` to ``dest`` with paths stripped and named (text, :func:`replace_paths`) or
    re-encoded (PNG, :func:`compact_png`); ``train.log`` is gzipped."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.suffix == ".png":
        compact_png(source, dest)
        return
    text = (gzip.open(source, "rt", encoding="utf-8").read() if source.suffix == ".gz"
            else source.read_text(encoding="utf-8", errors="replace"))
    if source.name == "train.log":
        dest = dest.with_name("train.log.gz")
    _write_text(dest, replace_paths(text, placeholders))


def _run_files(run_dir: Path) -> List[Path]:
    """The :data:`PER_RUN` files of the runs below ``run_dir`` (a log gzipped, as published before, too)."""
    return sorted(p for name in PER_RUN + ("train.log.gz",) for p in run_dir.rglob(name) if p.parent != run_dir)


def _member_name(run_dir: Path, path: Path) -> str:
    """A run file's name in :data:`RUNS`: its path below ``run_dir``, a gzipped log by its plain name."""
    name = path.relative_to(run_dir).as_posix()
    return name[:-len(".gz")] if name.endswith("train.log.gz") else name


def _read_text(path: Path) -> str:
    return (gzip.open(path, "rt", encoding="utf-8").read() if path.suffix == ".gz"
            else path.read_text(encoding="utf-8", errors="replace"))


def read_runs_archive(path: Path) -> Dict[str, str]:
    """``{member name: text}`` of a :data:`RUNS` archive (``seed1/tf/run.json``, ...)."""
    with tarfile.open(path, "r:xz") as archive:
        return {member.name: archive.extractfile(member).read().decode("utf-8")
                for member in archive.getmembers() if member.isfile()}


def write_runs_archive(path: Path, texts: Dict[str, str]) -> None:
    """Writes ``{member name: text}`` as a tar archive compressed with xz, reproducibly: names sorted, no time,
    owner or group, so that writing the same texts again gives the same bytes (no churn in git)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name in sorted(texts):
            data = texts[name].encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            archive.addfile(info, io.BytesIO(data))
    path.write_bytes(lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME))


def publish(run_dir, dest, placeholders: Optional[Dict[str, str]] = None) -> List[Path]:
    """Copies the summaries of ``run_dir`` (an ablation's work directory) to ``dest``, each path of
    ``placeholders`` (``{path: name}``) written as its name.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``results.md``.
        FileExistsError: ``dest`` exists (nothing is overwritten; remove it first).
    """
    run_dir, dest = Path(run_dir), Path(dest)
    if not (run_dir / "results.md").is_file():
        raise FileNotFoundError(f"{run_dir} has no results.md: not a finished ablation run")
    if dest.exists():
        raise FileExistsError(f"{dest} exists; remove it to publish {run_dir} there again")
    written = []
    for source in (p for pattern in TOP_LEVEL for p in sorted(run_dir.glob(pattern))):
        _copy_clean(source, dest / source.name, placeholders)
        written.append(dest / source.name)
    runs = {_member_name(run_dir, p): replace_paths(_read_text(p), placeholders) for p in _run_files(run_dir)}
    if runs:
        write_runs_archive(dest / RUNS, runs)
        written.append(dest / RUNS)
    return written


def tidy_in_place(published, placeholders: Optional[Dict[str, str]] = None) -> None:
    """Brings a directory already under ``results/`` to the same form: drops :data:`DROPPED`,
    moves the runs' files (one directory per run, as published before :data:`RUNS`) into :data:`RUNS`
    beside what it already holds, strips absolute paths from every text file and names those of
    ``placeholders`` (``{path: name}``), re-encodes the figures.

    Raises:
        FileExistsError: a run's file is both in :data:`RUNS` and beside it, with other contents (nothing
            is changed then).
    """
    published = Path(published)
    runs = read_runs_archive(published / RUNS) if (published / RUNS).is_file() else {}
    loose = _run_files(published)
    for path in loose:
        name, text = _member_name(published, path), _read_text(path)
        if runs.get(name, text) != text:
            raise FileExistsError(f"{path} differs from {name} in {published / RUNS}: keep one of them")
        runs[name] = text
    for pattern in DROPPED:
        for path in published.rglob(pattern):
            path.unlink()
    for path in sorted(published.rglob("*")):
        if path.is_file() and path not in loose and path.name != RUNS:
            _copy_clean(path, path, placeholders)
            if path.name == "train.log":
                path.unlink()
    if runs:
        write_runs_archive(published / RUNS, {name: replace_paths(text, placeholders) for name, text in runs.items()})
    for path in loose:
        path.unlink()
    for directory in sorted((p for p in published.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(directory.iterdir()):  # a run's directory, emptied
            directory.rmdir()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a finished ablation work directory (or, with --in-place, results/NAME)")
    parser.add_argument("dest", nargs="?", help="where to publish it, e.g. results/NAME (must not exist)")
    parser.add_argument("--in-place", action="store_true", help="tidy a directory already under results/")
    parser.add_argument("--placeholder", action="append", default=[], metavar="PATH=NAME",
                        help="write PATH (a file the reader does not have, as given, as published or with ../ "
                             "before it) as NAME in every text file; repeatable")
    args = parser.parse_args(argv)
    try:
        placeholders = dict(parse_placeholder(spec) for spec in args.placeholder)
    except ValueError as error:
        parser.error(str(error))
    try:
        if args.in_place:
            tidy_in_place(args.source, placeholders)
        else:
            if not args.dest:
                parser.error("give DEST, or --in-place")
            for path in publish(args.source, args.dest, placeholders):
                print(path)
    except (FileNotFoundError, FileExistsError) as error:
        parser.exit(2, f"publish: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
