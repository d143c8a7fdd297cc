"""Command-line steps for the ``prepare_*.sh`` scripts: ``python -m data_prep.cli STEP ...``.

Every step takes ``--out DIR`` and runs at most once per ``DIR`` (see :mod:`data_prep.state`);
paths may be absolute or relative to the working directory. Errors the user has to fix
(missing or corrupt archive, mismatched line counts, an output that would be overwritten)
end with ``error: ...`` on stderr and exit status 1.
"""

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from data_prep.bpe import BPE_KINDS
from data_prep.state import PrepError, claim_out_dir, marker_path, relative_name, run_step, write_json_atomic

logger = logging.getLogger("data_prep")


def _langs(prefix: str, langs: Sequence[str]) -> List[Path]:
    return [Path(f"{prefix}.{lang}") for lang in langs]


def cmd_claim(args: argparse.Namespace) -> None:
    """Takes --out as the run's directory before anything is written: refuses one that holds other files."""
    claim_out_dir(args.out, args.raw_dir)


def _unverified_earlier(marker: Path) -> bool:
    """Whether the finished fetch step of ``marker`` skipped the checksum (``--no-checksums``)."""
    with open(marker, encoding="utf-8") as f:
        return not json.load(f).get("stats", {}).get("checksum_checked", False)


def _verify_late(path: Path, checksum: str, marker: Path) -> None:
    """Checks an archive that an earlier ``--no-checksums`` run took unchecked, and records the check."""
    from data_prep.fetch import check_checksum

    logger.warning("%s was not checked against its checksum: the run that fetched it had --no-checksums; "
                   "checking it now", path)
    try:
        check_checksum(path, checksum)
    except PrepError as err:
        raise PrepError(f"{err} (what the earlier --no-checksums run made from it is suspect too)") from err
    with open(marker, encoding="utf-8") as f:
        done = json.load(f)
    done.setdefault("stats", {})["checksum_checked"] = True
    write_json_atomic(marker, done)


def cmd_fetch(args: argparse.Namespace) -> None:
    """Downloads an archive unless it is there, then checks its checksum and readability once (and its
    checksum later, when the run that checked it had ``--no-checksums`` and this one has not)."""
    from data_prep.fetch import check_checksum, download, verify_archive

    path, name = args.raw_dir / args.file, f"verify/{args.file}"
    marker = marker_path(args.out, name)
    checksum = None if args.no_checksums else args.checksum
    if not path.exists() and marker.exists():
        if checksum and _unverified_earlier(marker):
            logger.warning("%s was never checked against its checksum (the run that fetched it had "
                           "--no-checksums) and has been removed since: it cannot be checked now", path)
        logger.info("skip %s: already done (the archive has been removed since)", name)
        return
    if not path.is_file():
        if args.offline or not args.url:
            raise PrepError(f"missing archive {path}" + (f" (download it from {args.url})" if args.url else ""))
        logger.info("download %s -> %s", args.url, path)
        download(args.url, path)

    def verify() -> dict:
        if checksum:
            check_checksum(path, checksum)
        members = verify_archive(path)
        return {"checksum_checked": bool(checksum), "members": len(members)}

    ran = run_step(args.out, name, {"size": path.stat().st_size}, [], verify)
    if not ran and checksum and _unverified_earlier(marker):
        _verify_late(path, checksum, marker)


def expand_spec(spec: str, lang: str, role: str) -> str:
    """Fills ``{l}`` (language) and ``{role}`` (``src`` or ``ref``) in a corpus spec."""
    return spec.replace("{l}", lang).replace("{role}", role)


