"""data_prep/: the prepare_*.sh scripts end to end on tiny archives with the real layout, and
the steps they are built from.

The archives are built here: ``.tgz`` files with the members' real paths, newstest ``.sgm``
files, Multi30k's ``.gz`` files; the scripts read them through ``--raw-dir`` / ``--local`` and
never touch the network. Target sentences are word-by-word "translations" of the source (token
counts within a ratio of 1.5), so that cleaning removes exactly the pairs planted for it.
"""

import gzip
import hashlib
import io
import os
import random
import shutil
import subprocess
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # data_prep/ is a directory of the repository, not an installed package

from data_prep import fetch, state, text  # noqa: E402

SCRIPTS = ("prepare_wmt14_en_fr.sh", "prepare_wmt16_en_de.sh", "prepare_multi30k.sh")
WORDS = ("a the man dog girl woman child runs jumps sits looks at on in under near with green red "
         "white old young small big street park water grass ball hat bench city").split()
# Split by the tokeniser (dashes, quotes, &, %), but without apostrophes, whose splitting
# differs between en, fr and de.
SPECIAL = ("well-known", "“quoted”", "R&D", "café", "e-mail", "50%")

Pair = Tuple[str, str]


# ---------------------------------------------------------------------------------------------
# Tiny corpora and archives


@pytest.fixture(scope="module")
def seed() -> int:
    """Seed of every random corpus here (each builder makes its own ``random.Random``)."""
    return 20261122


def translate(words: Sequence[str], lang: str) -> List[str]:
    """A fake translation, one word per word: reversed (fr) or suffixed (de)."""
    return [w[::-1] if lang == "fr" else w + "en" for w in words]


def sentence(words: Sequence[str], end: str, lang: str) -> str:
    """``words`` in ``lang`` (``en`` untouched), capitalised, with the end punctuation."""
    text_ = " ".join(words if lang == "en" else translate(words, lang))
    return text_[:1].upper() + text_[1:] + end


def make_sentences(rng: random.Random, n: int) -> List[Tuple[List[str], str]]:
    """``n`` random sentences of 4-12 words: (words, end punctuation)."""
    return [([rng.choice(WORDS) if rng.random() < 0.85 else rng.choice(SPECIAL)
              for _ in range(rng.randint(4, 12))], rng.choice(".!?")) for _ in range(n)]


def make_pairs(rng: random.Random, n: int, lang: str) -> List[Pair]:
    """``n`` (English, ``lang``) sentence pairs; token counts differ by at most a third."""
    return [(sentence(w, end, "en"), sentence(w, end, lang)) for w, end in make_sentences(rng, n)]


def bad_pairs(lang: str) -> List[Pair]:
    """Pairs that cleaning (length 1-250, ratio 1.5) must drop: empty, 1:3 and too long."""
    long = ["dog"] * 260
    return [("", ""), ("Dog runs.", sentence("a dog runs in the big park".split(), ".", lang)),
            (sentence(long, ".", "en"), sentence(long, ".", lang))]


