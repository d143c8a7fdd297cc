"""Attentional LSTM decoder of ``softtopk_lstm``, with a one-step API on input embeddings.

One step (``x`` the input embedding, ``o`` the attentional output fed back as input feeding):

* ``s_t, m_t = LSTM([x_t; o_{t-1}], (s_{t-1}, m_{t-1}))`` (stacked ``LSTMCell`` s),
* ``a_t = normalize(v^T tanh(W s_t + U h_j + b))``, ``c_t = sum_j a_tj h_j`` (additive attention
  of Bahdanau et al., 2014, queried with the new state as in Luong et al., 2015),
* ``o_t = tanh(W_o [s_t; c_t])``, the input feed of the next step,
* readout ``r_t = maxout_p(W_r [o_t; x_t])`` (Bahdanau's deep output with ``p`` pieces), and
  ``logits = W_y r_t`` (``W_y`` tied to the embeddings with ``--share-decoder-input-output-embed``).

:meth:`SoftTopKLSTMDecoder.step` runs one step on given embeddings and state (for the
differentiable beam-search criterion, which feeds back soft-weighted embeddings and mixed
states); :meth:`SoftTopKLSTMDecoder.forward` runs the same computation over a sequence, with
fairseq's incremental state for ``SequenceGenerator``.
"""

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.models import FairseqIncrementalDecoder
from fairseq.modules import FairseqDropout
from torch import Tensor, nn

from fairseq_softtopk.models.softtopk_lstm_encoder import SoftTopKLSTMEncoderOut
from fairseq_softtopk.modules.additive_attention import AdditiveAttention
from fairseq_softtopk.modules.uniform_init import uniform_init_

__all__ = ["SoftTopKLSTMDecoder", "SoftTopKLSTMDecoderState"]

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


class SoftTopKLSTMDecoderState(NamedTuple):
    """Recurrent state between decoder steps; batch-first, so states can be mixed or reordered along dim 0.

    Attributes:
        hidden: LSTM hidden states ``s``, ``(batch, num_layers, hidden_size)``.
        cell: LSTM cell states, ``(batch, num_layers, hidden_size)``.
        input_feed: attentional output ``o`` of the previous step, ``(batch, hidden_size)``.
    """

    hidden: Tensor
    cell: Tensor
    input_feed: Tensor


