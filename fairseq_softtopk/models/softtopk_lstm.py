"""``softtopk_lstm``: attentional LSTM encoder-decoder (Bahdanau et al., 2014) for beam-search training.

Registered with fairseq as model ``softtopk_lstm`` and architectures ``softtopk_lstm_tiny``
(tests), ``softtopk_lstm_multi30k`` (CPU-sized, the config defaults) and
``softtopk_lstm_wmt14`` (the RNNsearch size). The decoder's one-step API
(:meth:`SoftTopKLSTMDecoder.step` and friends) is what the ``soft_beam_search`` criterion uses;
``fairseq-generate`` decodes the same checkpoints with ordinary beam search.
"""

import dataclasses
from dataclasses import dataclass, field

from fairseq.models import FairseqEncoderDecoderModel, register_model, register_model_architecture
from fairseq.utils import safe_getattr
from omegaconf import II

from fairseq_softtopk.models._attention_config import AttentionNormalizerConfig, check_model_options
from fairseq_softtopk.models.softtopk_lstm_decoder import SoftTopKLSTMDecoder, SoftTopKLSTMDecoderState
from fairseq_softtopk.models.softtopk_lstm_encoder import SoftTopKLSTMEncoder, SoftTopKLSTMEncoderOut

__all__ = [
    "SoftTopKLSTMConfig",
    "SoftTopKLSTMDecoder",
    "SoftTopKLSTMDecoderState",
    "SoftTopKLSTMEncoder",
    "SoftTopKLSTMEncoderOut",
    "SoftTopKLSTMModel",
]


@dataclass
class SoftTopKLSTMConfig(AttentionNormalizerConfig):
    """Options of ``softtopk_lstm``; the defaults are the ``softtopk_lstm_multi30k`` sizes."""

    dropout: float = field(default=0.3, metadata={
        "help": "dropout on embeddings, between LSTM layers, on encoder annotations, attentional output and readout"})
    encoder_embed_dim: int = field(default=256, metadata={"help": "source embedding size"})
    encoder_hidden_size: int = field(default=256, metadata={
        "help": "encoder LSTM size per direction (annotations are twice as large)"})
    encoder_layers: int = field(default=1, metadata={"help": "stacked bidirectional encoder layers"})
    decoder_embed_dim: int = field(default=256, metadata={"help": "target embedding size"})
    decoder_hidden_size: int = field(default=512, metadata={"help": "decoder LSTM size (and input-feeding size)"})
    decoder_layers: int = field(default=1, metadata={"help": "stacked decoder LSTM layers"})
    decoder_out_embed_dim: int = field(default=256, metadata={
        "help": "size of the maxout readout before the output projection; must equal --decoder-embed-dim "
                "with --share-decoder-input-output-embed"})
    decoder_maxout_pieces: int = field(default=2, metadata={
        "help": "pieces of the readout maxout (1: linear bottleneck)"})
    attention_dim: int = field(default=256, metadata={
        "help": "hidden size of the additive attention, v^T tanh(W s + U h_j)"})
    share_decoder_input_output_embed: bool = field(default=False, metadata={
        "help": "tie the decoder output projection to its input embeddings"})
    max_source_positions: int = II("task.max_source_positions")
    max_target_positions: int = II("task.max_target_positions")
    bf16: bool = II("common.bf16")  # refused without torch_xla (option_checks.check_bf16)
    cpu: bool = II("common.cpu")  # --attention-topk-backend triton is refused with --cpu (check_model_options)


