"""``fairseq-preprocess --joined-dictionary`` and a sentence-count check of its output.

fairseq-preprocess writes ``DEST/{split}.{src}-{tgt}.{lang}.{bin,idx}`` with ``split`` in
``train``, ``valid``, ``test``, ``test1``, ... (one per test prefix, in order), plus the shared
dictionary as ``dict.{src}.txt`` and ``dict.{tgt}.txt``.
"""

import logging
import struct
import subprocess
import sys
from pathlib import Path
from typing import Dict, Sequence

from data_prep.state import PrepError, check_same_line_count

logger = logging.getLogger("data_prep")

_MMAP_MAGIC = b"MMIDIDX\x00\x00"


def indexed_length(idx: Path) -> int:
    """Number of sentences in a fairseq ``mmap`` dataset index (the ``.idx`` file header:
    9-byte magic, ``<Q`` version, ``<B`` dtype code, ``<Q`` length)."""
    with open(idx, "rb") as f:
        header = f.read(26)
    if len(header) < 26 or header[:9] != _MMAP_MAGIC:
        raise PrepError(f"{idx} is not a fairseq mmap index")
    return struct.unpack("<Q", header[18:26])[0]


def split_names(test_prefixes: Sequence[str]) -> Dict[str, str]:
    """fairseq's split names for the test prefixes: ``test``, ``test1``, ``test2``, ..."""
    return {(f"test{i}" if i else "test"): p for i, p in enumerate(test_prefixes)}


def fairseq_preprocess(src: str, tgt: str, train: str, valid: str, tests: Sequence[str], destdir: Path,
                       workers: int) -> Dict[str, int]:
    """Binarises ``{prefix}.{src}`` / ``{prefix}.{tgt}`` with one dictionary for both languages.

    Returns:
        Sentences per split.

    Raises:
        PrepError: if the two sides of a split differ in line count, fairseq-preprocess fails, or
            a binarised split does not hold exactly the lines of its text file.
    """
    splits = {"train": train, "valid": valid, **split_names(tests)}
    lines = {name: check_same_line_count([Path(f"{p}.{src}"), Path(f"{p}.{tgt}")], f"the {name} split")
             for name, p in splits.items()}
    cmd = [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", src, "--target-lang", tgt,
           "--trainpref", train, "--validpref", valid, "--destdir", str(destdir),
           "--joined-dictionary", "--workers", str(workers)]
    if tests:
        cmd += ["--testpref", ",".join(tests)]
    logger.info("%s", " ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise PrepError(f"fairseq-preprocess failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    for name, n in lines.items():
        for lang in (src, tgt):
            idx = destdir / f"{name}.{src}-{tgt}.{lang}.idx"
            if not idx.exists():
                raise PrepError(f"fairseq-preprocess did not write {idx}")
            got = indexed_length(idx)
            if got != n:
                raise PrepError(f"{idx} holds {got} sentences, {splits[name]}.{lang} has {n} lines")
    logger.info("binarised into %s: %s", destdir, ", ".join(f"{k} {v}" for k, v in lines.items()))
    return lines
