"""Running fairseq's command-line tools from the experiments, with this package as ``--user-dir``."""

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import child_processes

#: The directory of the imported copy of this package (this module is part of it): the ``--user-dir``
#: of the fairseq subprocesses, so that they load the same checkout (a pinned git worktree included)
#: as the process that starts them.
PACKAGE_DIR = Path(__file__).resolve().parent.parent


_local = threading.local()


@contextlib.contextmanager
def intra_op_threads(n: int):
    """Within the block, fairseq processes started from this thread get ``OMP_NUM_THREADS=n``
    (torch's intra-op threads), so that runs side by side share the cores instead of fighting for them."""
    before = getattr(_local, "threads", None)
    _local.threads = int(n)
    try:
        yield
    finally:
        _local.threads = before


def subprocess_env() -> Dict[str, str]:
    """The environment of a fairseq subprocess: this one's, with :func:`intra_op_threads`' setting."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # progress lines as they happen, not in 8 KB blocks
    if getattr(_local, "threads", None):
        env["OMP_NUM_THREADS"] = str(_local.threads)
    return env


def fairseq_command(tool: str, args: Sequence[str], user_dir: bool = True) -> List[str]:
    """``[python, -m, fairseq_cli.<tool>, *args]`` (tool: preprocess, train, generate)."""
    cmd = [sys.executable, "-m", f"fairseq_cli.{tool}", *map(str, args)]
    if user_dir and tool != "preprocess":
        cmd += ["--user-dir", str(PACKAGE_DIR)]
    return cmd


_VALID_LINE = re.compile(r"\| valid on '([^']+)' subset \| (.*)$")
_EPOCH = re.compile(r"epoch (\d+)\s*$")


def parse_valid_line(line: str) -> Optional[Tuple[str, Dict[str, str]]]:
    """``(subset, fields)`` of a fairseq validation log line (``--log-format simple``), else None.

    ``fields`` maps each logged name (``loss``, ``nll_loss``, ``num_updates``, ...) to its text,
    and ``epoch`` to the epoch logged before the subset.
    """
    match = _VALID_LINE.search(line.rstrip())
    if not match:
        return None
    fields = dict(part.partition(" ")[::2] for part in match.group(2).split(" | "))
    epoch = _EPOCH.search(line[:match.start()])
    if epoch:
        fields["epoch"] = epoch.group(1)
    return match.group(1), fields


def progress_line(label: str, line: str) -> Optional[str]:
    """A one-line summary of a fairseq validation log line (``None`` for any other line)."""
    parsed = parse_valid_line(line)
    if not parsed or not {"epoch", "loss", "num_updates"} <= parsed[1].keys():
        return None
    fields = parsed[1]
    return f"{label}: epoch {int(fields['epoch'])}, update {fields['num_updates']}: valid loss {fields['loss']}"


def run_logged(cmd: Sequence[str], log_path: Optional[Path] = None, echo: bool = True,
               progress: Optional[str] = None, on_start: Optional[Callable[[subprocess.Popen], None]] = None) -> str:
    """Runs ``cmd``, keeping a copy of its output (fairseq's progress logging) in ``log_path``.

    The process is started with :func:`.child_processes.start`: a stop request (SIGINT, SIGTERM)
    ends it, and on Linux it dies with this thread.

    Args:
        echo: print every output line as it comes.
        progress: with ``echo=False``, print one line per validation, labelled ``progress``.
        on_start: called with the process once it runs (e.g. to record its PID in a lock).
    Raises:
        RuntimeError: on a non-zero exit, with the tail of the output.
        RunStopped: a stop was requested before or while it ran (nothing started, or it was ended).
    """
    lines: List[str] = []
    log = open(log_path, "a", encoding="utf-8", buffering=1) if log_path else None  # line-buffered: tail -f works
    try:
        with child_processes.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=subprocess_env()) as proc:
            try:
                if on_start:
                    on_start(proc)
                for line in proc.stdout:
                    lines.append(line)
                    if log:
                        log.write(line)
                    summary = progress_line(progress, line) if progress and not echo else None
                    if echo or summary:
                        sys.stdout.write(line if echo else summary + "\n")
                        sys.stdout.flush()
            except BaseException:  # a stop, or a failed write: it must not outlive this thread's wait
                proc.kill()
                raise
            finally:
                proc.wait()
                child_processes.forget(proc)  # raises RunStopped where a stop ended it
        if proc.returncode != 0:
            tail = "".join(lines[-40:])
            raise RuntimeError(f"command failed with exit code {proc.returncode}: {' '.join(cmd)}\n{tail}")
    finally:
        if log:
            log.close()
    return "".join(lines)


def binarize_generated_corpus(work: Path, splits=None, joined_dictionary: bool = False, corpus: str = "toy") -> Path:
    """An embedded generated corpus -> ``work/raw`` (text) and ``work/bin`` (fairseq binary data).

    Both steps are skipped when their output exists (the writers refuse to overwrite different
    text; a ``bin`` without its last file is redone, when it holds nothing but what this step writes).

    Args:
        splits: ``{split: (pairs, seed)}`` for the corpus writer (default: its standard sizes).
        corpus: ``"toy"`` (:mod:`fairseq_softtopk.data.toy_language_pair`, short and easy: tests)
            or ``"demo"`` (:mod:`fairseq_softtopk.data.demo_language_pair`, the main job's).
    Returns:
        ``work/bin``.
    Raises:
        ValueError: ``work/bin`` is incomplete and holds files this step does not write (someone
            else's): it is left as it is.
    """
    from fairseq_softtopk.data import demo_language_pair, toy_language_pair

    writers = {"toy": (toy_language_pair.write_toy_corpus, toy_language_pair.SPLITS),
               "demo": (demo_language_pair.write_demo_corpus, demo_language_pair.DEMO_SPLITS)}
    if corpus not in writers:
        raise ValueError(f"corpus must be one of {sorted(writers)}, got {corpus!r}")
    write, default_splits = writers[corpus]
    splits = splits or default_splits
    raw, data_bin = Path(work) / "raw", Path(work) / "bin"
    write(raw, splits=splits)
    last = list(splits)[-1]
    if not (data_bin / f"{last}.src-tgt.tgt.idx").exists():
        _remove_partial_output(data_bin, splits)
        prefixes = [arg for split, flag in (("train", "--trainpref"), ("valid", "--validpref"), ("test", "--testpref"))
                    if split in splits for arg in (flag, raw / split)]
        run_logged(fairseq_command("preprocess", ["--source-lang", "src", "--target-lang", "tgt", *prefixes,
                                                  "--destdir", data_bin, "--workers", "2"]
                                   + (["--joined-dictionary"] if joined_dictionary else [])), echo=False)
    return data_bin


def _remove_partial_output(data_bin: Path, splits) -> None:
    """Removes an incomplete ``data_bin`` of :func:`binarize_generated_corpus`; ``ValueError`` (and
    nothing removed) where it holds a file that fairseq-preprocess of ``splits`` does not write."""
    if not data_bin.exists():
        return
    ours = {"dict.src.txt", "dict.tgt.txt", "preprocess.log"} | {
        f"{split}.src-tgt.{lang}.{ext}" for split in splits for lang in ("src", "tgt") for ext in ("bin", "idx")}
    foreign = sorted(path.name for path in data_bin.iterdir() if path.name not in ours) if data_bin.is_dir() else []
    if foreign or not data_bin.is_dir():
        raise ValueError(f"{data_bin} is not an incomplete binarisation of the generated corpus (it holds "
                         f"{', '.join(foreign[:5]) or 'a file'}{', ...' if len(foreign) > 5 else ''}): left as it is; "
                         f"move it away or pass another work directory")
    shutil.rmtree(data_bin)
