"""Bidirectional LSTM encoder of ``softtopk_lstm`` (Bahdanau et al., 2014, section 3.2)."""

from typing import NamedTuple

from fairseq.models import FairseqEncoder
from fairseq.modules import FairseqDropout
from torch import Tensor, nn

from fairseq_softtopk.modules.uniform_init import uniform_init_

__all__ = ["SoftTopKLSTMEncoder", "SoftTopKLSTMEncoderOut"]


class SoftTopKLSTMEncoderOut(NamedTuple):
    """What :class:`SoftTopKLSTMEncoder` returns; positions follow ``src_tokens`` (left or right padded).

    Attributes:
        states: annotations ``h_j = [forward h_j; backward h_j]`` of the top layer,
            ``(src_len, batch, 2 * hidden_size)``; zero at padding.
        attention_keys: ``U h_j + b`` for :class:`~fairseq_softtopk.modules.additive_attention.AdditiveAttention`,
            ``(src_len, batch, attention_dim)``.
        padding_mask: ``(batch, src_len)``, bool, True at padding.
        backward_first: the backward top-layer LSTM's state at the first source token,
            ``(batch, hidden_size)``; initialises the decoder (``s_0 = tanh(W_s h_1)``).
    """

    states: Tensor
    attention_keys: Tensor
    padding_mask: Tensor
    backward_first: Tensor


class SoftTopKLSTMEncoder(FairseqEncoder):
    """Embeddings, a bidirectional LSTM and the attention-key projection ``U``.

    Args:
        dictionary: source :class:`fairseq.data.Dictionary`.
        embed_dim: token embedding size.
        hidden_size: LSTM size per direction (annotations have ``2 * hidden_size``).
        num_layers: stacked bidirectional layers.
        attention_dim: size of the projected keys ``U h_j + b``.
        dropout: on the embeddings, between layers and on the annotations.
        max_source_positions: longest source accepted (fairseq's ``max_positions``).
    """

    def __init__(self, dictionary, embed_dim: int, hidden_size: int, num_layers: int, attention_dim: int,
                 dropout: float, max_source_positions: int):
        super().__init__(dictionary)
        self.padding_idx = dictionary.pad()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.output_dim = 2 * hidden_size
        self.max_source_positions = max_source_positions
        self.embed_tokens = nn.Embedding(len(dictionary), embed_dim, padding_idx=self.padding_idx)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.lstm = nn.LSTM(embed_dim, hidden_size, num_layers=num_layers, bidirectional=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.attention_key_proj = nn.Linear(self.output_dim, attention_dim)  # U and b
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(-0.1, 0.1) everywhere (as fairseq's ``lstm``), zero padding embedding."""
        uniform_init_(self, self.embed_tokens, self.padding_idx)

    def forward(self, src_tokens: Tensor, src_lengths: Tensor) -> SoftTopKLSTMEncoderOut:
        """Encodes a batch; rows may be left or right padded (each row's padding contiguous).

        Args:
            src_tokens: ``(batch, src_len)``, long.
            src_lengths: non-padding tokens per row, ``(batch,)``, long, all > 0.

        Returns:
            :class:`SoftTopKLSTMEncoderOut` in the layout of ``src_tokens``.
        """
        batch, src_len = src_tokens.shape
        padding_mask = src_tokens.eq(self.padding_idx)
        # Packing needs right padding: order[b, p] is the original position of the token that
        # goes to slot p (tokens first, pads last, stable), inverse maps it back afterwards.
        order = padding_mask.long().argsort(dim=1, stable=True)  # batch x src_len
        inverse = order.argsort(dim=1)
        tokens = src_tokens.gather(1, order)
        x = self.dropout_module(self.embed_tokens(tokens)).transpose(0, 1)  # src_len x batch x embed
        packed = nn.utils.rnn.pack_padded_sequence(x, src_lengths.cpu(), enforce_sorted=False)
        packed_states, (final_hidden, _) = self.lstm(packed)
        states, _ = nn.utils.rnn.pad_packed_sequence(packed_states, total_length=src_len)  # right padded, 0 at pads
        index = inverse.t().unsqueeze(-1).expand(-1, -1, self.output_dim)  # src_len x batch x 2H
        states = self.dropout_module(states.gather(0, index))
        # final_hidden: (num_layers * 2) x batch x hidden; the backward direction ends at token 1
        backward_first = final_hidden.view(self.num_layers, 2, batch, self.hidden_size)[-1, 1]
        return SoftTopKLSTMEncoderOut(
            states=states,
            attention_keys=self.attention_key_proj(states),
            padding_mask=padding_mask,
            backward_first=backward_first,
        )

    def reorder_encoder_out(self, encoder_out: SoftTopKLSTMEncoderOut, new_order: Tensor) -> SoftTopKLSTMEncoderOut:
        """Selects (and repeats) sentences, e.g. to expand a batch to ``batch * beam``.

        Args:
            encoder_out: output of :meth:`forward`.
            new_order: indices into the batch, ``(new_batch,)``, long.

        Returns:
            :class:`SoftTopKLSTMEncoderOut` of ``new_batch`` sentences.
        """
        return SoftTopKLSTMEncoderOut(
            states=encoder_out.states.index_select(1, new_order),
            attention_keys=encoder_out.attention_keys.index_select(1, new_order),
            padding_mask=encoder_out.padding_mask.index_select(0, new_order),
            backward_first=encoder_out.backward_first.index_select(0, new_order),
        )

    def max_positions(self) -> int:
        """Longest source accepted."""
        return self.max_source_positions
