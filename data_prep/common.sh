# shellcheck shell=bash
# Shared by the prepare_*.sh scripts (sourced, not run): options, stages, data_prep steps.
#
# A script sets SRC, TGT, BPE, BPE_SIZE and a usage() function, may add options of its own
# (VALUE_OPTIONS+=(--name) and an extra_option NAME VALUE function), calls parse_args "$@",
# checks its own options, calls init_run and runs its stages with the helpers below.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

OUT=""
RAW_DIR=""
OFFLINE=0
NO_CHECKSUMS=0
WORKERS="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
MIN_LEN=1
MAX_LEN=250
CLEAN_RATIO=1.5
VALUE_OPTIONS=(--out --raw-dir --workers --bpe --bpe-size --max-len --clean-ratio)

die() {
    echo "error: $*" >&2
    exit 1
}

stage() {
    echo "== $(date +%H:%M:%S) stage $1: $2" >&2
}

common_options_help() {
    cat <<EOF
  --out DIR           output directory (required): new, empty or an earlier run's
                      (another is refused before anything is written); binarised data in DIR/bin
  --raw-dir DIR       use the archives already in DIR and download nothing
                      (default: download into DIR/orig, resuming partial downloads)
  --workers N         processes for tokenisation, BPE and binarisation (default: $WORKERS)
  --bpe KIND          subword_nmt or sentencepiece (default: $BPE)
  --bpe-size N        joint BPE merges / sentencepiece vocabulary (default: $BPE_SIZE)
  --max-len N         cleaning: drop pairs with a side longer than N tokens (default: $MAX_LEN)
  --clean-ratio R     cleaning: drop pairs with one side R times longer (default: $CLEAN_RATIO)
  --no-checksums      skip the checksum of archives that have one (archives built locally)
  -h, --help          this help
EOF
}

_is_value_option() {
    local opt
    for opt in "${VALUE_OPTIONS[@]}"; do
        [[ "$opt" == "$1" ]] && return 0
    done
    return 1
}

_set_option() {
    case "$1" in
        --out) OUT="$2" ;;
        --raw-dir) RAW_DIR="$2"; OFFLINE=1 ;;
        --workers) WORKERS="$2" ;;
        --bpe) BPE="$2" ;;
        --bpe-size) BPE_SIZE="$2" ;;
        --max-len) MAX_LEN="$2" ;;
        --clean-ratio) CLEAN_RATIO="$2" ;;
        *) extra_option "$1" "$2" ;;
    esac
}

_need_positive_int() {
    [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"
}

parse_args() {
    while (($# > 0)); do
        case "$1" in
            -h | --help) usage; exit 0 ;;
            --no-checksums) NO_CHECKSUMS=1; shift ;;
            *)
                _is_value_option "$1" || die "unknown option '$1' (see --help)"
                (($# >= 2)) || die "option $1 needs a value (see --help)"
                _set_option "$1" "$2"
                shift 2
                ;;
        esac
    done
    [[ -n "$OUT" ]] || die "--out DIR is required (see --help)"
    _need_positive_int --workers "$WORKERS"
    _need_positive_int --bpe-size "$BPE_SIZE"
    _need_positive_int --max-len "$MAX_LEN"
    if ! [[ "$CLEAN_RATIO" =~ ^[0-9]+(\.[0-9]+)?$ ]] || ! awk "BEGIN { exit !($CLEAN_RATIO >= 1) }"; then
        die "--clean-ratio must be a number >= 1, got '$CLEAN_RATIO'"
    fi
    case "$BPE" in
        subword_nmt | sentencepiece) ;;
        *) die "unknown --bpe '$BPE' (choose subword_nmt or sentencepiece)" ;;
    esac
}