def lines_bytes(lines: Sequence[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8")


def write_tar(path: Path, members: Dict[str, bytes]) -> None:
    """A tar archive (gzipped for ``.tgz``) with the given member paths."""
    with tarfile.open(path, "w:gz" if path.name.endswith(".tgz") else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1400000000
            tar.addfile(info, io.BytesIO(data))


def sgm(lines: Sequence[str], setid: str, lang: str, role: str) -> bytes:
    """A WMT newstest ``.sgm`` file (``srcset`` or ``refset``), padded segments included."""
    tag = "srcset" if role == "src" else "refset"
    body = "".join(f'<seg id="{i + 1}">  {line} </seg>\n' for i, line in enumerate(lines))
    text_ = (f'<{tag} setid="{setid}" srclang="any" trglang="{lang}">\n'
             f'<doc sysid="ref" docid="doc-1" genre="news" origlang="en">\n<p>\n{body}</p>\n</doc>\n</{tag}>\n')
    return text_.encode("utf-8")


def newstest_members(path_fmt: str, setid: str, pairs: Sequence[Pair], src: str, tgt: str) -> Dict[str, bytes]:
    """``{path_fmt(role, lang): sgm}`` for both directions, as in the real test archives."""
    members = {}
    for role, lang, lines in (("src", src, [p[0] for p in pairs]), ("ref", tgt, [p[1] for p in pairs]),
                              ("src", tgt, [p[1] for p in pairs]), ("ref", src, [p[0] for p in pairs])):
        members[path_fmt.format(role=role, l=lang)] = sgm(lines, setid, lang, role)
    return members


def parallel_members(path_fmt: str, pairs: Sequence[Pair], src: str, tgt: str) -> Dict[str, bytes]:
    return {path_fmt.format(l=src): lines_bytes([p[0] for p in pairs]),
            path_fmt.format(l=tgt): lines_bytes([p[1] for p in pairs])}


def build_wmt14(raw: Path, rng: random.Random) -> Dict[str, List[Pair]]:
    """The six WMT14 En-Fr archives with the member paths of the real ones."""
    raw.mkdir(parents=True, exist_ok=True)
    corpora = {name: make_pairs(rng, 12, "fr") for name in ("europarl", "commoncrawl", "un", "nc", "giga")}
    corpora["europarl"] += bad_pairs("fr")
    write_tar(raw / "training-parallel-europarl-v7.tgz", {
        **parallel_members("training/europarl-v7.fr-en.{l}", corpora["europarl"], "en", "fr"),
        "training/europarl-v7.de-en.de": b"Distractor.\n"})
    write_tar(raw / "training-parallel-commoncrawl.tgz", {
        **parallel_members("commoncrawl.fr-en.{l}", corpora["commoncrawl"], "en", "fr"),
        "commoncrawl.fr-en.annotation": b"x\n" * 12})
    write_tar(raw / "training-parallel-un.tgz", parallel_members("un/undoc.2000.fr-en.{l}", corpora["un"], "en", "fr"))
    write_tar(raw / "training-parallel-nc-v9.tgz",
              parallel_members("training/news-commentary-v9.fr-en.{l}", corpora["nc"], "en", "fr"))
    giga = parallel_members("giga-fren.release2.fixed.{l}", corpora["giga"], "en", "fr")
    write_tar(raw / "training-giga-fren.tar", {f"{name}.gz": gzip.compress(data) for name, data in giga.items()})
    corpora["test"] = make_pairs(rng, 15, "fr")
    write_tar(raw / "test-full.tgz", newstest_members("test-full/newstest2014-fren-{role}.{l}.sgm",
                                                      "newstest2014", corpora["test"], "en", "fr"))
    return corpora


def build_wmt16(raw: Path, rng: random.Random) -> Dict[str, List[Pair]]:
    """The six WMT16 En-De archives with the member paths of the real ones."""
    raw.mkdir(parents=True, exist_ok=True)
    corpora = {name: make_pairs(rng, 15, "de") for name in ("europarl", "commoncrawl", "nc")}
    corpora["nc"] += bad_pairs("de")
    write_tar(raw / "training-parallel-europarl-v7.tgz",
              parallel_members("training/europarl-v7.de-en.{l}", corpora["europarl"], "en", "de"))
    write_tar(raw / "training-parallel-commoncrawl.tgz",
              parallel_members("commoncrawl.de-en.{l}", corpora["commoncrawl"], "en", "de"))
    write_tar(raw / "training-parallel-nc-v11.tgz", parallel_members(
        "training-parallel-nc-v11/news-commentary-v11.de-en.{l}", corpora["nc"], "en", "de"))
    for key, archive, fmt, setid in (
            ("valid", "dev.tgz", "dev/newstest2013-{role}.{l}.sgm", "newstest2013"),
            ("test", "test-full.tgz", "test-full/newstest2014-deen-{role}.{l}.sgm", "newstest2014"),
            ("test1", "test.tgz", "test/newstest2016-ende-{role}.{l}.sgm", "newstest2016")):
        corpora[key] = make_pairs(rng, 10 if key == "valid" else 12, "de")
        write_tar(raw / archive, newstest_members(fmt, setid, corpora[key], "en", "de"))
    return corpora


def build_multi30k(local: Path, rng: random.Random) -> Dict[str, Dict[str, List[str]]]:
    """``{train,val,test_2016_flickr}.{en,de,fr}.gz``; returns ``{stem: {lang: lines}}``.
    The training files end with the pairs of :func:`bad_pairs` (for German; French alike)."""
    local.mkdir(parents=True, exist_ok=True)
    files = {}
    for stem, n in (("train", 40), ("val", 10), ("test_2016_flickr", 12)):
        sentences = make_sentences(rng, n)
        files[stem] = {lang: [sentence(w, end, lang) for w, end in sentences] for lang in ("en", "de", "fr")}
        if stem == "train":
            for lang in ("de", "fr"):
                files[stem][lang] += [p[1] for p in bad_pairs(lang)]
            files[stem]["en"] += [p[0] for p in bad_pairs("de")]
        for lang, lines in files[stem].items():
            (local / f"{stem}.{lang}.gz").write_bytes(gzip.compress(lines_bytes(lines)))
    return files


# ---------------------------------------------------------------------------------------------
# Running the scripts


def run_script(script: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}  # tests share two cores
    proc = subprocess.run(["bash", str(REPO / "data_prep" / script), *map(str, args)],
                          capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def read_lines(path: Path) -> List[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def tree_digest(root: Path) -> Dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def idx_sizes(idx: Path) -> np.ndarray:
    """Sentence lengths (tokens + EOS) from a fairseq mmap ``.idx`` file, read independently of
    data_prep: 9-byte magic, version, dtype, count, then the int32 sizes."""
    data = idx.read_bytes()
    assert data[:9] == b"MMIDIDX\x00\x00"
    count = int(np.frombuffer(data[18:26], dtype="<u8")[0])
    return np.frombuffer(data, dtype="<i4", count=count, offset=26)


def check_binarised(out: Path, src: str, tgt: str, splits: Sequence[str]) -> None:
    """Every split is binarised with exactly the lines (and token counts) of its BPE text."""
    assert (out / "bin" / f"dict.{src}.txt").read_bytes() == (out / "bin" / f"dict.{tgt}.txt").read_bytes()
    for split in splits:
        for lang in (src, tgt):
            lengths = [len(line.split()) + 1 for line in read_lines(out / "bpe" / f"{split}.{lang}")]
            assert (out / "bin" / f"{split}.{src}-{tgt}.{lang}.bin").stat().st_size > 0
            assert idx_sizes(out / "bin" / f"{split}.{src}-{tgt}.{lang}.idx").tolist() == lengths


COMMON = ("--workers", "2", "--no-checksums")


@pytest.fixture(scope="module")
def wmt14(tmp_path_factory, seed):
    root = tmp_path_factory.mktemp("wmt14")
    corpora = build_wmt14(root / "raw", random.Random(seed))
    out = root / "out"
    args = ("--raw-dir", root / "raw", "--out", out, "--bpe-size", 100, "--valid-every", 10, *COMMON)
    return args, out, corpora, run_script("prepare_wmt14_en_fr.sh", *args)


@pytest.fixture(scope="module")
def wmt16(tmp_path_factory, seed):
    root = tmp_path_factory.mktemp("wmt16")
    corpora = build_wmt16(root / "raw", random.Random(seed + 1))
    out = root / "out"
    proc = run_script("prepare_wmt16_en_de.sh", "--raw-dir", root / "raw", "--out", out,
                      "--bpe", "sentencepiece", "--bpe-size", 120, *COMMON)
    return root, out, corpora, proc


@pytest.fixture(scope="module")
def multi30k_local(tmp_path_factory, seed):
    local = tmp_path_factory.mktemp("multi30k_local")
    return local, build_multi30k(local, random.Random(seed + 2))


@pytest.fixture(scope="module")
def multi30k(tmp_path_factory, multi30k_local):
    local, files = multi30k_local
    out = tmp_path_factory.mktemp("multi30k") / "out"
    proc = run_script("prepare_multi30k.sh", "--local", local, "--out", out, "--bpe-size", 150, *COMMON)
    return out, files, proc


# ---------------------------------------------------------------------------------------------
# End to end


def moses(lines: Sequence[str], lang: str) -> List[str]:
    """Reference tokenisation, straight from sacremoses (what the scripts must produce)."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    norm, tok = MosesPunctNormalizer(lang=lang, post_remove_control_chars=True), MosesTokenizer(lang=lang)
    return [tok.tokenize(norm.normalize(line), aggressive_dash_splits=True, return_str=True, escape=True)
            for line in lines]


def undo_bpe(line: str, kind: str) -> str:
    if kind == "subword_nmt":
        return line.replace("@@ ", "")
    return "".join(line.split()).replace("\u2581", " ").strip()


def check_bpe(out: Path, split: str, tokenised: str, lang: str, kind: str) -> None:
    """BPE was applied (marks present) and is undone exactly into the tokenised text."""
    bpe = read_lines(out / "bpe" / f"{split}.{lang}")
    mark = "@@ " if kind == "subword_nmt" else "\u2581"
    assert any(mark in line for line in bpe)
    assert [undo_bpe(line, kind) for line in bpe] == read_lines(out / "tok" / f"{tokenised}.{lang}")


@pytest.mark.slow
def test_wmt14_end_to_end(wmt14):
    _, out, corpora, proc = wmt14
    train = [p for name in ("europarl", "commoncrawl", "un", "nc", "giga") for p in corpora[name]]
    held_out = train[9::10]
    kept = [p for i, p in enumerate(train) if (i + 1) % 10 and p not in bad_pairs("fr")]
    assert len(kept) == len(train) - len(held_out) - 3
    # raw: the corpora in order, every 10th line held out, references untouched
    assert read_lines(out / "raw" / "valid.fr") == [p[1] for p in held_out]
    assert read_lines(out / "raw" / "test.fr") == [p[1] for p in corpora["test"]]
    assert read_lines(out / "raw" / "test.en") == [p[0] for p in corpora["test"]]
    # tokenised and cleaned
    assert read_lines(out / "tok" / "test.fr") == moses([p[1] for p in corpora["test"]], "fr")
    assert read_lines(out / "tok" / "train.clean.en") == moses([p[0] for p in kept], "en")
    assert read_lines(out / "tok" / "train.clean.fr") == moses([p[1] for p in kept], "fr")
    assert (out / "bpe" / "codes").read_text(encoding="utf-8").count("\n") == 101  # header + 100 merges
    for split, tokenised in (("train", "train.clean"), ("valid", "valid.clean"), ("test", "test")):
        for lang in ("en", "fr"):
            check_bpe(out, split, tokenised, lang, "subword_nmt")
    check_binarised(out, "en", "fr", ("train", "valid", "test"))
    assert "sentences/s" in proc.stderr


@pytest.mark.slow
def test_wmt14_rerun_skips_every_step_and_keeps_files(wmt14):
    args, out, _, _ = wmt14
    before = tree_digest(out)
    markers = len(list((out / ".state").rglob("*.done")))
    proc = run_script("prepare_wmt14_en_fr.sh", *args)
    assert " | run " not in proc.stderr
    assert proc.stderr.count("already done") == markers > 20
    assert tree_digest(out) == before


@pytest.mark.slow
def test_wmt16_end_to_end_sentencepiece(wmt16):
    _, out, corpora, _ = wmt16
    for split in ("valid", "test", "test1"):  # newstest2013, 2014, 2016 from the sgm files
        assert read_lines(out / "raw" / f"{split}.de") == [p[1] for p in corpora[split]]
        assert read_lines(out / "raw" / f"{split}.en") == [p[0] for p in corpora[split]]
    train = [p for name in ("europarl", "commoncrawl", "nc") for p in corpora[name]]
    kept = [p for p in train if p not in bad_pairs("de")]
    assert read_lines(out / "tok" / "train.clean.de") == moses([p[1] for p in kept], "de")
    for split, tokenised in (("train", "train.clean"), ("valid", "valid.clean"), ("test", "test"),
                             ("test1", "test1")):
        check_bpe(out, split, tokenised, "de", "sentencepiece")
    assert (out / "bpe" / "spm.model").stat().st_size > 0
    check_binarised(out, "en", "de", ("train", "valid", "test", "test1"))


@pytest.mark.slow
def test_multi30k_end_to_end(multi30k):
    out, files, _ = multi30k
    for split, stem in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr")):
        for lang in ("en", "de"):
            assert read_lines(out / "raw" / f"{split}.{lang}") == files[stem][lang]
    assert read_lines(out / "tok" / "train.clean.en") == moses(files["train"]["en"][:-3], "en")
    check_bpe(out, "test", "test", "de", "sentencepiece")
    check_binarised(out, "en", "de", ("train", "valid", "test"))



@pytest.mark.slow
def test_a_source_translated_apart_from_the_corpus_is_segmented_and_decoded_as_its_test_split(multi30k, tmp_path):
    """--translate-sources' path (fairseq_softtopk.experiments.source_translation): the raw English test set,
    segmented by corpus_segmenter, is the script's BPE'd test set token for token; translated apart from the
    corpus, it is binarised byte for byte as the script's test split, and a model trained on the corpus
    (fairseq-train, 3 updates) gives the hypotheses fairseq-generate gives on that split, detokenised as the
    scoring does."""
    from conftest import run_fairseq
    from fairseq_softtopk.experiments.fairseq_commands import PACKAGE_DIR
    from fairseq_softtopk.experiments.scoring import evaluate_checkpoint
    from fairseq_softtopk.experiments.source_segmentation import corpus_segmenter
    from fairseq_softtopk.experiments.source_translation import binarise_source, translate_lines

    out, files, _ = multi30k
    raw = read_lines(out / "raw" / "test.en")
    segment = corpus_segmenter(out / "bpe", "en")
    assert [segment(line) for line in raw] == read_lines(out / "bpe" / "test.en")
    binarised = binarise_source(raw, segment, out / "bin", ("en", "de"), tmp_path / "bin")
    for suffix in ("bin", "idx"):
        assert (binarised / f"test.en-de.en.{suffix}").read_bytes() == (out / "bin" / f"test.en-de.en.{suffix}").read_bytes()
    run_fairseq("train", [out / "bin", "--user-dir", PACKAGE_DIR, "--arch", "softtopk_lstm_tiny",
                          "--criterion", "soft_beam_search", "--teacher-forcing-ratio", 1.0, "--optimizer", "adam",
                          "--lr", 0.01, "--max-update", 3, "--batch-size", 8, "--save-dir", tmp_path,
                          "--no-epoch-checkpoints", "--num-workers", 0, "--cpu", "--seed", 1])
    checkpoint = tmp_path / "checkpoint_last.pt"
    eval_cfg = {"beam": 3, "post_process": "sentencepiece", "detok_lang": "de"}
    got = translate_lines(checkpoint, out / "bin", raw, segment, ("en", "de"), 3, 1.4, eval_cfg)
    expected = evaluate_checkpoint(str(out / "bin"), str(checkpoint), str(out / "raw" / "test.de"), beam=3,
                                   post_process="sentencepiece", detok_lang="de", extra_args=["--lenpen", "1.4"],
                                   keep_hypotheses=True)["hypotheses"]
    assert got == expected and len(got) == len(raw) == 12


# ---------------------------------------------------------------------------------------------
# Errors: each stops with a message naming the file, and changes nothing it did not make


def failed(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} not in:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_and_bad_options(script, tmp_path):
    proc = run_script(script, "--help")
    assert proc.returncode == 0 and "Usage:" in proc.stdout and "--out DIR" in proc.stdout
    failed(run_script(script, check=False), "--out DIR is required")
    failed(run_script(script, "--out", tmp_path / "o", "--bogus", "1", check=False), "unknown option '--bogus'")
    failed(run_script(script, "--out", tmp_path / "o", "--bpe", "wordpiece", check=False), "unknown --bpe 'wordpiece'")
    assert not (tmp_path / "o").exists()


def test_unknown_language_pair(tmp_path, multi30k_local):
    proc = run_script("prepare_multi30k.sh", "--local", multi30k_local[0], "--out", tmp_path / "o",
                      "--pair", "en-cs", check=False)
    failed(proc, "unknown language pair 'en-cs'")
    assert not (tmp_path / "o").exists()


def test_mismatched_line_count_in_archive(tmp_path, seed):
    corpora = build_wmt14(tmp_path / "raw", random.Random(seed))
    members = parallel_members("training/news-commentary-v9.fr-en.{l}", corpora["nc"], "en", "fr")
    members["training/news-commentary-v9.fr-en.fr"] = lines_bytes([p[1] for p in corpora["nc"][:-1]])
    write_tar(tmp_path / "raw" / "training-parallel-nc-v9.tgz", members)
    proc = run_script("prepare_wmt14_en_fr.sh", "--raw-dir", tmp_path / "raw", "--out", tmp_path / "out",
                      *COMMON, check=False)
    failed(proc, "mismatched line counts",
           "training-parallel-nc-v9.tgz::training/news-commentary-v9.fr-en.fr: 11 lines",
           "training-parallel-nc-v9.tgz::training/news-commentary-v9.fr-en.en: 12 lines")
    assert not (tmp_path / "out" / "raw" / "train.en").exists()


def test_mismatched_line_count_in_gz(tmp_path, seed):
    files = build_multi30k(tmp_path / "local", random.Random(seed))
    (tmp_path / "local" / "val.de.gz").write_bytes(gzip.compress(lines_bytes(files["val"]["de"][:-1])))
    proc = run_script("prepare_multi30k.sh", "--local", tmp_path / "local", "--out", tmp_path / "out",
                      *COMMON, check=False)
    failed(proc, "mismatched line counts", "val.de.gz: 9 lines", "val.en.gz: 10 lines")


def test_missing_archive(tmp_path, seed):
    build_wmt16(tmp_path / "raw", random.Random(seed))
    (tmp_path / "raw" / "dev.tgz").unlink()
    proc = run_script("prepare_wmt16_en_de.sh", "--raw-dir", tmp_path / "raw", "--out", tmp_path / "out",
                      *COMMON, check=False)
    failed(proc, f"missing archive {tmp_path / 'raw' / 'dev.tgz'}")


@pytest.mark.parametrize("archive", ["training-parallel-commoncrawl.tgz", "training-giga-fren.tar", "test-full.tgz"])
def test_corrupt_archive(tmp_path, seed, archive):
    build_wmt14(tmp_path / "raw", random.Random(seed))
    path = tmp_path / "raw" / archive
    # an interrupted copy (a plain tar is padded with zeros to 10 KiB: cut inside the first member)
    path.write_bytes(path.read_bytes()[: 700 if archive.endswith(".tar") else path.stat().st_size // 2])
    proc = run_script("prepare_wmt14_en_fr.sh", "--raw-dir", tmp_path / "raw", "--out", tmp_path / "out",
                      *COMMON, check=False)
    failed(proc, f"corrupt archive {path}")


def test_corrupt_gz_and_checksum_mismatch(tmp_path, seed):
    build_multi30k(tmp_path / "local", random.Random(seed))
    # the sha256 of the real files is checked unless --no-checksums
    failed(run_script("prepare_multi30k.sh", "--local", tmp_path / "local", "--out", tmp_path / "a", check=False),
           f"checksum mismatch for {tmp_path / 'local' / 'train.en.gz'}")
    path = tmp_path / "local" / "val.en.gz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    failed(run_script("prepare_multi30k.sh", "--local", tmp_path / "local", "--out", tmp_path / "b", *COMMON,
                      check=False), f"corrupt archive {path}")


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_non_empty_unrelated_out_is_refused_before_anything_is_written(tmp_path, seed, script):
    """A mistyped --out (here a directory of someone's files, one of them where a step's output goes) is
    refused before the first download or step: nothing is written into it (.state/ and raw/ were, up to
    the step whose output was there)."""
    out, archives = tmp_path / "home", tmp_path / "archives"
    builders = {"prepare_wmt14_en_fr.sh": build_wmt14, "prepare_wmt16_en_de.sh": build_wmt16,
                "prepare_multi30k.sh": build_multi30k}
    builders[script](archives, random.Random(seed))
    (out / "tok").mkdir(parents=True)
    (out / "tok" / "train.en").write_text("my own file\n", encoding="utf-8")
    (out / "notes.txt").write_text("notes\n", encoding="utf-8")
    before = tree_digest(out), sorted(p.relative_to(out) for p in out.rglob("*"))
    archive_option = "--local" if script == "prepare_multi30k.sh" else "--raw-dir"
    proc = run_script(script, archive_option, archives, "--out", out, *COMMON, check=False)
    failed(proc, f"refusing to write into {out}: it is not empty (notes.txt, tok)", "no data_prep run made it")
    assert (tree_digest(out), sorted(p.relative_to(out) for p in out.rglob("*"))) == before


def test_claiming_out_takes_new_empty_and_data_prep_directories(tmp_path):
    """What the scripts' first step accepts as --out: a new or empty directory, one that an earlier run took
    (OUT/.state, even if interrupted in its first download), and one whose only entry is the archive
    directory (archives are downloaded into OUT/orig, or put there beforehand)."""
    state.claim_out_dir(tmp_path / "new")
    assert (tmp_path / "new" / ".state").is_dir()
    (tmp_path / "empty").mkdir()
    state.claim_out_dir(tmp_path / "empty")
    mine = tmp_path / "mine"
    (mine / "orig").mkdir(parents=True)
    (mine / "orig" / "train.en.gz").write_bytes(b"")
    state.claim_out_dir(mine, mine / "orig")
    assert (mine / ".state").is_dir()
    (mine / "raw").mkdir()
    state.claim_out_dir(mine)  # taken earlier: its files are data_prep's
    other = tmp_path / "other"
    (other / "orig").mkdir(parents=True)
    with pytest.raises(state.PrepError, match=r"not empty \(orig\)"):  # the archives are elsewhere: orig/ is not ours
        state.claim_out_dir(other, tmp_path / "archives")
    assert not (other / ".state").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(state.PrepError, match="is not a directory"):
        state.claim_out_dir(tmp_path / "file")


def test_existing_output_is_not_overwritten(tmp_path, multi30k_local):
    """Multi30k En-Fr, in a directory an earlier run took (interrupted before its first step finished),
    runs up to the first output that is already there, made by someone else."""
    local, files = multi30k_local
    out = tmp_path / "out"
    (out / "tok").mkdir(parents=True)
    (out / ".state").mkdir()
    (out / "tok" / "train.fr").write_text("my own file\n", encoding="utf-8")
    proc = run_script("prepare_multi30k.sh", "--local", local, "--out", out, "--pair", "en-fr", *COMMON, check=False)
    failed(proc, f"refusing to overwrite {out / 'tok' / 'train.fr'}")
    assert (out / "tok" / "train.fr").read_text(encoding="utf-8") == "my own file\n"
    for split, stem in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr")):
        assert read_lines(out / "raw" / f"{split}.fr") == files[stem]["fr"]
    assert read_lines(out / "tok" / "train.en") == moses(files["train"]["en"], "en")


@pytest.mark.slow
def test_other_settings_or_changed_outputs_are_refused(tmp_path, multi30k, multi30k_local):
    out, local = tmp_path / "out", multi30k_local[0]
    shutil.copytree(multi30k[0], out)
    before = tree_digest(out)
    proc = run_script("prepare_multi30k.sh", "--local", local, "--out", out, *COMMON, "--bpe-size", 77, check=False)
    failed(proc, "step 'bpe/spm.model' already finished", "size: 150 -> 77")
    assert tree_digest(out) == before
    proc = run_script("prepare_multi30k.sh", "--local", local, "--out", out, *COMMON, "--bpe-size", 150,
                      "--bpe", "subword_nmt", check=False)  # another kind is another step: it wrote bpe/codes
    failed(proc, f"BPE was learnt in {out} with --bpe sentencepiece")
    assert tree_digest(out) == before
    with open(out / "tok" / "train.en", "a", encoding="utf-8") as f:
        f.write("an extra line\n")
    proc = run_script("prepare_multi30k.sh", "--local", local, "--out", out, *COMMON, "--bpe-size", 150, check=False)
    failed(proc, f"{out / 'tok' / 'train.en'}, made by the finished step 'tok/train.en', has changed since")
    assert (out / "tok" / "train.clean.en").read_bytes() == (multi30k[0] / "tok" / "train.clean.en").read_bytes()


# ---------------------------------------------------------------------------------------------
# Steps


class _FileServer(BaseHTTPRequestHandler):
    """Serves ``content`` at ``/file.bin``, with or without HTTP Range support."""

    content = b""
    honour_range = True
    cut_first_at = 0  # > 0: the first response stops after that many bytes
    requests: List[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.requests.append(self.headers.get("Range") or "")
        if self.path != "/file.bin":
            self.send_error(404)
            return
        start = 0
        if self.honour_range and self.headers.get("Range"):
            start = int(self.headers["Range"].split("=")[1].rstrip("-"))
        body = self.content[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(self.content) - 1}/{len(self.content)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.cut_first_at and len(self.requests) == 1:
            self.wfile.write(body[:self.cut_first_at])
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def file_server(seed):
    """(base URL, handler class) of a local HTTP server; the class attributes set its behaviour."""
    handler = type("Handler", (_FileServer,), {"content": random.Random(seed).randbytes(300_000),
                                               "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("honour_range", [True, False])
def test_download_resumes_a_partial_file(tmp_path, file_server, honour_range):
    url, handler = file_server
    handler.honour_range = honour_range
    dest = tmp_path / "file.bin"
    (tmp_path / "file.bin.part").write_bytes(handler.content[:100_000])  # an interrupted download
    checksum = "sha256:" + hashlib.sha256(handler.content).hexdigest()
    fetch.download(f"{url}/file.bin", dest, checksum=checksum, retries=1)
    assert dest.read_bytes() == handler.content
    assert handler.requests == ["bytes=100000-"]
    assert not (tmp_path / "file.bin.part").exists()


def test_download_resumes_after_a_cut_connection(tmp_path, file_server):
    url, handler = file_server
    handler.cut_first_at = 1000
    fetch.download(f"{url}/file.bin", tmp_path / "file.bin", retries=2, retry_wait=0)
    assert (tmp_path / "file.bin").read_bytes() == handler.content
    assert handler.requests == ["", "bytes=1000-"]


def test_download_errors(tmp_path, file_server):
    url, handler = file_server
    with pytest.raises(state.PrepError, match=r"checksum mismatch .* kept as .*file\.bin\.corrupt"):
        fetch.download(f"{url}/file.bin", tmp_path / "file.bin", checksum="md5:" + "0" * 32, retries=1)
    assert not (tmp_path / "file.bin").exists()
    assert (tmp_path / "file.bin.corrupt").read_bytes() == handler.content
    with pytest.raises(state.PrepError, match="HTTP 404"):
        fetch.download(f"{url}/other.bin", tmp_path / "other.bin", retries=1)


def test_fetch_step_downloads_then_checks_once(tmp_path, file_server, seed):
    from data_prep import cli

    url, handler = file_server
    write_tar(tmp_path / "built.tgz", parallel_members("x.{l}", make_pairs(random.Random(seed), 5, "de"), "en", "de"))
    handler.content = (tmp_path / "built.tgz").read_bytes()
    args = ["fetch", "--out", str(tmp_path / "out"), "--raw-dir", str(tmp_path / "orig"), "--file", "x.tgz",
            "--url", f"{url}/file.bin", "--checksum", "sha256:" + hashlib.sha256(handler.content).hexdigest()]
    assert cli.main(args) == 0
    assert (tmp_path / "orig" / "x.tgz").read_bytes() == handler.content
    assert state.marker_path(tmp_path / "out", "verify/x.tgz").exists()
    (tmp_path / "orig" / "x.tgz").unlink()  # removed to save space once the corpora are extracted
    assert cli.main(args + ["--offline"]) == 0  # finished: neither downloaded nor checked again
    assert handler.requests == [""]


def test_parallel_tokenisation_keeps_order(tmp_path, seed):
    lines = [p[0] for p in make_pairs(random.Random(seed), 300, "fr")] + ["", "  Spaces   inside  "]
    src = tmp_path / "in.txt"
    src.write_bytes(lines_bytes(lines))
    for workers in (1, 2):
        text.map_lines(src, tmp_path / f"out{workers}.txt", text.moses_line_tokenizer, ("en",), workers,
                       "test", chunk_size=7)  # many chunks and several windows
    assert read_lines(tmp_path / "out2.txt") == read_lines(tmp_path / "out1.txt") == moses(lines, "en")


@pytest.mark.parametrize("src_len, tgt_len, keep", [
    (1, 1, True), (0, 0, False), (0, 1, False), (250, 250, True), (251, 250, False),
    (10, 15, True), (10, 16, False), (16, 10, False), (2, 3, True), (2, 4, False)])
def test_keep_pair_is_the_moses_rule(src_len, tgt_len, keep):
    assert text.keep_pair("x " * src_len, "y " * tgt_len, min_len=1, max_len=250, ratio=1.5) is keep


def test_sgm_text_is_sacrebleus(tmp_path):
    """The references are the text sacrebleu extracts from the same sgm file."""
    from types import SimpleNamespace

    from sacrebleu.dataset.base import Dataset
    from sacrebleu.dataset.fake_sgml import FakeSGMLDataset

    lines = ["A  first   sentence ", "R&amp;D \u201cquoted\u201d", "", "caf\u00e9 <b>bold</b>"]
    (tmp_path / "x.sgm").write_bytes(sgm(lines, "newstest2014", "en", "src"))
    FakeSGMLDataset._convert_format(SimpleNamespace(_clean=Dataset._clean), str(tmp_path / "x.sgm"),
                                    str(tmp_path / "sacrebleu.txt"))
    with open(tmp_path / "x.sgm", "rb") as f:
        ours = b"".join(fetch.iter_lines(f, "x.sgm"))
    assert ours == (tmp_path / "sacrebleu.txt").read_bytes()
    assert ours.decode("utf-8").split("\n")[:2] == ["A first sentence", "R&amp;D \u201cquoted\u201d"]


def test_failed_step_leaves_no_output_and_no_marker(tmp_path):
    out, target = tmp_path, tmp_path / "a.txt"

    def crash(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        state.run_step(out, "a", {"x": 1}, [target], crash)
    assert not target.exists() and not state.marker_path(out, "a").exists()
    assert state.run_step(out, "a", {"x": 1}, [target], lambda tmp: tmp.write_text("whole")) is True
    assert target.read_text() == "whole" and not state.partial_path(target).exists()
    assert state.run_step(out, "a", {"x": 1}, [target], crash) is False  # done: not run again


def _learn_bpe(out: Path, kind: str) -> int:
    from data_prep import cli

    return cli.main(["learn-bpe", "--out", str(out), "--langs", "en", "de", "--kind", kind, "--size", "100",
                     "--input", str(out / "tok" / "train.clean"), "--bpe-dir", str(out / "bpe")])


def test_bpe_of_another_kind_is_refused_before_anything_is_written(tmp_path, seed, capsys):
    """A finished sentencepiece output rerun with --bpe subword_nmt wrote bpe/codes (a new step: the kinds'
    model files differ), and only the next step, applying it, refused."""
    out = tmp_path / "out"
    state.claim_out_dir(out)
    (out / "tok").mkdir()
    pairs = make_pairs(random.Random(seed), 60, "de")
    for side, lang in enumerate(("en", "de")):
        (out / "tok" / f"train.clean.{lang}").write_bytes(lines_bytes([p[side] for p in pairs]))
    assert _learn_bpe(out, "sentencepiece") == 0
    before = tree_digest(out)
    assert _learn_bpe(out, "subword_nmt") == 1
    err = capsys.readouterr().err
    assert f"error: BPE was learnt in {out} with --bpe sentencepiece (bpe/spm.model); this run asks for --bpe " \
           f"subword_nmt" in err
    assert tree_digest(out) == before and not (out / "bpe" / "codes").exists()
    assert _learn_bpe(out, "sentencepiece") == 0 and tree_digest(out) == before  # the same kind: skipped


def _fetch(out: Path, raw: Path, checksum: str, *extra: str) -> int:
    from data_prep import cli

    return cli.main(["fetch", "--out", str(out), "--raw-dir", str(raw), "--file", "x.tgz", "--offline",
                     "--checksum", checksum, *extra])


def test_a_run_with_checksums_checks_what_a_run_without_them_fetched(tmp_path, seed, capsys, caplog):
    """The step was finished (its marker written) by a --no-checksums run: a later run with checksums
    skipped it without checking anything."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    write_tar(raw / "x.tgz", parallel_members("x.{l}", make_pairs(random.Random(seed), 5, "de"), "en", "de"))
    right = "sha256:" + hashlib.sha256((raw / "x.tgz").read_bytes()).hexdigest()
    wrong = "sha256:" + "0" * 64
    assert _fetch(out, raw, wrong, "--no-checksums") == 0
    caplog.set_level("INFO", logger="data_prep")
    assert _fetch(out, raw, wrong) == 1
    err = capsys.readouterr().err
    assert f"error: checksum mismatch for {raw / 'x.tgz'}" in err and "earlier --no-checksums run" in err
    assert "the run that fetched it had --no-checksums; checking it now" in caplog.text
    caplog.clear()
    assert _fetch(out, raw, right) == 0  # checked now, and recorded: not checked again
    assert "checking it now" in caplog.text
    caplog.clear()
    assert _fetch(out, raw, wrong) == 0 and "checking it now" not in caplog.text
    # the archive removed since the unchecked run: said plainly, it cannot be checked any more
    other = tmp_path / "other"
    assert _fetch(other, raw, right, "--no-checksums") == 0
    (raw / "x.tgz").unlink()
    assert _fetch(other, raw, right) == 0
    assert "was never checked against its checksum" in caplog.text and "cannot be checked now" in caplog.text