def cmd_collect(args: argparse.Namespace) -> None:
    """Concatenates corpora (archive members or files) into ``PREFIX.{lang}``, untouched."""
    from data_prep.fetch import collect

    roles = ["src", "ref"]
    corpora = [[expand_spec(spec, lang, roles[i]) for i, lang in enumerate(args.langs)] for spec in args.corpus]
    train = _langs(args.prefix, args.langs)
    valid = _langs(args.valid_prefix, args.langs) if args.valid_every else []
    params = {"corpora": corpora, "valid_every": args.valid_every}

    def action(*partials: Path) -> dict:
        n = collect(corpora, args.raw_dir, partials[:len(train)], partials[len(train):], args.valid_every)
        if args.valid_every and n < args.valid_every:
            raise PrepError(f"{n} lines are fewer than --valid-every {args.valid_every}: no valid split")
        return {"lines": n}

    run_step(args.out, relative_name(train[0], args.out), params, [*train, *valid], action)


def cmd_tokenize(args: argparse.Namespace) -> None:
    """Moses punctuation normalisation + tokenisation (aggressive dash splitting)."""
    from data_prep.text import tokenize_file

    params = {"input": relative_name(args.input, args.out), "lang": args.lang}
    run_step(args.out, relative_name(args.output, args.out), params, [args.output],
             lambda tmp: tokenize_file(args.input, tmp, args.lang, args.workers, f"tokenise {args.output.name}"))


def cmd_clean(args: argparse.Namespace) -> None:
    """Drops pairs outside ``--min-len..--max-len`` tokens or longer than ``--ratio`` times the other."""
    from data_prep.text import clean_corpus

    inputs, outputs = _langs(args.input, args.langs), _langs(args.output, args.langs)
    params = {"input": [relative_name(p, args.out) for p in inputs], "min_len": args.min_len,
              "max_len": args.max_len, "ratio": args.ratio}

    def action(*partials: Path) -> dict:
        kept, total = clean_corpus(inputs, partials, args.min_len, args.max_len, args.ratio)
        return {"kept": kept, "total": total}

    run_step(args.out, relative_name(outputs[0], args.out), params, outputs, action)


def cmd_learn_bpe(args: argparse.Namespace) -> None:
    """Learns one BPE model on the training text of both languages."""
    from data_prep.bpe import learn_bpe, model_files

    inputs, outputs = _langs(args.input, args.langs), model_files(args.kind, args.bpe_dir)
    for other in BPE_KINDS:  # each kind is its own step (its own model file): refused here, before learning
        learnt = relative_name(model_files(other, args.bpe_dir)[0], args.out)
        if other != args.kind and marker_path(args.out, learnt).exists():
            raise PrepError(f"BPE was learnt in {args.out} with --bpe {other} ({learnt}); this run asks for "
                            f"--bpe {args.kind}, which would not match the segmented and binarised data there: "
                            f"use another --out, or the same --bpe")
    params = {"input": [relative_name(p, args.out) for p in inputs], "kind": args.kind, "size": args.size}
    run_step(args.out, relative_name(outputs[0], args.out), params, outputs,
             lambda *tmp: learn_bpe(args.kind, inputs, tmp, args.size, args.workers))


def cmd_apply_bpe(args: argparse.Namespace) -> None:
    """Segments one tokenised file with the learnt model."""
    from data_prep.bpe import apply_bpe, model_files

    model = model_files(args.kind, args.bpe_dir)[0]
    params = {"input": relative_name(args.input, args.out), "model": relative_name(model, args.out), "kind": args.kind}
    run_step(args.out, relative_name(args.output, args.out), params, [args.output],
             lambda tmp: {"lines": apply_bpe(args.kind, model, args.input, tmp, args.workers)})