class SoftTopKLSTMDecoder(FairseqIncrementalDecoder):
    """LSTM decoder with additive attention, input feeding and a maxout readout.

    Args:
        dictionary: target :class:`fairseq.data.Dictionary`.
        embed_dim: token embedding size.
        hidden_size: LSTM size (also the size of the input feed ``o``).
        num_layers: stacked ``LSTMCell`` s.
        out_embed_dim: readout size (size of ``r``); must equal ``embed_dim`` when sharing.
        maxout_pieces: pieces of the readout maxout; 1 makes it a linear bottleneck.
        encoder_output_dim: size of the encoder annotations ``h_j``.
        encoder_summary_dim: size of ``SoftTopKLSTMEncoderOut.backward_first``.
        attention_dim: size of the attention's projected keys.
        attention_normalizer: see :class:`AdditiveAttention` (``normalizer``).
        attention_topk: see :class:`AdditiveAttention` (``topk``).
        attention_topk_epsilon: see :class:`AdditiveAttention` (``epsilon``).
        attention_topk_backend: see :class:`AdditiveAttention` (``backend``).
        dropout: on the embeddings, between layers, on ``o`` and on the readout.
        share_input_output_embed: tie the output projection to the embedding matrix.
        max_target_positions: longest target accepted (fairseq's ``max_positions``).

    Raises:
        ValueError: if sharing embeddings with ``out_embed_dim != embed_dim``, or for
            ``maxout_pieces < 1``.
    """

    def __init__(self, dictionary, embed_dim: int, hidden_size: int, num_layers: int, out_embed_dim: int,
                 maxout_pieces: int, encoder_output_dim: int, encoder_summary_dim: int, attention_dim: int,
                 attention_normalizer: str, attention_topk: int, attention_topk_epsilon: float,
                 dropout: float, share_input_output_embed: bool, max_target_positions: int,
                 attention_topk_backend: str = "auto"):
        super().__init__(dictionary)
        if share_input_output_embed and out_embed_dim != embed_dim:
            raise ValueError(f"--share-decoder-input-output-embed needs decoder_out_embed_dim ({out_embed_dim}) "
                             f"== decoder_embed_dim ({embed_dim})")
        if maxout_pieces < 1:
            raise ValueError(f"maxout_pieces must be >= 1, got {maxout_pieces}")
        self.padding_idx = dictionary.pad()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.out_embed_dim = out_embed_dim
        self.maxout_pieces = maxout_pieces
        self.max_target_positions = max_target_positions
        self.embed_tokens = nn.Embedding(len(dictionary), embed_dim, padding_idx=self.padding_idx)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.init_proj = nn.Linear(encoder_summary_dim, num_layers * hidden_size)  # W_s
        self.layers = nn.ModuleList(
            nn.LSTMCell(embed_dim + hidden_size if i == 0 else hidden_size, hidden_size) for i in range(num_layers)
        )
        self.attention = AdditiveAttention(hidden_size, attention_dim, normalizer=attention_normalizer,
                                           topk=attention_topk, epsilon=attention_topk_epsilon,
                                           backend=attention_topk_backend)
        self.attention_out_proj = nn.Linear(hidden_size + encoder_output_dim, hidden_size, bias=False)  # W_o
        self.readout_proj = nn.Linear(hidden_size + embed_dim, maxout_pieces * out_embed_dim)  # W_r
        self.output_proj = None if share_input_output_embed else nn.Linear(out_embed_dim, len(dictionary))  # W_y
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(-0.1, 0.1) everywhere (as fairseq's ``lstm``), zero padding embedding."""
        uniform_init_(self, self.embed_tokens, self.padding_idx)

    # ----- the one-step API (differentiable beam search) -----

    def initial_state(self, encoder_out: SoftTopKLSTMEncoderOut) -> SoftTopKLSTMDecoderState:
        """State before the first step: ``s_0 = tanh(W_s h_1)`` per layer, zero cells and input feed.

        Args:
            encoder_out: the encoder's output for ``batch`` sentences.

        Returns:
            :class:`SoftTopKLSTMDecoderState` for ``batch`` sentences.
        """
        summary = encoder_out.backward_first  # batch x encoder_summary_dim
        hidden = torch.tanh(self.init_proj(summary)).view(-1, self.num_layers, self.hidden_size)
        cell = torch.zeros_like(hidden)
        return SoftTopKLSTMDecoderState(hidden, cell, hidden.new_zeros(hidden.size(0), self.hidden_size))

    def embed(self, tokens: Tensor) -> Tensor:
        """Token embeddings as :meth:`forward` uses them, before dropout.

        Args:
            tokens: ``(batch,)`` (or any shape), long.

        Returns:
            ``embedding_matrix()[tokens]``, ``(batch, embed_dim)``.
        """
        return self.embed_tokens(tokens)

    def embedding_matrix(self) -> Tensor:
        """The input embedding matrix, ``(vocab, embed_dim)`` (the parameter itself, not a copy)."""
        return self.embed_tokens.weight

    def step(self, input_embeddings: Tensor, state: SoftTopKLSTMDecoderState,
             encoder_out: SoftTopKLSTMEncoderOut) -> Tuple[Tensor, SoftTopKLSTMDecoderState]:
        """One decoding step on input embeddings; applies dropout as :meth:`forward` does.

        Args:
            input_embeddings: embedding of the previous output (any mixture of rows of
                :meth:`embedding_matrix`), ``(batch, embed_dim)``, float.
            state: state after the previous step (or :meth:`initial_state`) for ``batch``.
            encoder_out: encoder output for ``batch`` (see ``reorder_encoder_out``).

        Returns:
            ``(log_probs, new_state)``: next-token log-probabilities ``(batch, vocab)``
            (float32, or float64 for a float64 model) and the new state.
        """
        x = self.dropout_module(input_embeddings)
        output, new_state, _ = self._recurrent_step(x, state, encoder_out)
        logits = self.output_layer(self._readout(output, x))
        return self.get_normalized_probs((logits, None), log_probs=True), new_state

    def get_normalized_probs(self, net_output: Tuple[Tensor, Optional[Dict[str, List[Tensor]]]], log_probs: bool,
                             sample: Optional[Dict[str, Tensor]] = None) -> Tensor:
        """(Log-)softmax of ``net_output[0]`` ``(..., vocab)``, like fairseq's but in float32 *or wider*.

        fairseq casts to float32; keeping float64 lets the beam-search criterion be gradchecked.
        ``sample`` is not used (no adaptive softmax).
        """
        logits = net_output[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        if log_probs:
            return F.log_softmax(logits, dim=-1, dtype=dtype)
        return F.softmax(logits, dim=-1, dtype=dtype)

    # ----- fairseq decoder API -----

    def forward(self, prev_output_tokens: Tensor, encoder_out: SoftTopKLSTMEncoderOut,
                incremental_state: Optional[IncrementalState] = None) -> Tuple[Tensor, Dict[str, List[Tensor]]]:
        """Teacher-forced (or incremental) decoding.

        Args:
            prev_output_tokens: ``(batch, tgt_len)``, long; with a non-empty
                ``incremental_state`` only the last column is used.
            encoder_out: the encoder's output for ``batch``.
            incremental_state: fairseq's cache for step-by-step generation, or None.

        Returns:
            ``(logits, {"attn": [attn]})``: ``(batch, tgt_len, vocab)`` and attention weights
            ``(batch, tgt_len, src_len)`` (``tgt_len`` is 1 when continuing incrementally).
        """
        features, attn = self.extract_features(prev_output_tokens, encoder_out, incremental_state)
        return self.output_layer(features), {"attn": [attn]}

    def extract_features(self, prev_output_tokens: Tensor, encoder_out: SoftTopKLSTMEncoderOut,
                         incremental_state: Optional[IncrementalState] = None) -> Tuple[Tensor, Tensor]:
        """Readout features ``r`` (after dropout) for every target position.

        Args:
            prev_output_tokens: ``(batch, tgt_len)``, long.
            encoder_out: the encoder's output for ``batch``.
            incremental_state: fairseq's cache, or None.

        Returns:
            ``(features, attn)``: ``(batch, tgt_len, out_embed_dim)`` and ``(batch, tgt_len, src_len)``.
        """
        state = self._cached_state(incremental_state)
        if state is None:
            state = self.initial_state(encoder_out)
        else:
            prev_output_tokens = prev_output_tokens[:, -1:]
        x = self.dropout_module(self.embed_tokens(prev_output_tokens))  # batch x tgt_len x embed
        outputs, attns = [], []
        for t in range(x.size(1)):
            output, state, attn = self._recurrent_step(x[:, t], state, encoder_out)
            outputs.append(output)
            attns.append(attn)
        if incremental_state is not None:
            self.set_incremental_state(incremental_state, "cached_state", state._asdict())
        features = self._readout(torch.stack(outputs, dim=1), x)  # batch x tgt_len x out_embed_dim
        return features, torch.stack(attns, dim=1)

    def output_layer(self, features: Tensor) -> Tensor:
        """Logits ``W_y r``: ``(..., out_embed_dim)`` -> ``(..., vocab)``."""
        if self.output_proj is None:
            return F.linear(features, self.embed_tokens.weight)
        return self.output_proj(features)

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor) -> None:
        """Selects the cached states of ``new_order`` (``(new_batch,)``, long), e.g. surviving beams."""
        state = self._cached_state(incremental_state)
        if state is None:
            return
        reordered = {name: tensor.index_select(0, new_order) for name, tensor in state._asdict().items()}
        self.set_incremental_state(incremental_state, "cached_state", reordered)

    def max_positions(self) -> int:
        """Longest target accepted."""
        return self.max_target_positions

    # ----- internals shared by step and forward -----

    def _cached_state(self, incremental_state: Optional[IncrementalState]) -> Optional[SoftTopKLSTMDecoderState]:
        if incremental_state is None:
            return None
        cached = self.get_incremental_state(incremental_state, "cached_state")
        if cached is None:
            return None
        return SoftTopKLSTMDecoderState(cached["hidden"], cached["cell"], cached["input_feed"])

    def _recurrent_step(self, x: Tensor, state: SoftTopKLSTMDecoderState,
                        encoder_out: SoftTopKLSTMEncoderOut) -> Tuple[Tensor, SoftTopKLSTMDecoderState, Tensor]:
        """LSTM layers, attention and ``o_t``; ``x`` is the dropped-out embedding ``(batch, embed_dim)``.

        Returns ``(o_t, new_state, attention weights)``: ``(batch, hidden_size)``, the state,
        ``(batch, src_len)``.
        """
        layer_input = torch.cat([x, self.dropout_module(state.input_feed)], dim=1)
        hiddens, cells = [], []
        for i, layer in enumerate(self.layers):
            hidden, cell = layer(layer_input, (state.hidden[:, i], state.cell[:, i]))
            hiddens.append(hidden)
            cells.append(cell)
            layer_input = self.dropout_module(hidden)
        context, attn = self.attention(hidden, encoder_out.attention_keys, encoder_out.states,
                                       encoder_out.padding_mask)
        output = torch.tanh(self.attention_out_proj(torch.cat([hidden, context], dim=1)))
        new_state = SoftTopKLSTMDecoderState(torch.stack(hiddens, dim=1), torch.stack(cells, dim=1), output)
        return output, new_state, attn

    def _readout(self, output: Tensor, x: Tensor) -> Tensor:
        """Maxout readout ``r = maxout_p(W_r [o; x])`` with dropout: ``(..., hidden)``, ``(..., embed)`` -> ``(..., out_embed_dim)``."""
        pre = self.readout_proj(torch.cat([self.dropout_module(output), x], dim=-1))
        if self.maxout_pieces > 1:
            pre = pre.view(*pre.shape[:-1], self.out_embed_dim, self.maxout_pieces).amax(dim=-1)
        return self.dropout_module(pre)
