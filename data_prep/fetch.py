"""Archives: resumable download, checksum and integrity checks, corpus extraction.

A corpus side is named by a *spec*: ``ARCHIVE::MEMBER`` for a member of a tar archive
(``training-parallel-nc-v9.tgz::training/news-commentary-v9.fr-en.fr``) or a plain ``PATH``.
A name ending in ``.gz`` is decompressed, one ending in ``.sgm`` is converted to text the way
sacrebleu does it (the text of each ``<seg>``, whitespace collapsed), anything else is copied
byte for byte, so that the raw references are exactly what sacrebleu scores against.
"""

import gzip
import hashlib
import http.client
import logging
import os
import re
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import BinaryIO, Dict, Iterator, List, Optional, Sequence, Tuple

from data_prep.state import PrepError

logger = logging.getLogger("data_prep")

_SEG = re.compile(r"<seg.*?>(.*)</seg>.*?")
_CONTENT_RANGE_TOTAL = re.compile(r"/(\d+)\s*$")
_CORRUPT = (tarfile.TarError, EOFError, OSError, zlib.error)


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest (``md5``, ``sha256``) of a file."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_checksum(path: Path, checksum: str) -> None:
    """Checks ``path`` against ``ALGORITHM:HEX`` (``md5:...``, ``sha256:...``).

    Raises:
        PrepError: on a mismatch, naming the file and both digests.
    """
    algorithm, _, expected = checksum.partition(":")
    if algorithm not in ("md5", "sha256") or not expected:
        raise ValueError(f"checksum must be md5:HEX or sha256:HEX, got {checksum!r}")
    actual = file_digest(path, algorithm)
    if actual != expected.lower():
        raise PrepError(f"checksum mismatch for {path}: {algorithm} {actual}, expected {expected}; "
                        f"the file is corrupt or not the expected release: delete it and download it again")


def _response_total(resp, offset: int) -> Optional[int]:
    """Full size of the remote file from Content-Range (206) or Content-Length (200)."""
    if resp.status == 206:
        match = _CONTENT_RANGE_TOTAL.search(resp.headers.get("Content-Range", ""))
        return int(match.group(1)) if match else None
    length = resp.headers.get("Content-Length")
    return int(length) + offset if length is not None else None


def _download_once(url: str, part: Path, timeout: float) -> Optional[int]:
    """Appends the rest of ``url`` to ``part`` (HTTP Range); returns the remote size if known."""
    from tqdm import tqdm

    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "fairseq-softtopk-data-prep"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as err:
        total = _CONTENT_RANGE_TOTAL.search(err.headers.get("Content-Range", "") if err.headers else "")
        if err.code == 416 and total and int(total.group(1)) == offset:
            return offset  # the previous run had received every byte
        raise
    with resp:
        if offset and resp.status != 206:
            logger.warning("%s ignores Range requests; downloading it from the start", url)
            offset = 0
        total = _response_total(resp, offset)
        with open(part, "ab" if offset else "wb") as f, tqdm(
                total=total, initial=offset, unit="B", unit_scale=True, desc=part.name, mininterval=1.0) as bar:
            for block in iter(lambda: resp.read(1 << 20), b""):
                f.write(block)
                bar.update(len(block))
    return total


def download(url: str, dest: Path, checksum: Optional[str] = None, retries: int = 5,
             timeout: float = 60.0, retry_wait: float = 2.0) -> None:
    """Downloads ``url`` to ``dest``, resuming ``dest.part`` from earlier attempts or runs.

    A failed attempt (connection error, server error, connection closed early) is resumed after
    ``retry_wait * 2**(attempt - 1)`` seconds (at most a minute), up to ``retries`` attempts.

    The size received must equal the size the server announced, and ``checksum``
    (``ALGORITHM:HEX``) must match, before ``dest.part`` is renamed to ``dest``.

    Raises:
        PrepError: when the server refuses the request, after ``retries`` failed attempts, or on a
            size or checksum mismatch (the file is then kept as ``dest.corrupt``).
    """
    part, bad = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".corrupt")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, retries + 1):
        try:
            total = _download_once(url, part, timeout)
            if total is None or part.stat().st_size >= total:
                break
            last = IOError(f"connection closed after {part.stat().st_size} of {total} bytes")
        except urllib.error.HTTPError as err:
            if err.code < 500:
                raise PrepError(f"cannot download {url}: HTTP {err.code} {err.reason}") from err
            last = err
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            last = err  # connection refused or reset, timeout, truncated response: resume
        logger.warning("download of %s failed (attempt %d/%d): %s", url, attempt, retries, last)
        if attempt < retries:
            time.sleep(min(60.0, retry_wait * 2 ** (attempt - 1)))
    else:
        raise PrepError(f"could not download {url} after {retries} attempts ({last}); "
                        f"run again to resume from {part}, or fetch it yourself and use --raw-dir")
    size = part.stat().st_size
    if total is not None and size != total:
        os.replace(part, bad)
        raise PrepError(f"download of {url} has {size} bytes, the server announced {total}; "
                        f"kept as {bad}, run again to download it anew")
    if checksum:
        try:
            check_checksum(part, checksum)
        except PrepError as err:
            os.replace(part, bad)
            raise PrepError(f"download of {url}: {err}; kept as {bad}") from err
    os.replace(part, dest)


def _drain(stream: BinaryIO) -> None:
    for _ in iter(lambda: stream.read(1 << 20), b""):
        pass