def cmd_binarize(args: argparse.Namespace) -> None:
    """fairseq-preprocess --joined-dictionary, then a sentence-count check of every split."""
    from data_prep.binarize import fairseq_preprocess

    src, tgt = args.langs
    params = {"train": relative_name(Path(args.train), args.out), "valid": relative_name(Path(args.valid), args.out),
              "test": [relative_name(Path(p), args.out) for p in args.test], "langs": args.langs}
    run_step(args.out, relative_name(args.destdir, args.out), params, [args.destdir],
             lambda tmp: fairseq_preprocess(src, tgt, args.train, args.valid, args.test, tmp, args.workers))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_step(steps, name: str, func, langs: bool = False, workers: bool = False) -> argparse.ArgumentParser:
    sub = steps.add_parser(name, help=func.__doc__.split("\n")[0], description=func.__doc__)
    sub.set_defaults(func=func)
    sub.add_argument("--out", type=Path, required=True, help="output directory (markers in OUT/.state)")
    if langs:
        sub.add_argument("--langs", nargs=2, required=True, metavar=("SRC", "TGT"))
    if workers:
        sub.add_argument("--workers", type=_positive, default=1)
    return sub


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_prep.cli", description=__doc__.split("\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    p = _add_step(steps, "claim", cmd_claim)
    p.add_argument("--raw-dir", type=Path, help="the archive directory, which may lie inside --out")
    p = _add_step(steps, "fetch", cmd_fetch)
    p.add_argument("--raw-dir", type=Path, required=True)
    p.add_argument("--file", required=True, help="archive name in --raw-dir")
    p.add_argument("--url", help="where to download it from when it is missing")
    p.add_argument("--checksum", help="md5:HEX or sha256:HEX")
    p.add_argument("--offline", action="store_true", help="never download: a missing archive is an error")
    p.add_argument("--no-checksums", action="store_true", help="skip --checksum (archives built locally)")
    p = _add_step(steps, "collect", cmd_collect, langs=True)
    p.add_argument("--raw-dir", type=Path, required=True)
    p.add_argument("--corpus", action="append", required=True,
                   help="ARCHIVE::MEMBER or PATH, with {l} for the language and {role} for src/ref")
    p.add_argument("--prefix", required=True, help="output prefix, PREFIX.{lang}")
    p.add_argument("--valid-prefix", help="with --valid-every: prefix of the held-out lines")
    p.add_argument("--valid-every", type=int, default=0, help="every N-th line to --valid-prefix")
    p = _add_step(steps, "tokenize", cmd_tokenize, workers=True)
    p.add_argument("--lang", required=True)
    p.add_argument("--input", type=Path, required=True)
    p.add_argument("--output", type=Path, required=True)
    p = _add_step(steps, "clean", cmd_clean, langs=True)
    p.add_argument("--input", required=True, help="prefix")
    p.add_argument("--output", required=True, help="prefix")
    p.add_argument("--min-len", type=int, default=1)
    p.add_argument("--max-len", type=int, default=250)
    p.add_argument("--ratio", type=float, default=1.5)
    p = _add_step(steps, "learn-bpe", cmd_learn_bpe, langs=True, workers=True)
    p.add_argument("--kind", choices=BPE_KINDS, required=True)
    p.add_argument("--size", type=_positive, required=True)
    p.add_argument("--input", required=True, help="prefix of the tokenised training text")
    p.add_argument("--bpe-dir", type=Path, required=True)
    p = _add_step(steps, "apply-bpe", cmd_apply_bpe, workers=True)
    p.add_argument("--kind", choices=BPE_KINDS, required=True)
    p.add_argument("--bpe-dir", type=Path, required=True)
    p.add_argument("--lang", required=True)
    p.add_argument("--input", type=Path, required=True)
    p.add_argument("--output", type=Path, required=True)
    p = _add_step(steps, "binarize", cmd_binarize, langs=True, workers=True)
    p.add_argument("--train", required=True, help="prefix")
    p.add_argument("--valid", required=True, help="prefix")
    p.add_argument("--test", nargs="*", default=[], help="prefixes: test, test1, ...")
    p.add_argument("--destdir", type=Path, required=True)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s | %(levelname)s | data_prep | %(message)s")
    if getattr(args, "valid_every", 0) and not args.valid_prefix:
        build_parser().error("--valid-every needs --valid-prefix")
    try:
        args.func(args)
    except PrepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
