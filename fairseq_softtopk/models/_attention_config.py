"""The attention-normaliser options that ``softtopk_lstm`` and ``softtopk_transformer`` share, and their checks."""

from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from fairseq_softtopk.modules.attention_normalizer import ATTENTION_NORMALIZERS
from fairseq_softtopk.option_checks import (BACKEND_CHOICES, check_backend_option, check_bf16, check_choice,
                                            check_epsilon, check_number, requested_bf16, requested_cpu)


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

    attention_topk_backend: ChoiceEnum(BACKEND_CHOICES) = field(default="auto", metadata={
        "help": "the implementation of soft_topk and sparse_topk: auto (the fused Triton kernels on a GPU where "
                "triton is installed and the operator has them, the torch code otherwise), torch, or triton (the "
                "kernels; needs a GPU)"})


def check_model_options(cfg) -> None:
    """Raises ``ValueError`` naming the first bad attention option of ``cfg`` (the model's config or parsed
    arguments, with the fields of :class:`AttentionNormalizerConfig`), its value and the allowed range, and
    refuses ``--bf16`` without torch_xla (:func:`~fairseq_softtopk.option_checks.check_bf16`) and
    ``--attention-topk-backend triton`` where the kernels cannot run (``--cpu``, no GPU, no triton).

    The options are checked whatever the normaliser (a value that the chosen one ignores is still refused),
    when the model is built and in the ablation runner's check of every arm.
    """
    check_bf16(requested_bf16(cfg))
    check_choice("attention_normalizer", cfg.attention_normalizer, ATTENTION_NORMALIZERS)
    check_number("attention_topk", cfg.attention_topk, 1, integer=True)
    check_epsilon("attention_topk_epsilon", cfg.attention_topk_epsilon)
    check_backend_option("attention_topk_backend", getattr(cfg, "attention_topk_backend", "auto"), requested_cpu(cfg))
