"""nn.Modules built on :mod:`fairseq_softtopk.ops` (no fairseq registration here)."""

from .additive_attention import AdditiveAttention
from .attention_normalizer import ATTENTION_NORMALIZERS, AttentionNormalizer, normalize_attention
from .beam_search import BeamSearchConfig, BeamSearchOutput, unroll_beam_search

__all__ = [
    "ATTENTION_NORMALIZERS",
    "AdditiveAttention",
    "AttentionNormalizer",
    "BeamSearchConfig",
    "BeamSearchOutput",
    "normalize_attention",
    "unroll_beam_search",
]
