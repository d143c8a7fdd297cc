"""Checkpoints that the runner reuses are the ones it wrote: SHA-256 digests in ``done.json``.

A finished run's ``checkpoint_last.pt`` is read again later: fine-tuning starts from the
pretraining run's, and evaluation scores each run's. :func:`checkpoint_digest` is recorded in
the run's ``done.json`` (``checkpoint_sha256``; ``checkpoint_best_sha256`` for its ``checkpoint_best.pt``,
which an evaluation may score instead) when the run finishes, and :func:`verify_run_checkpoint` compares it
before each reuse: a file that changed on disk since
(a flipped bit, a copy cut short, a file replaced by hand) is an error, not a silently different
model. A ``done.json`` written before digests were recorded gets the digest of the file as it
is then, with a log line.

:func:`check_resumable` finds a ``checkpoint_last.pt`` cut short: fairseq writes a checkpoint
atomically under its first name, but *copies* it to ``checkpoint_last.pt``, so a run stopped
during that copy leaves a truncated file. It reads the file whole (every zip member's CRC-32), so a
file whose bytes changed after fairseq wrote them is named too: torch checks no CRC, and would resume
from it without a word. A done.json without a digest is trusted only for a whole file.
"""

import hashlib
import json
import logging
import os
import zipfile
from pathlib import Path

logger = logging.getLogger("ablation")

DONE = "done.json"
LAST = "checkpoint_last.pt"
BEST = "checkpoint_best.pt"
KEY = "checkpoint_sha256"


def digest_key(name: str) -> str:
    """The ``done.json`` key of a checkpoint file's digest: :data:`KEY` for ``checkpoint_last.pt``,
    ``<stem>_sha256`` for another (``checkpoint_best_sha256``)."""
    return KEY if name == LAST else f"{Path(name).stem}_sha256"


class CheckpointChanged(RuntimeError):
    """A finished run's checkpoint no longer matches the digest recorded when it finished."""


def checkpoint_digest(path: Path) -> str:
    """The SHA-256 of the file ``path``, as 64 hex digits."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _rewrite_keeping_mtime(path: Path, data: dict) -> None:
    """Replaces ``path`` atomically, keeping its modification time (older eval.json caches are keyed on it)."""
    stat = path.stat()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def verify_run_checkpoint(run_dir: Path, name: str = LAST) -> Path:
    """Checks a finished run's checkpoint ``name`` (``checkpoint_last.pt``) against the digest in its ``done.json``.

    Returns:
        the checkpoint's path.
    Raises:
        FileNotFoundError: the run has no ``done.json`` or no checkpoint.
        CheckpointChanged: the file's digest differs from the recorded one (the message names the
            file, both digests and what to do).
    """
    run_dir = Path(run_dir)
    done_path, checkpoint = run_dir / DONE, run_dir / name
    if not checkpoint.is_file():
        hint = " (fairseq-train writes it only where it validates)" if name == BEST else ""
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}{hint}")
    done = json.loads(done_path.read_text(encoding="utf-8"))
    found = checkpoint_digest(checkpoint)
    key = digest_key(name)
    expected = done.get(key)
    if expected is None:  # finished before digests were recorded: trust the file as it is now, if whole
        from fairseq_softtopk.checkpoint_safety import describe_damage

        damage = describe_damage(checkpoint)
        if damage:
            raise CheckpointChanged(f"{checkpoint} is not a whole checkpoint ({damage}), and {done_path} records no "
                                    f"digest to check it by. Restore the file (e.g. from a copy of the run), or move "
                                    f"{run_dir} away to train that run again; nothing was trained or scored with it")
        _rewrite_keeping_mtime(done_path, {**done, key: found})
        logger.info("%s: recorded the SHA-256 of %s in done.json (written before checksums)", run_dir, name)
        return checkpoint
    if found != expected:
        raise CheckpointChanged(
            f"{checkpoint} changed after its run finished: done.json records SHA-256 {expected}, the file now "
            f"has {found}. Restore the file (e.g. from a backup or a copy of the run), or move {run_dir} away "
            f"to train that run again; nothing was trained or scored with it")
    return checkpoint


def check_resumable(run_dir: Path) -> None:
    """Raises ``RuntimeError`` when ``run_dir/checkpoint_last.pt`` is not a whole checkpoint: a zip archive
    (torch's format) cut short, or one whose bytes changed after fairseq wrote them (a member fails its CRC-32:
    torch would load it without a word), or no checkpoint at all
    (:func:`fairseq_softtopk.checkpoint_safety.describe_damage`), naming the newest intact checkpoint to resume
    from instead."""
    from fairseq_softtopk.checkpoint_safety import describe_damage

    checkpoint = Path(run_dir) / LAST
    damage = describe_damage(checkpoint)
    if damage is None:
        return  # whole (or an old pickle-format checkpoint, which cannot be checked this cheaply)
    with open(checkpoint, "rb") as f:
        cut_short = f.read(4) == b"PK\x03\x04" and not zipfile.is_zipfile(checkpoint)
    others = sorted((p for p in Path(run_dir).glob("checkpoint*.pt") if p.name != LAST and describe_damage(p) is None),
                    key=lambda p: p.stat().st_mtime)
    advice = (f"copy the newest intact checkpoint, {others[-1]}, to {checkpoint} and rerun" if others else
              f"move {checkpoint} away to train the run from its start")
    what = "is cut short (the run was stopped while fairseq copied it)" if cut_short else \
        f"is not a whole checkpoint ({damage})"
    raise RuntimeError(f"{checkpoint} {what}; nothing was trained: {advice}")