# init_run: after the options are checked; picks the Python interpreter and takes --out (the
# claim step: a directory that holds other files and no data_prep state is refused before
# anything is written into it; see data_prep/state.py).
init_run() {
    if [[ -n "${PYTHON:-}" ]]; then
        PY="$PYTHON"
    elif [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
        PY="$REPO_ROOT/.venv/bin/python"
    else
        PY="python3"
    fi
    if ((OFFLINE)); then
        [[ -d "$RAW_DIR" ]] || die "--raw-dir $RAW_DIR is not a directory"
        RAW_DIR="$(cd "$RAW_DIR" && pwd)"
    else
        RAW_DIR="$OUT/orig"
    fi
    step claim --raw-dir "$RAW_DIR" || exit 1
    OUT="$(cd "$OUT" && pwd)"
    if ! ((OFFLINE)); then
        RAW_DIR="$OUT/orig"
    fi
    echo "$(basename "$0"): $SRC-$TGT into $OUT (archives: $RAW_DIR, $WORKERS workers, $BPE $BPE_SIZE)" >&2
}

# step STEP ARGS...: one data_prep step (skipped when already done in $OUT).
step() {
    PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m data_prep.cli "$1" --out "$OUT" "${@:2}"
}

# fetch_archive FILE URL CHECKSUM: download FILE unless in $RAW_DIR, then check it (once).
fetch_archive() {
    local args=(--raw-dir "$RAW_DIR" --file "$1")
    if [[ -n "$2" ]]; then args+=(--url "$2"); fi
    if [[ -n "$3" ]]; then args+=(--checksum "$3"); fi
    if ((OFFLINE)); then args+=(--offline); fi
    if ((NO_CHECKSUMS)); then args+=(--no-checksums); fi
    step fetch "${args[@]}"
}

# tokenize_splits SPLIT...: raw/SPLIT.LANG -> tok/SPLIT.LANG
tokenize_splits() {
    local split lang
    for split in "$@"; do
        for lang in "$SRC" "$TGT"; do
            step tokenize --lang "$lang" --input "$OUT/raw/$split.$lang" \
                --output "$OUT/tok/$split.$lang" --workers "$WORKERS"
        done
    done
}

# clean_splits SPLIT...: tok/SPLIT.* -> tok/SPLIT.clean.*
clean_splits() {
    local split
    for split in "$@"; do
        step clean --langs "$SRC" "$TGT" --input "$OUT/tok/$split" --output "$OUT/tok/$split.clean" \
            --min-len "$MIN_LEN" --max-len "$MAX_LEN" --ratio "$CLEAN_RATIO"
    done
}

# learn_bpe: joint model on tok/train.clean.{SRC,TGT} -> bpe/
learn_bpe() {
    step learn-bpe --langs "$SRC" "$TGT" --kind "$BPE" --size "$BPE_SIZE" \
        --input "$OUT/tok/train.clean" --bpe-dir "$OUT/bpe" --workers "$WORKERS"
}

# apply_bpe NAME:TOKENISED...: tok/TOKENISED.LANG -> bpe/NAME.LANG
apply_bpe() {
    local pair lang
    for pair in "$@"; do
        for lang in "$SRC" "$TGT"; do
            step apply-bpe --kind "$BPE" --bpe-dir "$OUT/bpe" --lang "$lang" \
                --input "$OUT/tok/${pair#*:}.$lang" --output "$OUT/bpe/${pair%%:*}.$lang" --workers "$WORKERS"
        done
    done
}

# binarize TEST...: bpe/{train,valid,TEST...} -> bin/ (fairseq-preprocess --joined-dictionary)
binarize() {
    local tests=() name
    for name in "$@"; do
        tests+=("$OUT/bpe/$name")
    done
    step binarize --langs "$SRC" "$TGT" --train "$OUT/bpe/train" --valid "$OUT/bpe/valid" \
        --test "${tests[@]}" --destdir "$OUT/bin" --workers "$WORKERS"
}

# process_collected_splits TEST...: stages 3-7, the same for every corpus once raw/ holds the
# train, valid and TEST splits: tokenise all, clean train and valid, learn a joint BPE on train,
# apply it (the test splits as they are) and binarise
process_collected_splits() {
    local name test_pairs=()
    for name in "$@"; do
        test_pairs+=("$name:$name")
    done
    stage 3 "normalise punctuation and tokenise"
    tokenize_splits train valid "$@"

    stage 4 "clean train and valid (length $MIN_LEN-$MAX_LEN, ratio $CLEAN_RATIO)"
    clean_splits train valid

    stage 5 "learn joint BPE ($BPE, $BPE_SIZE)"
    learn_bpe

    stage 6 "apply BPE"
    apply_bpe train:train.clean valid:valid.clean "${test_pairs[@]}"

    stage 7 "binarise"
    binarize "$@"
}

finish() {
    local post=subword_nmt
    if [[ "$BPE" == sentencepiece ]]; then post=sentencepiece; fi
    cat >&2 <<EOF
== done: $OUT/bin (fairseq data, joined dictionary)
   raw references for BLEU: $OUT/raw/test*.$TGT
   after fairseq-generate: --post-process $post, then detokenise (sacremoses, $TGT)
EOF
}