def verify_archive(path: Path) -> List[str]:
    """Reads an archive to the end (gzip CRC, tar headers); returns the tar member names.

    Raises:
        PrepError: if ``path`` is missing or cannot be read to the end.
    """
    if not path.is_file():
        raise PrepError(f"missing archive {path}")
    name = path.name
    try:
        if name.endswith((".tgz", ".tar.gz", ".tar")):
            with open(path, "rb") as raw:
                stream = gzip.GzipFile(fileobj=raw) if not name.endswith(".tar") else raw
                with tarfile.open(fileobj=stream, mode="r|") as tar:
                    members = [m.name for m in tar]
                _drain(stream)  # reaches the gzip trailer, so the CRC is checked
            if not members:
                raise PrepError(f"corrupt archive {path}: no members")
            return members
        if name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                _drain(f)
        return []
    except _CORRUPT as err:
        raise PrepError(f"corrupt archive {path}: {err}; delete it and download it again") from err


def split_spec(spec: str, raw_dir: Path) -> Tuple[Path, Optional[str]]:
    """``ARCHIVE::MEMBER`` or ``PATH`` -> (path, member); relative paths are under ``raw_dir``."""
    path, sep, member = spec.partition("::")
    full = Path(path) if os.path.isabs(path) else raw_dir / path
    return full, (member if sep else None)


def iter_lines(stream: BinaryIO, name: str) -> Iterator[bytes]:
    """Lines of ``stream`` (each ending in ``\\n``), decompressed / converted by ``name``."""
    if name.endswith(".gz"):
        stream = gzip.GzipFile(fileobj=stream)
        name = name[:-3]
    if name.endswith(".sgm"):
        for raw in stream:
            line = raw.decode("utf-8", errors="replace")
            if line.startswith("<seg "):
                text = re.sub(r"\s+", " ", _SEG.sub(r"\1", line).strip())
                yield (text + "\n").encode("utf-8")
        return
    for line in stream:
        yield line if line.endswith(b"\n") else line + b"\n"


class SplitWriter:
    """Writes lines to ``train``, and every ``valid_every``-th line (1-based) to ``valid``."""

    def __init__(self, train: BinaryIO, valid: Optional[BinaryIO] = None, valid_every: int = 0):
        if valid_every and valid is None:
            raise ValueError("valid_every needs a valid file")
        self.train, self.valid, self.valid_every, self.n = train, valid, valid_every, 0

    def write(self, line: bytes) -> None:
        self.n += 1
        to_valid = self.valid_every and self.n % self.valid_every == 0
        (self.valid if to_valid else self.train).write(line)


def _copy_side(stream: BinaryIO, name: str, writer: SplitWriter, where: str) -> int:
    before = writer.n
    try:
        for line in iter_lines(stream, name):
            writer.write(line)
    except _CORRUPT as err:
        raise PrepError(f"corrupt data in {where}: {err}; delete the archive and download it again") from err
    return writer.n - before


def copy_corpus(specs: Sequence[str], raw_dir: Path, writers: Sequence[SplitWriter]) -> List[int]:
    """Appends one corpus (one spec per language) to ``writers``; returns the lines per side.

    Raises:
        PrepError: on a missing archive, member or file, or on corrupt data.
    """
    counts = [0] * len(specs)
    by_archive: Dict[Path, Dict[str, int]] = {}
    for side, spec in enumerate(specs):
        path, member = split_spec(spec, raw_dir)
        if not path.is_file():
            raise PrepError(f"missing {'archive' if member else 'file'} {path} (needed for {spec})")
        if member is None:
            with open(path, "rb") as f:
                counts[side] = _copy_side(f, path.name, writers[side], str(path))
        else:
            by_archive.setdefault(path, {})[member] = side
    for archive, wanted in by_archive.items():
        found = set()
        try:
            with tarfile.open(archive, mode="r|*") as tar:
                for info in tar:
                    name = info.name.removeprefix("./")
                    if name in wanted and info.isfile():
                        side = wanted[name]
                        counts[side] = _copy_side(tar.extractfile(info), name, writers[side], f"{archive}::{name}")
                        found.add(name)
                        if len(found) == len(wanted):
                            break  # the rest of the archive holds other language pairs
        except _CORRUPT as err:
            raise PrepError(f"corrupt archive {archive}: {err}; delete it and download it again") from err
        missing = sorted(set(wanted) - found)
        if missing:
            raise PrepError(f"archive {archive} has no member {', '.join(missing)}")
    return counts


def collect(corpora: Sequence[Sequence[str]], raw_dir: Path, train: Sequence[Path],
            valid: Sequence[Path] = (), valid_every: int = 0) -> int:
    """Concatenates parallel corpora into ``train`` (one file per language).

    Args:
        corpora: one list of specs per corpus, one spec per language, in ``train``'s order.
        raw_dir: directory of the archives named by relative specs.
        train: output files, one per language.
        valid: with ``valid_every``, every ``valid_every``-th line goes there instead.

    Returns:
        Lines written per language (train and valid together).

    Raises:
        PrepError: when the sides of a corpus differ in line count (both are named), or on a
            missing or corrupt archive.
    """
    files = [open(p, "wb") for p in [*train, *valid]]
    try:
        n = len(train)
        writers = [SplitWriter(files[i], files[n + i] if valid_every else None, valid_every)
                   for i in range(n)]
        for specs in corpora:
            counts = copy_corpus(specs, raw_dir, writers)
            if len(set(counts)) != 1:
                listing = ", ".join(f"{spec}: {c} lines" for spec, c in zip(specs, counts))
                raise PrepError(f"mismatched line counts between the sides of a corpus: {listing}")
            logger.info("%s: %d lines", " + ".join(specs), counts[0])
        return writers[0].n
    finally:
        for f in files:
            f.close()
