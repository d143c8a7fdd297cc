"""The attention-normaliser options that ``softtopk_lstm`` and ``softtopk_transformer`` share."""

from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from fairseq_softtopk.modules.attention_normalizer import ATTENTION_NORMALIZERS


@dataclass
class AttentionNormalizerConfig(FairseqDataclass):
    """Which :class:`~fairseq_softtopk.modules.attention_normalizer.AttentionNormalizer` the attention uses."""

    attention_normalizer: ChoiceEnum(ATTENTION_NORMALIZERS) = field(default="softmax", metadata={
        "help": "how attention scores become weights: softmax, soft_topk (softmax(scores + log A), A the SOFT "
                "top-k of the scores), hard_topk, sparse_topk (the same with the sparse soft top-k: exact zeros), "
                "sparsemax or entmax15"})
    attention_topk: int = field(default=5, metadata={
        "help": "k of soft_topk, hard_topk and sparse_topk (rows with at most k keys get softmax)"})
    attention_topk_epsilon: float = field(default=0.1, metadata={
        "help": "epsilon of soft_topk (entropic) or sparse_topk (quadratic regularisation), in units of the "
                "attention scores"})
