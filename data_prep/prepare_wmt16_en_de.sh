#!/usr/bin/env bash
#
# WMT16 English-German with the WMT16 constrained training data, prepared like fairseq's
# examples/translation/prepare-wmt14en2de.sh (sacremoses instead of Moses' perl scripts).
#
#   train: europarl-v7, commoncrawl, news-commentary-v11
#   valid: newstest2013; test: newstest2014 (full) as "test", newstest2016 as "test1"
#
# Every stage is a data_prep step that runs once per --out directory: re-running skips what
# is done, refuses to overwrite anything it did not make, and resumes interrupted downloads.
set -euo pipefail

# shellcheck source=data_prep/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SRC=en
TGT=de
BPE=subword_nmt
BPE_SIZE=32000

URLS=(
    "https://statmt.org/wmt13/training-parallel-europarl-v7.tgz"
    "https://statmt.org/wmt13/training-parallel-commoncrawl.tgz"
    "https://data.statmt.org/wmt16/translation-task/training-parallel-nc-v11.tgz"
    "https://data.statmt.org/wmt16/translation-task/dev.tgz"
    "https://statmt.org/wmt14/test-full.tgz"
    "https://data.statmt.org/wmt16/translation-task/test.tgz"
)
FILES=(
    "training-parallel-europarl-v7.tgz"
    "training-parallel-commoncrawl.tgz"
    "training-parallel-nc-v11.tgz"
    "dev.tgz"
    "test-full.tgz"
    "test.tgz"
)
# md5 of the evaluation archives as published by sacrebleu; the others are checked by size
# (downloads) and by reading them to the end (gzip CRC, tar headers).
CHECKSUMS=(
    ""
    ""
    ""
    "md5:4a3dc2760bb077f4308cce96b06e6af6"
    "md5:a8cd784e006feb32ac6f3d9ec7eb389a"
    "md5:3d809cd0c2c86adb2c67034d15c4e446"
)
# ARCHIVE::MEMBER, {l} = language, {role} = src for English and ref for German
TRAIN=(
    "training-parallel-europarl-v7.tgz::training/europarl-v7.de-en.{l}"
    "training-parallel-commoncrawl.tgz::commoncrawl.de-en.{l}"
    "training-parallel-nc-v11.tgz::training-parallel-nc-v11/news-commentary-v11.de-en.{l}"
)
VALID="dev.tgz::dev/newstest2013-{role}.{l}.sgm"
TEST2014="test-full.tgz::test-full/newstest2014-deen-{role}.{l}.sgm"
TEST2016="test.tgz::test/newstest2016-ende-{role}.{l}.sgm"

usage() {
    cat <<EOF
Usage: $(basename "$0") --out DIR [options]

Prepares WMT16 En-De for fairseq: download, normalise + tokenise (sacremoses, aggressive
dash splitting), clean, joint BPE, fairseq-preprocess --joined-dictionary.
Splits: valid = newstest2013, test = newstest2014, test1 = newstest2016; the untouched
references are DIR/raw/test.$TGT and DIR/raw/test1.$TGT. Every stage keeps its output in
DIR (orig/, raw/, tok/, bpe/, bin/): expect several times the size of the uncompressed corpus.

Options:
$(common_options_help)
EOF
}

parse_args "$@"
init_run

stage 1 "archives: download (or find in --raw-dir) and check"
for i in "${!FILES[@]}"; do
    fetch_archive "${FILES[i]}" "${URLS[i]}" "${CHECKSUMS[i]}"
done

stage 2 "raw text: train, newstest2013, newstest2014, newstest2016 (untouched)"
corpus_args=()
for corpus in "${TRAIN[@]}"; do
    corpus_args+=(--corpus "$corpus")
done
step collect --raw-dir "$RAW_DIR" --langs "$SRC" "$TGT" "${corpus_args[@]}" --prefix "$OUT/raw/train"
step collect --raw-dir "$RAW_DIR" --langs "$SRC" "$TGT" --corpus "$VALID" --prefix "$OUT/raw/valid"
step collect --raw-dir "$RAW_DIR" --langs "$SRC" "$TGT" --corpus "$TEST2014" --prefix "$OUT/raw/test"
step collect --raw-dir "$RAW_DIR" --langs "$SRC" "$TGT" --corpus "$TEST2016" --prefix "$OUT/raw/test1"

process_collected_splits test test1

finish
