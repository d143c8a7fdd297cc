"""Line-by-line text processing in parallel: Moses normalisation + tokenisation, cleaning.

:func:`map_lines` runs a per-line function over ``--workers`` processes, in chunks, keeping the
line order and at most two windows of chunks in memory, with a tqdm progress bar. The per-line
function is built in each worker by a *factory* (a module-level function, so that it can be
pickled), e.g. :func:`moses_line_tokenizer`.
"""

import logging
import multiprocessing
import time
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Sequence, Tuple

from data_prep.state import PrepError, check_same_line_count, count_lines
from fairseq_softtopk.experiments.source_segmentation import moses_line_tokenizer

logger = logging.getLogger("data_prep")

LineFn = Callable[[str], str]
CHUNK_SIZE = 1000  # lines per task sent to a worker
_LINE_FN: LineFn = None  # set in each worker by _init_worker


def _init_worker(factory: Callable[..., LineFn], args: tuple) -> None:
    global _LINE_FN
    _LINE_FN = factory(*args)


def _process_chunk(lines: List[str]) -> List[str]:
    # Output lines must stay single lines for fairseq, which also splits on "\r".
    return [_LINE_FN(line.rstrip("\n")).replace("\r", " ").replace("\n", " ") + "\n" for line in lines]


def _chunks(lines: Iterable[str], size: int) -> Iterator[List[str]]:
    it = iter(lines)
    while chunk := list(islice(it, size)):
        yield chunk


def _parallel(chunks: Iterator[List[str]], workers: int, factory, args) -> Iterator[List[str]]:
    """Chunks processed by a pool; one window is computed while the previous one is written."""
    with multiprocessing.Pool(workers, _init_worker, (factory, args)) as pool:
        pending = None
        while window := list(islice(chunks, 4 * workers)):
            job = pool.map_async(_process_chunk, window)
            if pending is not None:
                yield from pending.get()
            pending = job
        if pending is not None:
            yield from pending.get()


def effective_workers(lines: int, workers: int, chunk_size: int = CHUNK_SIZE) -> int:
    """No more processes than chunks: a small file is processed here, without a pool."""
    return max(1, min(workers, -(-lines // chunk_size)))


def map_lines(src: Path, dst: Path, factory: Callable[..., LineFn], args: tuple, workers: int,
              desc: str, chunk_size: int = CHUNK_SIZE) -> int:
    """Writes ``fn(line)`` for every line of ``src`` to ``dst``, ``fn = factory(*args)``.

    Args:
        workers: processes; 1 runs in this process, and so does a file of one chunk.

    Returns:
        The number of lines (equal in ``src`` and ``dst``).
    """
    from tqdm import tqdm

    total = count_lines(src)
    workers = effective_workers(total, workers, chunk_size)
    _init_worker(factory, args)  # here too: forked workers then inherit the imports
    with open(src, encoding="utf-8", errors="replace", newline="\n") as fin, \
            open(dst, "w", encoding="utf-8", newline="\n") as fout, \
            tqdm(total=total, desc=desc, unit=" sent", mininterval=1.0) as bar:
        chunks = _chunks(fin, chunk_size)
        if workers > 1:
            results = _parallel(chunks, workers, factory, args)
        else:
            results = map(_process_chunk, chunks)
        for out in results:
            fout.writelines(out)
            bar.update(len(out))
    written = count_lines(dst)
    if written != total:
        raise RuntimeError(f"{dst} has {written} lines, {src} has {total}")
    return total


def tokenize_file(src: Path, dst: Path, lang: str, workers: int, desc: str = "") -> dict:
    """Normalises and tokenises ``src`` into ``dst``; logs and returns the sentences/s."""
    start = time.perf_counter()
    n = map_lines(src, dst, moses_line_tokenizer, (lang,), workers, desc or f"tokenise {src.name}")
    seconds = time.perf_counter() - start
    rate = n / seconds if seconds > 0 else float("inf")
    used = effective_workers(n, workers)
    logger.info("tokenised %s: %d sentences in %.1f s = %.0f sentences/s, workers=%d",
                src, n, seconds, rate, used)
    return {"sentences": n, "seconds": round(seconds, 3), "sentences_per_s": round(rate, 1), "workers": used}


def keep_pair(src_line: str, tgt_line: str, min_len: int, max_len: int, ratio: float) -> bool:
    """The rule of Moses ``clean-corpus-n.perl``: both sides have ``min_len..max_len`` tokens and
    neither is more than ``ratio`` times longer than the other."""
    n_src, n_tgt = len(src_line.split()), len(tgt_line.split())
    if not (min_len <= n_src <= max_len and min_len <= n_tgt <= max_len):
        return False
    return n_src <= ratio * n_tgt and n_tgt <= ratio * n_src


def clean_corpus(inputs: Sequence[Path], outputs: Sequence[Path], min_len: int, max_len: int,
                 ratio: float) -> Tuple[int, int]:
    """Copies the sentence pairs that pass :func:`keep_pair`; returns (kept, total).

    Raises:
        PrepError: if the two inputs differ in line count, or nothing is kept.
    """
    if len(inputs) != 2 or len(outputs) != 2:
        raise ValueError(f"clean_corpus needs two inputs and two outputs, got {inputs}, {outputs}")
    if min_len < 1 or max_len < min_len or ratio < 1:
        raise ValueError(f"need 1 <= min_len <= max_len and ratio >= 1, got {min_len}, {max_len}, {ratio}")
    total = check_same_line_count(inputs)
    kept = 0
    opts = {"encoding": "utf-8", "newline": "\n"}
    with open(inputs[0], **opts) as fs, open(inputs[1], **opts) as ft, \
            open(outputs[0], "w", **opts) as gs, open(outputs[1], "w", **opts) as gt:
        for s, t in zip(fs, ft):
            if keep_pair(s, t, min_len, max_len, ratio):
                gs.write(s)
                gt.write(t)
                kept += 1
    if kept == 0:
        raise PrepError(f"cleaning kept no sentence pair of {inputs[0]} / {inputs[1]}")
    logger.info("cleaned %s: kept %d of %d pairs (%.1f%%)", inputs[0], kept, total, 100.0 * kept / max(total, 1))
    return kept, total
