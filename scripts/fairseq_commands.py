"""Running fairseq's command-line tools from scripts, with this package as ``--user-dir``."""

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "fairseq_softtopk"


def fairseq_command(tool: str, args: Sequence[str], user_dir: bool = True) -> List[str]:
    """``[python, -m, fairseq_cli.<tool>, *args]`` (tool: preprocess, train, generate)."""
    cmd = [sys.executable, "-m", f"fairseq_cli.{tool}", *map(str, args)]
    if user_dir and tool != "preprocess":
        cmd += ["--user-dir", str(PACKAGE_DIR)]
    return cmd


def run_logged(cmd: Sequence[str], log_path: Optional[Path] = None, echo: bool = True) -> str:
    """Runs ``cmd``, echoing its output (fairseq's progress logging) and keeping a copy.

    Raises:
        RuntimeError: on a non-zero exit, with the tail of the output.
    """
    lines: List[str] = []
    log = open(log_path, "a", encoding="utf-8") if log_path else None
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # progress lines as they happen, not in 8 KB blocks
        with subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
            for line in proc.stdout:
                lines.append(line)
                if log:
                    log.write(line)
                if echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
        if proc.returncode != 0:
            tail = "".join(lines[-40:])
            raise RuntimeError(f"command failed with exit code {proc.returncode}: {' '.join(cmd)}\n{tail}")
    finally:
        if log:
            log.close()
    return "".join(lines)


def binarize_toy_corpus(work: Path, splits=None, joined_dictionary: bool = False) -> Path:
    """The embedded toy corpus -> ``work/raw`` (text) and ``work/bin`` (fairseq binary data).

    Both steps are skipped when their output exists (``write_toy_corpus`` refuses to overwrite
    different text; a ``bin`` without its last file is redone).

    Args:
        splits: ``{split: (pairs, seed)}`` for ``write_toy_corpus`` (default: its standard sizes).
    Returns:
        ``work/bin``.
    """
    import shutil

    from fairseq_softtopk.data.toy_language_pair import SPLITS, write_toy_corpus

    splits = splits or SPLITS
    raw, data_bin = Path(work) / "raw", Path(work) / "bin"
    write_toy_corpus(raw, splits=splits)
    last = list(splits)[-1]
    if not (data_bin / f"{last}.src-tgt.tgt.idx").exists():
        shutil.rmtree(data_bin, ignore_errors=True)
        prefixes = [arg for split, flag in (("train", "--trainpref"), ("valid", "--validpref"), ("test", "--testpref"))
                    if split in splits for arg in (flag, raw / split)]
        run_logged(fairseq_command("preprocess", ["--source-lang", "src", "--target-lang", "tgt", *prefixes,
                                                  "--destdir", data_bin, "--workers", "2"]
                                   + (["--joined-dictionary"] if joined_dictionary else [])), echo=False)
    return data_bin
