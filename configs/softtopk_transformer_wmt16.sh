#!/usr/bin/env bash
# Train softtopk_transformer_wmt16 (Transformer base) on binarised WMT16 En-De with top-k
# encoder-decoder attention, following OpenNMT-py's Transformer recipe (its FAQ, "How do I
# train the Transformer model?"), translated to fairseq flags:
#
#   OpenNMT-py                                     fairseq
#   6+6 layers, 512, ff 2048, 8 heads              --arch softtopk_transformer_wmt16
#   dropout 0.1, attention_dropout 0.1             (the arch's defaults)
#   adam, adam_beta2 0.998                         --optimizer adam --adam-betas '(0.9, 0.998)'
#   noam, learning_rate 2, warmup_steps 8000       --lr-scheduler inverse_sqrt --warmup-updates 8000
#                                                  --lr 0.000988  (= 2 * 512^-0.5 * 8000^-0.5, the
#                                                  same linear warmup and 1/sqrt(step) decay)
#   label_smoothing 0.1, max_grad_norm 0           --label-smoothing 0.1 --clip-norm 0
#   batch_size 4096 tokens x accum_count 2         --max-tokens 4096 --update-freq 8 on one GPU
#     x 4 GPUs (32768 tokens per update)           (UPDATE_FREQ=16 for the current FAQ's accum 4)
#   train_steps 200000, fp16                       --max-update 200000 --fp16
#   share_vocab / share_embeddings                 --share-all-embeddings (joined dictionary)
# Not replicated: OpenNMT-py's Glorot init of the embeddings (fairseq: normal(0, 512^-0.5)).
#
# NOTE: the paper's footnote (appendix C.3) points at OpenNMT-py's extended.html, whose
# "WMT'16" example is the WMT16 *multimodal* task (Multi30k) with OpenNMT-py's default
# 2-layer LSTM; this script is the Transformer-base reading of "WMT16 En-De", not the paper's model.
#
#   bash configs/softtopk_transformer_wmt16.sh DATA_BIN [SAVE_DIR]
# Environment overrides: NORMALIZER [soft_topk], TOPK [5], EPSILON [0.1], SELF_ATTENTION [0],
# UPDATE_FREQ [8], MAX_UPDATE [200000], PYTHON [python]. Needs a GPU.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
data_bin="${1:?usage: $0 DATA_BIN [SAVE_DIR]}"
normalizer="${NORMALIZER:-soft_topk}"
save_dir="${2:-checkpoints/softtopk_transformer_wmt16_${normalizer}}"
python="${PYTHON:-python}"
self_attention=()
if [[ "${SELF_ATTENTION:-0}" == 1 ]]; then self_attention=(--attention-normalize-self-attention); fi

"${python}" -m fairseq_cli.train "${data_bin}" \
    --user-dir "${repo}/fairseq_softtopk" --fp16 \
    --arch softtopk_transformer_wmt16 --share-all-embeddings \
    --attention-normalizer "${normalizer}" --attention-topk "${TOPK:-5}" \
    --attention-topk-epsilon "${EPSILON:-0.1}" "${self_attention[@]}" \
    --optimizer adam --adam-betas '(0.9, 0.998)' --clip-norm 0.0 \
    --lr 0.000988 --lr-scheduler inverse_sqrt --warmup-updates 8000 \
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
    --max-tokens 4096 --update-freq "${UPDATE_FREQ:-8}" --max-update "${MAX_UPDATE:-200000}" \
    --save-dir "${save_dir}" --save-interval-updates 10000 --keep-interval-updates 5 \
    --no-epoch-checkpoints --log-format simple --log-interval 100 --seed 1

"${python}" -m fairseq_cli.generate "${data_bin}" \
    --user-dir "${repo}/fairseq_softtopk" \
    --path "${save_dir}/checkpoint_best.pt" --gen-subset test \
    --beam 5 --lenpen 0.6 --batch-size 128 --required-batch-size-multiple 1 \
    > "${save_dir}/generate-test.txt"
tail -n 1 "${save_dir}/generate-test.txt"
