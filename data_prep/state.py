"""Finished-step markers: every step runs at most once per output directory.

A step writes its outputs under temporary names (``NAME.partial``), renames them into place
when it has finished, and only then writes its marker ``OUT/.state/<first output>.done``
(itself written to a temporary file and renamed). On a later run:

- marker present, same settings, outputs unchanged: the step is skipped;
- marker present but other settings (say another ``--bpe-size``), or an output missing or
  changed in size: :class:`PrepError`, nothing is redone;
- no marker but an output already exists (not made by a finished step): :class:`PrepError`,
  the file is not overwritten.

Before the first step, :func:`claim_out_dir` makes sure that the output directory is new, empty
or one that data_prep made (it has ``OUT/.state``), and creates ``OUT/.state``: a run into a
directory that holds other files is refused before anything is written into it.
"""

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Union

logger = logging.getLogger("data_prep")

STATE_DIR = ".state"
PARTIAL_SUFFIX = ".partial"


class PrepError(Exception):
    """A problem the user has to fix (missing or corrupt archive, mismatched line counts,
    an output that would be overwritten); the message names the file."""


def count_lines(path: Union[str, Path]) -> int:
    """Number of lines in a file (a last line without ``\\n`` counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def check_same_line_count(paths: Sequence[Path], what: str = "") -> int:
    """Returns the common line count of ``paths``.

    Raises:
        PrepError: if the counts differ; every file is named with its count.
    """
    counts = {str(p): count_lines(p) for p in paths}
    if len(set(counts.values())) != 1:
        listing = ", ".join(f"{p}: {n} lines" for p, n in counts.items())
        raise PrepError(f"mismatched line counts{' in ' + what if what else ''}: {listing}")
    return next(iter(counts.values()))


def partial_path(path: Path) -> Path:
    """Temporary name under which a step writes ``path``."""
    return path.with_name(path.name + PARTIAL_SUFFIX)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fingerprint(path: Path) -> Union[int, Dict[str, int]]:
    """Size of a file, or ``{name: size}`` for the files of a directory."""
    if path.is_dir():
        return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
    return path.stat().st_size


def write_json_atomic(path: Path, data: dict) -> None:
    """Writes ``data`` to a temporary file next to ``path`` and renames it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(path)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def relative_name(path: Path, out_dir: Path) -> str:
    """``path`` relative to ``out_dir`` if inside it, else absolute (names in the markers)."""
    try:
        return str(path.resolve().relative_to(out_dir.resolve()))
    except ValueError:
        return str(path.resolve())


def marker_path(out_dir: Path, name: str) -> Path:
    """``OUT/.state/<name>.done``."""
    return out_dir / STATE_DIR / f"{name}.done"


def _check_finished(marker: Path, name: str, params: dict, outputs: Sequence[Path], out_dir: Path) -> None:
    """Raises :class:`PrepError` unless a finished step matches ``params`` and ``outputs``."""
    with open(marker, encoding="utf-8") as f:
        done = json.load(f)
    redo = f"use another --out, or delete {marker} and the step's outputs to redo it"
    if done.get("params") != params:
        old = done.get("params", {})
        diff = ", ".join(f"{k}: {old.get(k)!r} -> {params.get(k)!r}"
                         for k in sorted(set(old) | set(params)) if old.get(k) != params.get(k))
        raise PrepError(f"step {name!r} already finished in {out_dir} with other settings ({diff}); {redo}")
    for path in outputs:
        expected = done["outputs"].get(relative_name(path, out_dir))
        if not path.exists():
            raise PrepError(f"{path}, made by the finished step {name!r}, is missing; {redo}")
        if _fingerprint(path) != expected:
            raise PrepError(f"{path}, made by the finished step {name!r}, has changed since; {redo}")


def claim_out_dir(out_dir: Path, raw_dir: Optional[Path] = None) -> None:
    """Takes ``out_dir`` as a data_prep output directory (creates ``out_dir/.state``) before any step writes.

    A directory that does not exist, is empty, or already has ``.state`` (an earlier run, even
    one interrupted in its first download) is taken. Any other is refused, so that a mistyped
    ``--out`` (a home directory, another project) gets nothing written into it. The archive
    directory may lie inside ``out_dir`` (``OUT/orig``, where archives are downloaded or put
    beforehand): its entry does not count.

    Raises:
        PrepError: ``out_dir`` is not a directory, or holds other files and no ``.state``.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise PrepError(f"--out {out_dir} exists and is not a directory")
    if out_dir.is_dir() and not (out_dir / STATE_DIR).is_dir():
        archives = set()
        if raw_dir is not None:
            try:
                inside = Path(raw_dir).resolve().relative_to(out_dir.resolve()).parts
            except ValueError:
                inside = None
            if inside == ():  # the archives are in OUT itself: nothing tells data_prep's files from others
                inside = None
                archives = {p.name for p in out_dir.iterdir()}
            if inside:
                archives.add(inside[0])
        foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in archives)
        if foreign:
            listing = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise PrepError(f"refusing to write into {out_dir}: it is not empty ({listing}) and no data_prep run "
                            f"made it (no {out_dir / STATE_DIR}); use a new or empty directory as --out")
    (out_dir / STATE_DIR).mkdir(parents=True, exist_ok=True)


def run_step(out_dir: Path, name: str, params: dict, outputs: Sequence[Path],
             action: Callable[..., Optional[dict]]) -> bool:
    """Runs ``action(*partial_outputs)`` once, then renames its outputs into place.

    Args:
        out_dir: the output directory; markers go to ``out_dir/.state``.
        name: step name, unique within ``out_dir`` (``tok/train.en``).
        params: everything the outputs depend on (input paths, options); compared on re-runs.
        outputs: files or directories the step creates.
        action: called with one temporary path per output, in order; it must create each. It may
            return a dict of statistics (sentences/s, ...), kept in the marker for reference.

    Returns:
        True if the step ran, False if it had already finished.

    Raises:
        PrepError: see the module docstring.
    """
    out_dir = Path(out_dir)
    outputs = [Path(p) for p in outputs]
    marker = marker_path(out_dir, name)
    if marker.exists():
        _check_finished(marker, name, params, outputs, out_dir)
        logger.info("skip %s: already done", name)
        return False
    for path in outputs:
        if path.exists():
            raise PrepError(f"refusing to overwrite {path}: it exists but no finished step made it "
                            f"(no {marker}); move it away or use another --out")
    partials = [partial_path(p) for p in outputs]
    for tmp in partials:
        _remove(tmp)  # left over from an interrupted run of this same step
        tmp.parent.mkdir(parents=True, exist_ok=True)
    logger.info("run %s", name)
    stats = action(*partials) or {}
    for tmp, path in zip(partials, outputs):
        if not tmp.exists():
            raise RuntimeError(f"step {name!r} did not create {tmp}")
        os.replace(tmp, path)
    fingerprints = {relative_name(p, out_dir): _fingerprint(p) for p in outputs}
    write_json_atomic(marker, {"params": params, "outputs": fingerprints, "stats": stats})
    return True
