"""The fairseq processes the experiments start: they stop when the runner is told to stop, and die with it.

Every child is started through :func:`start` (or :func:`run_captured`), which

* refuses to start one once a stop was requested (:class:`RunStopped`), so that a stopped
  schedule starts no further run;
* puts the child in a session of its own, so that a Ctrl-C at the terminal reaches the runner
  only: the runner then stops its children in order (below) instead of every process of the
  terminal's process group dying at its own moment;
* on Linux, asks the kernel to SIGKILL the child when the thread that started it ends
  (``prctl(PR_SET_PDEATHSIG)``), so that no child outlives a runner killed with SIGKILL. The
  kernel ties this to the *thread*, not the process: every caller here waits for its child in
  the thread that started it (a ``ThreadPoolExecutor`` worker blocks on its fairseq process
  for the process's whole life), which is what makes it safe.

Within :func:`stop_on_signals` (the main thread of a command-line tool), SIGINT and SIGTERM
forward SIGTERM to every live child, SIGKILL the ones still alive after
:data:`GRACE_SECONDS` (a second signal: at once), and raise :class:`RunStopped` in the main
thread; the tools exit with 130 (SIGINT) or 143 (SIGTERM). SIGUSR1 is passed on to every live
fairseq-train child, which then saves ``checkpoint_last.pt`` after its current update and trains on
(:mod:`fairseq_softtopk.checkpoint_on_signal`); other children (fairseq-generate) do not get it.
"""

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from ..checkpoint_on_signal import SAVE_SIGNAL, TRAIN_MODULE

logger = logging.getLogger("ablation")

#: seconds a child has to end after SIGTERM before it is killed
GRACE_SECONDS = 10.0
_PR_SET_PDEATHSIG = 1

_live: Dict[int, subprocess.Popen] = {}
_live_lock = threading.Lock()
_stop_signal: Optional[int] = None
_handling = False


class RunStopped(BaseException):
    """A stop was requested (SIGINT or SIGTERM). A ``BaseException``, as ``KeyboardInterrupt``: an
    ``except Exception`` does not swallow it. ``lines``: what became of each run, for the user."""

    def __init__(self, signum: int, lines: Sequence[str] = ()):
        super().__init__(signum)
        self.signum = signum
        self.lines = list(lines)

    @property
    def exit_status(self) -> int:
        """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return "\n".join([f"stopped by {self.signal_name}", *self.lines])


def _load_prctl():
    """libc's ``prctl`` on Linux, else None (resolved once, here: never between fork and exec)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


_prctl = _load_prctl()


def _die_with_parent(parent: int):
    """A ``preexec_fn`` for a child of process ``parent``: SIGKILL when the starting thread ends."""

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def stopping() -> Optional[int]:
    """The signal that stopped the runner, or None."""
    return _stop_signal


def check_not_stopping() -> None:
    """Raises :class:`RunStopped` once a stop was requested."""
    if _stop_signal is not None:
        raise RunStopped(_stop_signal)


def _send(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, OSError):
        proc.send_signal(signum)  # does nothing once the child was waited for


def start(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)``, registered as a child to stop (see the module).

    The calling thread must wait for the child (e.g. ``with start(...) as proc:``, which waits on
    leaving) and then call :func:`forget`: on Linux the child dies when that thread ends.

    Raises:
        RunStopped: a stop was requested; nothing is started.
    """
    check_not_stopping()
    if _prctl is not None:
        popen_kwargs["preexec_fn"] = _die_with_parent(os.getpid())
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)  # a child in its own session must not read the tty
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen_kwargs)
    with _live_lock:
        _live[proc.pid] = proc
    if _stop_signal is not None:  # stopped while it started: the handler's list may have missed it
        _send(proc, signal.SIGTERM)
    return proc


def forget(proc: subprocess.Popen) -> None:
    """Unregisters a child that was waited for; raises :class:`RunStopped` if a stop ended it."""
    with _live_lock:
        _live.pop(proc.pid, None)
    if proc.returncode != 0:
        check_not_stopping()


def run_captured(cmd: Sequence[str], env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, env=env)`` through :func:`start`.

    Raises:
        RunStopped: a stop was requested before or while it ran.
    """
    with start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            stdout, stderr = proc.communicate()
        finally:
            _send(proc, signal.SIGKILL)  # an exception here (a stop) must not leave it running
            proc.wait()
            forget(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def live_children() -> List[subprocess.Popen]:
    with _live_lock:
        return list(_live.values())


def end_children(grace: float = GRACE_SECONDS) -> None:
    """SIGTERM to every live child, SIGKILL to those still running after ``grace`` seconds;
    returns when all have ended."""
    children = live_children()
    for proc in children:
        _send(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(proc.poll() is None for proc in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in children:
        if proc.poll() is None:
            _send(proc, signal.SIGKILL)
            proc.wait()


def _on_signal(signum, frame) -> None:
    """SIGINT/SIGTERM: the first stops the children (in a thread: the handler must not block) and
    raises :class:`RunStopped` in the main thread; a later one kills the children at once."""
    global _stop_signal
    if _stop_signal is None:
        _stop_signal = signum  # first: from now on nothing starts
        threading.Thread(target=end_children, name="end-children", daemon=True).start()
        raise RunStopped(signum)
    for proc in live_children():
        _send(proc, signal.SIGKILL)


def _is_fairseq_train(proc: subprocess.Popen) -> bool:
    return TRAIN_MODULE in [str(arg) for arg in proc.args]


def request_checkpoints() -> List[int]:
    """Sends :data:`SAVE_SIGNAL` to every live fairseq-train child (each saves ``checkpoint_last.pt`` after
    its current update and trains on); returns their PIDs."""
    asked = [proc for proc in live_children() if _is_fairseq_train(proc) and proc.poll() is None]
    for proc in asked:
        _send(proc, SAVE_SIGNAL)
    return [proc.pid for proc in asked]


def _on_save_signal(signum, frame) -> None:
    pids = request_checkpoints()
    logger.info("%s: %s", signal.Signals(signum).name,
                f"asked fairseq-train ({', '.join(map(str, pids))}) to save checkpoint_last.pt after the update in "
                f"progress" if pids else "no fairseq-train running, nothing to save")


@contextlib.contextmanager
def stop_on_signals(grace: float = GRACE_SECONDS):
    """Within the block, SIGINT and SIGTERM stop the children and raise :class:`RunStopped`, and SIGUSR1
    asks the fairseq-train children for a checkpoint (see the module); on leaving, every child has ended.
    Installed from the main thread only (elsewhere, and when nested, the block runs as it is); the earlier
    handlers come back on leaving."""
    global _stop_signal, _handling
    if _handling or threading.current_thread() is not threading.main_thread():
        yield
        return
    _handling, _stop_signal = True, None
    previous = {signum: signal.signal(signum, _on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    previous[SAVE_SIGNAL] = signal.signal(SAVE_SIGNAL, _on_save_signal)
    try:
        yield
    finally:
        try:
            if _stop_signal is not None:
                end_children(grace)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            _handling, _stop_signal = False, None
