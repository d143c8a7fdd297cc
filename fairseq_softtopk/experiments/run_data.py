"""What data a run of the ablation trains on: a fingerprint of its fairseq-preprocess directory, kept in the run
directory (``data.json``) from the run's start, so that a run is never resumed, nor reported, on other data.

fairseq-train resumes a run from its ``checkpoint_last.pt`` whatever ``--data-bin`` it is given: another corpus
with the same dictionaries and the same number of batches resumed without a word, and the run was marked done
and scored after updates on two corpora. :func:`data_fingerprint` reads what training reads and is cheap to
read: the dictionaries (``dict.*.txt``) and the index files (``.idx``: every sentence's length and offset) of the
splits the run trains and validates on, by SHA-256, and their data files (``.bin``, the token ids) by size; the
same corpus binarised again (or copied, or moved) has the same fingerprint. :func:`check_run_data` records it
when a run starts and compares it on every later call; a run directory from before fingerprints (an older work
directory, or one restored by :mod:`.run_records`, which keeps none) gets it when it next trains.
"""

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional

DATA = "data.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def trained_subsets(flags: Mapping[str, object]) -> list:
    """The splits fairseq-train reads with these flags: ``--train-subset`` (default ``train``) and each of
    ``--valid-subset`` (default ``valid``, comma-separated)."""
    valid = flags.get("valid-subset") or "valid"
    names = [str(name) for name in valid] if isinstance(valid, (list, tuple)) else str(valid).split(",")
    return [str(flags.get("train-subset") or "train"), *[name.strip() for name in names if name.strip()]]


def data_fingerprint(data_bin: Path, subsets: Iterable[str]) -> dict:
    """``{"sha256": ..., "files": {name: {"sha256": ...} or {"size": ...}}}`` of ``data_bin``: the dictionaries and
    the ``.idx`` files of ``subsets`` (each also with its shards ``train1``, ``train2``, ... as fairseq loads them)
    by SHA-256, their ``.bin`` files by size; ``sha256`` digests the whole listing."""
    data_bin = Path(data_bin)
    split = re.compile(rf"(?:{'|'.join(map(re.escape, subsets))})\d*")
    files: Dict[str, dict] = {}
    for path in sorted(data_bin.iterdir()):
        if path.name.startswith("dict.") and path.suffix == ".txt" or \
                path.suffix == ".idx" and split.fullmatch(path.name.split(".")[0]):
            files[path.name] = {"sha256": _sha256(path)}
        elif path.suffix == ".bin" and split.fullmatch(path.name.split(".")[0]):
            files[path.name] = {"size": path.stat().st_size}
    listing = json.dumps(files, sort_keys=True).encode("utf-8")
    return {"sha256": hashlib.sha256(listing).hexdigest(), "files": files}


_fingerprints: Dict[tuple, dict] = {}  # a rerun checks every run on the same data: read it once per process


def _fingerprint_once(data_bin: Path, subsets: list) -> dict:
    """:func:`data_fingerprint`, read again only where a file's size or modification time changed."""
    listing = tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(data_bin).iterdir()
                           if p.is_file()))
    key = (str(Path(data_bin).resolve()), tuple(subsets), listing)
    if key not in _fingerprints:
        _fingerprints[key] = data_fingerprint(data_bin, subsets)
    return _fingerprints[key]


def check_run_data(run_dir: Path, data_bin: Path, flags: Mapping[str, object], record: bool) -> None:
    """Compares the fingerprint of ``data_bin`` (the splits ``flags`` train and validate on) with the one recorded
    in ``run_dir/data.json``; where none is recorded and ``record`` (the run is about to train), records it. A
    ``data_bin`` that is no directory is left to fairseq-train, which names it.

    Raises:
        ValueError: another fingerprint is recorded: one line naming both directories and fingerprints, the
            files that differ and what to do. Nothing is trained or scored then.
    """
    path = Path(run_dir) / DATA
    try:
        recorded: Optional[dict] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        recorded = None
    if recorded is None and not record or not Path(data_bin).is_dir():
        return
    found = _fingerprint_once(data_bin, trained_subsets(flags))
    if recorded is None:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"data_bin": str(data_bin), **found}, indent=2), encoding="utf-8")
        os.replace(tmp, path)
        return
    if recorded.get("sha256") == found["sha256"]:
        return
    before, now = recorded.get("files") or {}, found["files"]
    differing = sorted(name for name in set(before) | set(now) if before.get(name) != now.get(name))
    listed = ", ".join(differing[:4]) + (f" and {len(differing) - 4} more" if len(differing) > 4 else "")
    raise ValueError(f"{run_dir} was started on other data: {recorded.get('data_bin')} (fingerprint "
                     f"{str(recorded.get('sha256'))[:12]}), not {data_bin} (fingerprint {found['sha256'][:12]}; "
                     f"differing: {listed}); nothing was trained or scored. Pass the data it started on as "
                     f"--data-bin (or --data-dir), or another --work-dir, or remove {run_dir} to train that run "
                     f"on this data")
