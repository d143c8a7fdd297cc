"""One process at a time per run directory: the lock file ``run.lock``.

Two trainings in one save directory (a rerun beside a run still alive) interleave their
checkpoints and logs and overrun the update budget. :func:`run_lock` creates
``RUN_DIR/run.lock`` (JSON: the owner's PID, host, start time, and the PID of the fairseq
process it runs) and removes it when the block ends. A lock whose owner and child are both
gone (the runner was killed) is stale: it is taken over, with a log line. A live owner, or
one on another host (whose processes cannot be checked from here), is refused with
:class:`RunDirectoryInUse`, naming the PID, host and directory. The ablation runner and the main job
also hold the lock of their whole work directory (:data:`WORK_DIR_IN_USE`), so that a second command
there is refused at once, not after each has trained runs the other then cannot take.
"""

import contextlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

logger = logging.getLogger("ablation")

LOCK = "run.lock"
#: what the refusal of a second command on a work directory says
WORK_DIR_IN_USE = "two commands in one work directory would train and score the same runs"

_held: Dict[str, List] = {}  # lock path -> [nesting depth, the lock's contents], in this process
_held_lock = threading.Lock()


class RunDirectoryInUse(RuntimeError):
    """Another live process holds the run directory's lock."""


def process_start(pid: int) -> Optional[str]:
    """When process ``pid`` started (clock ticks after boot, from ``/proc``), to tell a reused PID
    from its first owner; None where that cannot be read (not Linux, or no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command's ")"


def _running(pid: Optional[int], started: Optional[str]) -> bool:
    """Whether process ``pid`` (that started at ``started``, if known) still runs; a zombie does not."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = None
    if state == "Z":
        return False
    now = process_start(pid)
    return started is None or now is None or now == started


def _owner_text(owner: dict) -> str:
    child = f", running fairseq process {owner['child_pid']}" if owner.get("child_pid") else ""
    return f"process {owner.get('pid')} on {owner.get('host')} (since {owner.get('started')}{child})"


def lock_owner(run_dir: Path) -> Optional[dict]:
    """The contents of ``run_dir/run.lock`` while a live process holds it, else None (no lock, or a
    stale one). Raises :class:`RunDirectoryInUse` for a lock of another host, which cannot be checked."""
    path = Path(run_dir) / LOCK
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # half-written by a process that died while writing it
        return None
    if owner.get("host") != socket.gethostname():
        raise RunDirectoryInUse(
            f"{run_dir} is locked by {_owner_text(owner)}, another host: if no run of it is alive there, "
            f"remove {path} and rerun")
    alive = _running(owner.get("pid"), owner.get("pid_started")) or \
        _running(owner.get("child_pid"), owner.get("child_started"))
    return owner if alive else None


def _write(path: Path, data: dict, exclusive: bool) -> None:
    if exclusive:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data))
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def _acquire(run_dir: Path, path: Path, why: str) -> dict:
    mine = {"pid": os.getpid(), "pid_started": process_start(os.getpid()), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(3):
        try:
            _write(path, mine, exclusive=True)
            return mine
        except FileExistsError:
            pass
        owner = lock_owner(run_dir)
        if owner is not None:
            raise RunDirectoryInUse(
                f"{run_dir} is in use by {_owner_text(owner)}: wait for it to end or stop it (kill "
                f"{owner['pid']}); {why}")
        with contextlib.suppress(OSError, ValueError):
            stale = json.loads(path.read_text(encoding="utf-8"))
            logger.warning("%s: taking over the lock of %s, which is no longer running", run_dir, _owner_text(stale))
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    raise RunDirectoryInUse(f"{run_dir}: could not take {path} (other processes keep taking it)")


@contextlib.contextmanager
def run_lock(run_dir: Path, why: str = "two trainings in one directory would mix their checkpoints"):
    """Holds ``run_dir/run.lock`` within the block (nested blocks of this process share it); ``why``: what
    the refusal of a second process says two processes there would do.

    Yields a function ``record_child(proc)`` that adds a child's PID to the lock, so that a
    rerun also waits for a training that outlived its runner.

    Raises:
        RunDirectoryInUse: a live process holds the lock (or one on another host).
    """
    run_dir = Path(run_dir)
    path = run_dir / LOCK
    key = str(path.resolve())
    with _held_lock:
        if key not in _held:
            _held[key] = [0, _acquire(run_dir, path, why)]
        _held[key][0] += 1
        mine = _held[key][1]

    def record_child(proc) -> None:
        _write(path, {**mine, "child_pid": proc.pid, "child_started": process_start(proc.pid)}, exclusive=False)

    try:
        yield record_child
    finally:
        with _held_lock:
            _held[key][0] -= 1
            if not _held[key][0]:
                del _held[key]
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
