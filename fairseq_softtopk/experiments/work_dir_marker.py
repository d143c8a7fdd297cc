"""What the main job created in its work directory (``main_job.json``), so that ``--fresh`` removes
that and nothing else.

Before it creates anything, the main job adds to the marker each top-level entry it is about to
create (one that does not exist yet): its data (``raw``, ``bin``), its runs (``seed<N>``,
``pretrain``) and its reports. :func:`clear_for_fresh` removes the listed runs and reports (the
data are kept) and refuses, naming it, a non-empty directory without the marker (another
tool's, e.g. an ablation's work directory, or a main job's from before the marker) and a run
directory there that the marker does not list. The marker is only trusted to name entries of the work
directory: one listing anything else (``../x``, an absolute path, ``.``) is refused before anything is
deleted.
"""

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, List, Optional

from .run_lock import LOCK, lock_owner

logger = logging.getLogger("main_job")

MARKER = "main_job.json"
#: the entries of a work directory that hold training runs
RUN_ENTRY = re.compile(r"pretrain|seed\d+")
#: the entries ``--fresh`` keeps: the generated data
DATA = ("raw", "bin")


def read_marker(work: Path) -> Optional[dict]:
    """The marker's contents (``{"created_by", "created": [names]}``), or None where there is none
    (or it is not a marker)."""
    try:
        marker = json.loads((Path(work) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("created"), list) else None


def is_plain_name(name) -> bool:
    """Whether ``name`` names an entry directly inside a directory: a string that is not empty, ``.`` or ``..``
    and holds no path separator (so not an absolute path, nor one that leaves the directory)."""
    separators = {"/", os.sep, os.altsep} - {None}
    return isinstance(name, str) and name not in ("", ".", "..") and not any(sep in name for sep in separators) \
        and "\0" not in name


def record_created(work: Path, names: Iterable[str]) -> None:
    """Adds to the marker those of ``names`` (top-level entries of ``work``) that do not exist yet,
    the ones the main job will create; creates ``work`` if missing."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    marker = read_marker(work) or {"created_by": "fairseq-softtopk-main-job", "created": []}
    new = [name for name in names if name not in marker["created"] and not (work / name).exists()]
    if not new and (work / MARKER).exists():
        return
    marker["created"] = [*marker["created"], *new]
    tmp = work / f".{MARKER}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, work / MARKER)


def clear_for_fresh(work: Path) -> List[Path]:
    """Removes the runs and reports the marker lists (``--fresh``); the data are kept.

    Returns:
        the paths removed.
    Raises:
        ValueError: ``work`` is not empty and has no marker, or the marker lists something that is not a
            plain name (:func:`is_plain_name`), or ``work`` holds a run directory the marker does not list, or a
            run there is in use by a live process; nothing is removed then.
    """
    work = Path(work)
    entries = sorted(path.name for path in work.iterdir() if path.name != LOCK) if work.is_dir() else []
    if not entries:  # new, or empty but for the lock of the job that calls this
        return []
    marker = read_marker(work)
    if marker is None:
        raise ValueError(f"--fresh: {work} was not made by the main job (no {MARKER}; it holds "
                         f"{', '.join(entries[:8])}{', ...' if len(entries) > 8 else ''}): nothing was deleted. Pass "
                         f"a new or empty --work-dir, or delete what you want retrained yourself")
    unsafe = [name for name in marker["created"] if not is_plain_name(name)]
    if unsafe:  # the marker is a file anyone can edit: deleting what it names must stay inside the work directory
        raise ValueError(f"--fresh: {work / MARKER} lists {', '.join(map(repr, unsafe[:3]))}, not the name of an "
                         f"entry of {work} (the main job records only names such as seed1 or results.md): nothing "
                         f"was deleted. Remove those entries from it, or delete what you want retrained yourself")
    foreign = [name for name in entries if RUN_ENTRY.fullmatch(name) and name not in marker["created"]]
    if foreign:
        raise ValueError(f"--fresh: {work} holds {', '.join(foreign)}, which the main job did not create ({MARKER} "
                         f"does not list them): nothing was deleted. Move them away, or pass another --work-dir")
    doomed = [work / name for name in marker["created"] if name not in DATA and (work / name).exists()]
    for path in doomed:
        for lock in path.rglob(LOCK) if path.is_dir() else ():
            owner = lock_owner(lock.parent)
            if owner is not None:
                raise ValueError(f"--fresh: {lock.parent} is in use by process {owner['pid']}: nothing was "
                                 f"deleted. Stop that run first")
    for path in doomed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return doomed
