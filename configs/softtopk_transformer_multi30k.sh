#!/usr/bin/env bash
# Train softtopk_transformer_multi30k (3+3 layers of 256, 4 heads; CPU-sized) on a binarised
# Multi30k-sized corpus with top-k encoder-decoder attention, then translate the test set.
#
#   bash configs/softtopk_transformer_multi30k.sh DATA_BIN [SAVE_DIR]
#
# DATA_BIN: fairseq-preprocess output with a joined dictionary (--joined-dictionary), because
# the model ties all embeddings. Environment overrides (defaults in brackets):
#   NORMALIZER [soft_topk]  softmax | soft_topk | hard_topk | sparsemax | entmax15
#   TOPK [5]  EPSILON [0.1]  SELF_ATTENTION [0] (1: also normalise self-attention)
#   MAX_UPDATE [30000]  DEVICE [the GPU if torch finds one, else --cpu]  PYTHON [python]
# Rerunning resumes from SAVE_DIR/checkpoint_last.pt (fairseq's default --restore-file).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data_bin="${1:?usage: $0 DATA_BIN [SAVE_DIR]}"
normalizer="${NORMALIZER:-soft_topk}"
save_dir="${2:-checkpoints/softtopk_transformer_multi30k_${normalizer}}"
python="${PYTHON:-python}"
if [[ -z "${DEVICE+set}" ]]; then  # not set: the GPU where torch finds one
    if "${python}" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then DEVICE=""; else DEVICE="--cpu"; fi
fi
device="${DEVICE}"
self_attention=()
if [[ "${SELF_ATTENTION:-0}" == 1 ]]; then self_attention=(--attention-normalize-self-attention); fi

# shellcheck disable=SC2086  # ${device} is empty or one flag
"${python}" -m fairseq_cli.train "${data_bin}" \
    --user-dir "${repo}/fairseq_softtopk" ${device} \
    --arch softtopk_transformer_multi30k --share-all-embeddings \
    --attention-normalizer "${normalizer}" --attention-topk "${TOPK:-5}" \
    --attention-topk-epsilon "${EPSILON:-0.1}" "${self_attention[@]}" \
    --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 \
    --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-tokens 4096 --max-update "${MAX_UPDATE:-30000}" \
    --save-dir "${save_dir}" --no-epoch-checkpoints --keep-best-checkpoints 1 \
    --log-format simple --log-interval 100 --seed 1

# shellcheck disable=SC2086
"${python}" -m fairseq_cli.generate "${data_bin}" \
    --user-dir "${repo}/fairseq_softtopk" ${device} \
    --path "${save_dir}/checkpoint_best.pt" --gen-subset test \
    --beam 5 --batch-size 64 --required-batch-size-multiple 1 --print-alignment \
    > "${save_dir}/generate-test.txt"
tail -n 1 "${save_dir}/generate-test.txt"
