#!/usr/bin/env bash
#
# WMT14 English-French, after fairseq's examples/translation/prepare-wmt14en2fr.sh, with
# sacremoses and subword-nmt / sentencepiece from the virtualenv instead of Moses' perl scripts.
#
#   train: europarl-v7, commoncrawl, UN, news-commentary-v9, giga-fren (every 1333rd line held
#          out as valid); test: newstest2014 (full, 3003 sentences, from the sgm files)
#
# Every stage is a data_prep step that runs once per --out directory: re-running skips what
# is done, refuses to overwrite anything it did not make, and resumes interrupted downloads.
set -euo pipefail

# shellcheck source=data_prep/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SRC=en
TGT=fr
BPE=subword_nmt
BPE_SIZE=40000
VALID_EVERY=1333

URLS=(
    "https://statmt.org/wmt13/training-parallel-europarl-v7.tgz"
    "https://statmt.org/wmt13/training-parallel-commoncrawl.tgz"
    "https://statmt.org/wmt13/training-parallel-un.tgz"
    "https://statmt.org/wmt14/training-parallel-nc-v9.tgz"
    "https://statmt.org/wmt10/training-giga-fren.tar"
    "https://statmt.org/wmt14/test-full.tgz"
)
FILES=(
    "training-parallel-europarl-v7.tgz"
    "training-parallel-commoncrawl.tgz"
    "training-parallel-un.tgz"
    "training-parallel-nc-v9.tgz"
    "training-giga-fren.tar"
    "test-full.tgz"
)
# md5 where a maintained source publishes one (sacrebleu for test-full.tgz); the others are
# checked by size (downloads) and by reading them to the end (gzip CRC, tar headers).
CHECKSUMS=("" "" "" "" "" "md5:a8cd784e006feb32ac6f3d9ec7eb389a")
# ARCHIVE::MEMBER, {l} = language, {role} = src for English and ref for French
TRAIN=(
    "training-parallel-europarl-v7.tgz::training/europarl-v7.fr-en.{l}"
    "training-parallel-commoncrawl.tgz::commoncrawl.fr-en.{l}"
    "training-parallel-un.tgz::un/undoc.2000.fr-en.{l}"
    "training-parallel-nc-v9.tgz::training/news-commentary-v9.fr-en.{l}"
    "training-giga-fren.tar::giga-fren.release2.fixed.{l}.gz"
)
TEST="test-full.tgz::test-full/newstest2014-fren-{role}.{l}.sgm"

usage() {
    cat <<EOF
Usage: $(basename "$0") --out DIR [options]

Prepares WMT14 En-Fr for fairseq: download, normalise + tokenise (sacremoses, aggressive
dash splitting), clean, joint BPE, fairseq-preprocess --joined-dictionary.
The untouched test reference is DIR/raw/test.$TGT. Every stage keeps its output in DIR
(orig/, raw/, tok/, bpe/, bin/): expect several times the size of the uncompressed corpus.

Options:
$(common_options_help)
  --valid-every N     hold out every N-th training line as valid (default: $VALID_EVERY)
EOF
}

VALUE_OPTIONS+=(--valid-every)
extra_option() {
    case "$1" in
        --valid-every) VALID_EVERY="$2" ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
}

parse_args "$@"
_need_positive_int --valid-every "$VALID_EVERY"
init_run

stage 1 "archives: download (or find in --raw-dir) and check"
for i in "${!FILES[@]}"; do
    fetch_archive "${FILES[i]}" "${URLS[i]}" "${CHECKSUMS[i]}"
done

stage 2 "raw text: train + held-out valid, newstest2014 (untouched)"
corpus_args=()
for corpus in "${TRAIN[@]}"; do
    corpus_args+=(--corpus "$corpus")
done
step collect --raw-dir "$RAW_DIR" --langs "$SRC" "$TGT" "${corpus_args[@]}" \
    --prefix "$OUT/raw/train" --valid-prefix "$OUT/raw/valid" --valid-every "$VALID_EVERY"
step collect --raw-dir "$RAW_DIR" --langs "$SRC" "$TGT" --corpus "$TEST" --prefix "$OUT/raw/test"

process_collected_splits test

finish
