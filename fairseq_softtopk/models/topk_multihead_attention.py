"""fairseq's multi-head attention with a pluggable normaliser in place of its softmax.

fairseq's :class:`~fairseq.modules.multihead_attention.MultiheadAttention` computes
``softmax(q k^T / sqrt(d))`` itself, and whenever there is no incremental state (training,
teacher forcing, the encoder) it hands the whole computation to the fused
``F.multi_head_attention_forward``, which no subclass hook can reach. This subclass keeps
fairseq's projections, masking and incremental-state bookkeeping (time-first ``T x B x C``,
``reorder_incremental_state``, the beam-size shortcut of encoder-decoder attention) and
replaces only the step from scores to weights.
"""

from typing import Dict, Optional, Tuple

import torch
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor

from fairseq_softtopk.modules.attention_normalizer import AttentionNormalizer

__all__ = ["TopKMultiheadAttention"]


class TopKMultiheadAttention(MultiheadAttention):
    """Multi-head attention whose weights come from an :class:`AttentionNormalizer`.

    With ``AttentionNormalizer("soft_topk", k, epsilon)`` this is the top-k attention of
    "Differentiable Top-k with Optimal Transport" (Xie et al., NeurIPS 2020), appendix C.3:
    each head's weights are ``softmax(s + log A)`` with ``A`` the SOFT top-k indicator of its
    scores ``s`` over the unmasked keys (``"hard_topk"``: the exact indicator). Padding and
    ``attn_mask`` entries of ``-inf`` are excluded from the selection; rows with at most k
    unmasked keys (early positions under a causal mask, short sources) get plain softmax.

    Args:
        embed_dim: model size ``C``; ``num_heads`` must divide it.
        num_heads: attention heads; each normalises its own scores.
        normalizer: the score-to-weight map (it has no parameters; the state dict is that of
            fairseq's ``MultiheadAttention``, so checkpoints convert both ways).
        kdim: key size (default ``embed_dim``).
        vdim: value size (default ``embed_dim``).
        dropout: dropout on the attention weights (after normalisation, as in fairseq).
        bias: biases on the projections.
        add_bias_kv: learned bias key/value appended to the sequence.
        add_zero_attn: zero key/value appended to the sequence.
        self_attention: queries, keys and values are the same sequence.
        encoder_decoder_attention: keys and values are encoder states (cached once per
            sentence in incremental decoding).
        q_noise: quantisation noise amount.
        qn_block_size: quantisation noise block size.
    """

    def __init__(self, embed_dim: int, num_heads: int, normalizer: AttentionNormalizer,
                 kdim: Optional[int] = None, vdim: Optional[int] = None, dropout: float = 0.0,
                 bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False,
                 self_attention: bool = False, encoder_decoder_attention: bool = False,
                 q_noise: float = 0.0, qn_block_size: int = 8):
        super().__init__(embed_dim, num_heads, kdim=kdim, vdim=vdim, dropout=dropout, bias=bias,
                         add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                         self_attention=self_attention, encoder_decoder_attention=encoder_decoder_attention,
                         q_noise=q_noise, qn_block_size=qn_block_size)
        self.normalizer = normalizer
        # The parent's forward takes the fused F.multi_head_attention_forward path (its own
        # softmax) unless this flag is set; the flag's only other effect is to skip the
        # parent's query-size assertion, which forward() checks itself.
        self.skip_embed_dim_check = True

    def forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                need_weights: bool = True, static_kv: bool = False, attn_mask: Optional[Tensor] = None,
                before_softmax: bool = False, need_head_weights: bool = False
                ) -> Tuple[Tensor, Optional[Tensor]]:
        """Attention with normalised weights; arguments and returns as in fairseq's forward.

        Args:
            query: ``(tgt_len, batch, embed_dim)``.
            key: ``(src_len, batch, kdim)``, or None for a cached encoder-decoder step.
            value: ``(src_len, batch, vdim)``, or None likewise.
            key_padding_mask: ``(batch, src_len)``, True (or 1) at padding keys.
            incremental_state: fairseq's incremental decoding cache (updated in place).
            need_weights: also return the weights averaged over heads.
            static_kv: keys/values are the same at every step (encoder-decoder attention).
            attn_mask: ``(tgt_len, src_len)`` additive float mask (``-inf`` = blocked).
            before_softmax: return the masked raw scores ``(batch * heads, tgt_len, src_len)``
                and the values instead, as fairseq does.
            need_head_weights: return per-head weights (implies ``need_weights``).

        Returns:
            ``(attn, weights)``: ``(tgt_len, batch, embed_dim)`` and, if asked for, (at least) float32
            weights ``(batch, tgt_len, src_len)`` (``(heads, batch, tgt_len, src_len)`` with
            ``need_head_weights``), else None.
        """
        tgt_len, bsz, embed_dim = query.size()
        if embed_dim != self.embed_dim:
            raise ValueError(f"query size {embed_dim} != embed_dim {self.embed_dim}")
        # fairseq's slow path: projections, cache, -inf at padding and at -inf attn_mask entries.
        scores, v = super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                    incremental_state=incremental_state, need_weights=False,
                                    static_kv=static_kv, attn_mask=attn_mask, before_softmax=True)
        if before_softmax:
            return scores, v
        src_len = scores.size(-1)
        # scores: (bsz * heads, tgt_len, src_len); -inf entries are excluded by the normaliser.
        # in at least float32 (fp16/bf16 scores are normalised in float32; float64 stays float64)
        weights_float = self.normalizer(scores.to(torch.promote_types(scores.dtype, torch.float32)))
        probs = self.dropout_module(weights_float.type_as(scores))
        attn = self._weighted_values(probs, v, bsz, tgt_len)  # tgt_len x bsz x embed_dim
        attn = self.out_proj(attn)
        if not (need_weights or need_head_weights):
            return attn, None
        head_weights = weights_float.view(bsz, self.num_heads, tgt_len, src_len).transpose(1, 0)
        return attn, (head_weights if need_head_weights else head_weights.mean(dim=0))

    def _weighted_values(self, probs: Tensor, v: Tensor, bsz: int, tgt_len: int) -> Tensor:
        """``probs @ v`` per head, heads merged back.

        Args:
            probs: ``(bsz * heads, tgt_len, src_len)``.
            v: ``(kv_bsz * heads, src_len, head_dim)``; ``kv_bsz < bsz`` when encoder-decoder
                attention keeps one copy of the encoder states per sentence in beam search.

        Returns:
            ``(tgt_len, bsz, embed_dim)``.
        """
        kv_bsz = v.size(0) // self.num_heads
        if kv_bsz != bsz:  # B = kv_bsz sentences x beam X queries each
            attn = torch.einsum("bxhts,bhsd->bxhtd",
                                probs.view(kv_bsz, -1, self.num_heads, tgt_len, probs.size(-1)),
                                v.view(kv_bsz, self.num_heads, -1, self.head_dim))
            attn = attn.reshape(bsz * self.num_heads, tgt_len, self.head_dim)
        else:
            attn = torch.bmm(probs, v)  # (bsz * heads) x tgt_len x head_dim
        return attn.transpose(0, 1).reshape(tgt_len, bsz, self.embed_dim)
