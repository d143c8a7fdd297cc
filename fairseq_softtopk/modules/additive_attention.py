"""Additive ("concat") attention of Bahdanau et al. (2014), with a pluggable normaliser.

The attention context is a convex combination of the encoder states, ``c = sum_j a_j h_j``
with ``a = normalize(scores)``; :meth:`AdditiveAttention.normalize` is the only place that
turns scores into weights, through :class:`~fairseq_softtopk.modules.attention_normalizer.AttentionNormalizer`
(softmax, SOFT top-k attention, hard top-k, sparsemax, entmax-1.5).
"""

from typing import Tuple

import torch
from torch import Tensor, nn

from .attention_normalizer import AttentionNormalizer

__all__ = ["AdditiveAttention"]


class AdditiveAttention(nn.Module):
    """Bahdanau attention: ``score_j = v^T tanh(W s + U h_j + b)``.

    From "Neural Machine Translation by Jointly Learning to Align and Translate" (Bahdanau, Cho
    and Bengio, 2014), appendix A.1.2. As recommended there, ``U h_j + b`` does not depend on
    the decoder step and is computed once per sentence by whoever produces the keys (our
    encoder, ``SoftTopKLSTMEncoder.attention_key_proj``), so this module holds only ``W`` and
    ``v`` and takes the projected keys.

    Args:
        query_dim: size of the decoder state ``s``.
        attention_dim: size of the projected keys ``U h_j + b`` (the alignment model's hidden size).
        normalizer: how scores become weights: ``softmax``, ``soft_topk`` (softmax(scores + log A),
            A the SOFT top-k of the scores), ``hard_topk``, ``sparsemax`` or ``entmax15``.
        topk: ``k`` of the top-k normalisers; others ignore it.
        epsilon: entropic regularisation of the soft top-k normaliser, in units of the scores.
        backend: the soft top-k operators' implementation, ``"auto"``, ``"torch"`` or ``"triton"``
            (:class:`AttentionNormalizer`).

    Raises:
        ValueError: for an unknown normaliser or a bad ``k``/``epsilon``/``backend``.
    """

    def __init__(self, query_dim: int, attention_dim: int, normalizer: str = "softmax",
                 topk: int = 5, epsilon: float = 0.1, backend: str = "auto"):
        super().__init__()
        self.normalizer = AttentionNormalizer(normalizer, k=topk, epsilon=epsilon, backend=backend)
        self.query_proj = nn.Linear(query_dim, attention_dim, bias=False)  # W
        self.score_proj = nn.Linear(attention_dim, 1, bias=False)  # v

    def score(self, query: Tensor, keys: Tensor) -> Tensor:
        """Unnormalised scores ``v^T tanh(W s + k_j)``.

        Args:
            query: decoder states ``s``, ``(batch, query_dim)``, float.
            keys: projected keys ``k_j = U h_j + b``, ``(src_len, batch, attention_dim)``.

        Returns:
            Scores, ``(batch, src_len)``.
        """
        hidden = torch.tanh(keys + self.query_proj(query).unsqueeze(0))  # src_len x batch x attention_dim
        return self.score_proj(hidden).squeeze(-1).t()

    def normalize(self, scores: Tensor, key_padding_mask: Tensor) -> Tensor:
        """Attention weights from scores: the one normalisation hook.

        Args:
            scores: ``(batch, src_len)``, float.
            key_padding_mask: ``(batch, src_len)``, bool; True marks padding, which gets weight
                0. Every row needs at least one False.

        Returns:
            Weights, ``(batch, src_len)``, same dtype as ``scores``; each row sums to 1.
        """
        return self.normalizer(scores, key_padding_mask)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, key_padding_mask: Tensor) -> Tuple[Tensor, Tensor]:
        """Context vector ``c = sum_j a_j h_j`` for one decoder step.

        Args:
            query: decoder states ``s``, ``(batch, query_dim)``, float.
            keys: projected keys ``U h_j + b``, ``(src_len, batch, attention_dim)``.
            values: encoder states ``h_j``, ``(src_len, batch, value_dim)``.
            key_padding_mask: ``(batch, src_len)``, bool, True at padding.

        Returns:
            ``(context, weights)``: ``(batch, value_dim)`` and ``(batch, src_len)``.
        """
        weights = self.normalize(self.score(query, keys), key_padding_mask)
        # (batch, 1, src_len) @ (batch, src_len, value_dim) -> (batch, value_dim)
        context = torch.bmm(weights.unsqueeze(1), values.transpose(0, 1)).squeeze(1)
        return context, weights
