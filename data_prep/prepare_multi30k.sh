#!/usr/bin/env bash
#
# Multi30k task 1 (Flickr30k captions), English-German or English-French, from a local copy
# of the upstream gzipped files (--local) or downloaded from the upstream repository, pinned
# to commit a3d2e0d26b56f3846f66a952536ffed4e401d05a.
#
#   train: train (29000), valid: val (1014), test: test_2016_flickr (1000)
#
# Every stage is a data_prep step that runs once per --out directory: re-running skips what
# is done and refuses to overwrite anything it did not make.
set -euo pipefail

# shellcheck source=data_prep/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SRC=en
TGT=de
PAIR=en-de
BPE=sentencepiece
BPE_SIZE=8000
UPSTREAM="https://github.com/multi30k/dataset/raw/a3d2e0d26b56f3846f66a952536ffed4e401d05a/data/task1/raw"
# sha256 of the upstream files at that commit
declare -A SHA256=(
    [train.en.gz]=d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f
    [train.de.gz]=726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6
    [train.fr.gz]=622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c
    [val.en.gz]=14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28
    [val.de.gz]=f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a
    [val.fr.gz]=ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9
    [test_2016_flickr.en.gz]=611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9
    [test_2016_flickr.de.gz]=9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8
    [test_2016_flickr.fr.gz]=6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90
)
# output split: upstream file stem
SPLITS=(train:train valid:val test:test_2016_flickr)

usage() {
    cat <<EOF
Usage: $(basename "$0") --out DIR [options]

Prepares Multi30k (task 1) for fairseq: normalise + tokenise (sacremoses, aggressive dash
splitting), clean, joint BPE, fairseq-preprocess --joined-dictionary. The untouched test
reference is DIR/raw/test.<target language>.

Options:
  --pair PAIR         en-de or en-fr (default: $PAIR)
  --local DIR         read the gzipped files from DIR (train.{en,de,fr}.gz, val.*.gz,
                      test_2016_flickr.*.gz) instead of downloading them; same as --raw-dir
$(common_options_help)
EOF
}

VALUE_OPTIONS+=(--pair --local)
extra_option() {
    case "$1" in
        --pair) PAIR="$2" ;;
        --local) RAW_DIR="$2"; OFFLINE=1 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
}

parse_args "$@"
case "$PAIR" in
    en-de | en-fr) TGT="${PAIR#en-}" ;;
    *) die "unknown language pair '$PAIR' (choose en-de or en-fr)" ;;
esac
init_run

stage 1 "files: download (or find in --local) and check"
for split in "${SPLITS[@]}"; do
    for lang in "$SRC" "$TGT"; do
        file="${split#*:}.$lang.gz"
        fetch_archive "$file" "$UPSTREAM/$file" "sha256:${SHA256[$file]}"
    done
done

stage 2 "raw text (untouched)"
for split in "${SPLITS[@]}"; do
    step collect --raw-dir "$RAW_DIR" --langs "$SRC" "$TGT" --corpus "${split#*:}.{l}.gz" \
        --prefix "$OUT/raw/${split%%:*}"
done

process_collected_splits test

finish