@register_model("softtopk_lstm", dataclass=SoftTopKLSTMConfig)
class SoftTopKLSTMModel(FairseqEncoderDecoderModel):
    """Bidirectional LSTM encoder, LSTM decoder with additive attention and input feeding.

    After "Neural Machine Translation by Jointly Learning to Align and Translate" (Bahdanau,
    Cho and Bengio, 2014) with LSTMs instead of GRUs and Luong et al.'s (2015) input feeding;
    see :mod:`fairseq_softtopk.models.softtopk_lstm_decoder` for the step equations.

    Args:
        encoder: a :class:`SoftTopKLSTMEncoder`.
        decoder: a :class:`SoftTopKLSTMDecoder`.
    """

    @classmethod
    def build_model(cls, cfg: SoftTopKLSTMConfig, task) -> "SoftTopKLSTMModel":
        """Builds the model from ``cfg`` and the task's dictionaries.

        Raises:
            ValueError: for a bad attention option or ``--bf16`` (:func:`check_model_options`).
        """
        check_model_options(cfg)
        encoder = SoftTopKLSTMEncoder(
            task.source_dictionary,
            embed_dim=cfg.encoder_embed_dim,
            hidden_size=cfg.encoder_hidden_size,
            num_layers=cfg.encoder_layers,
            attention_dim=cfg.attention_dim,
            dropout=cfg.dropout,
            max_source_positions=cfg.max_source_positions,
        )
        decoder = SoftTopKLSTMDecoder(
            task.target_dictionary,
            embed_dim=cfg.decoder_embed_dim,
            hidden_size=cfg.decoder_hidden_size,
            num_layers=cfg.decoder_layers,
            out_embed_dim=cfg.decoder_out_embed_dim,
            maxout_pieces=cfg.decoder_maxout_pieces,
            encoder_output_dim=encoder.output_dim,
            encoder_summary_dim=cfg.encoder_hidden_size,
            attention_dim=cfg.attention_dim,
            attention_normalizer=cfg.attention_normalizer,
            attention_topk=cfg.attention_topk,
            attention_topk_epsilon=cfg.attention_topk_epsilon,
            attention_topk_backend=str(cfg.attention_topk_backend),
            dropout=cfg.dropout,
            share_input_output_embed=cfg.share_decoder_input_output_embed,
            max_target_positions=cfg.max_target_positions,
        )
        return cls(encoder, decoder)

    def set_num_updates(self, num_updates: int) -> None:
        """Remembers the update number (fairseq calls this before every training step and on loading).

        The ``soft_beam_search`` criterion reads ``num_updates`` for its epsilon schedule.
        """
        super().set_num_updates(num_updates)
        self.num_updates = num_updates

    def forward(self, src_tokens, src_lengths, prev_output_tokens, beam_search=None, **kwargs):
        """Teacher-forced forward; with ``beam_search``, also runs it on the same encoder output.

        Args:
            src_tokens: ``(batch, src_len)`` source token ids.
            src_lengths: ``(batch,)`` source lengths.
            prev_output_tokens: ``(batch, tgt_len)`` shifted target (teacher forcing).
            beam_search: optional ``(encoder, decoder, encoder_out) -> result`` callable (the
                ``soft_beam_search`` criterion's unrolled search). It runs inside ``forward`` so
                that DistributedDataParallel, which only synchronises gradients of work done
                in the wrapped module's forward, sees it.
        Returns:
            the decoder output; with ``beam_search``, ``(decoder output, beam_search result)``.
        """
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        decoder_out = self.decoder(prev_output_tokens, encoder_out=encoder_out, **kwargs)
        if beam_search is None:
            return decoder_out
        return decoder_out, beam_search(self.encoder, self.decoder, encoder_out)


def _set_defaults(args, **defaults) -> None:
    """Sets each option not given on the command line (architecture functions), then each other option of
    :class:`SoftTopKLSTMConfig` that ``args`` lacks to its default: a checkpoint saved before an option existed
    (its stored config lacks it; fairseq-generate builds the model from that config through this function)
    still builds, as it trained (a new option's default is the behaviour from before it)."""
    for name, value in defaults.items():
        setattr(args, name, safe_getattr(args, name, value))
    for option in dataclasses.fields(SoftTopKLSTMConfig):
        default = option.default
        if default is dataclasses.MISSING or (isinstance(default, str) and default.startswith("${")):
            continue  # interpolations (II): fairseq fills them from the other config groups
        if safe_getattr(args, option.name, None) is None:
            setattr(args, option.name, default)


@register_model_architecture("softtopk_lstm", "softtopk_lstm_tiny")
def softtopk_lstm_tiny(args) -> None:
    """Dimensions 8-16, one layer each: for tests."""
    _set_defaults(args, dropout=0.1, encoder_embed_dim=8, encoder_hidden_size=8, encoder_layers=1,
                  decoder_embed_dim=8, decoder_hidden_size=16, decoder_layers=1, decoder_out_embed_dim=8,
                  attention_dim=8)


@register_model_architecture("softtopk_lstm", "softtopk_lstm_multi30k")
def softtopk_lstm_multi30k(args) -> None:
    """CPU-sized (10,964,056 parameters with the joined 7,768-type Multi30k dictionary): the config defaults."""
    _set_defaults(args, dropout=0.3, encoder_embed_dim=256, encoder_hidden_size=256, encoder_layers=1,
                  decoder_embed_dim=256, decoder_hidden_size=512, decoder_layers=1, decoder_out_embed_dim=256,
                  decoder_maxout_pieces=2, attention_dim=256)


@register_model_architecture("softtopk_lstm", "softtopk_lstm_wmt14")
def softtopk_lstm_wmt14(args) -> None:
    """RNNsearch size (Bahdanau et al., 2014, appendix A.2): embeddings 620, 1000 units per
    encoder direction and in the decoder, alignment model 1000, maxout readout 500 (2 pieces).

    Unlike the paper: LSTMs instead of GRUs, input feeding, and dropout 0.3 (the paper trained
    without dropout).
    """
    _set_defaults(args, dropout=0.3, encoder_embed_dim=620, encoder_hidden_size=1000, encoder_layers=1,
                  decoder_embed_dim=620, decoder_hidden_size=1000, decoder_layers=1, decoder_out_embed_dim=500,
                  decoder_maxout_pieces=2, attention_dim=1000)
