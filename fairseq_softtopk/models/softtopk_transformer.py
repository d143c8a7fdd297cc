"""``softtopk_transformer``: fairseq's Transformer with top-k encoder-decoder attention.

Registered with fairseq as model ``softtopk_transformer`` and architectures
``softtopk_transformer_tiny`` (tests), ``softtopk_transformer_multi30k`` (CPU-sized),
``softtopk_transformer_prenorm_multi30k`` (pre-LN, for beam-search training) and
``softtopk_transformer_wmt16`` (Transformer base). Every encoder-decoder attention, and with
``--attention-normalize-self-attention`` every self-attention too, is a
:class:`~fairseq_softtopk.models.topk_multihead_attention.TopKMultiheadAttention` whose
weights come from ``--attention-normalizer`` (``soft_topk``: Xie et al. 2020, appendix C.3).
The parameters, and so the checkpoints, are exactly those of fairseq's ``transformer``.

The model subclasses fairseq's legacy ``TransformerModel`` (argparse ``add_args`` plus
``register_model_architecture``), the one configuration path of fairseq 0.12's Transformer
that ``fairseq-train``, ``fairseq-generate`` and checkpoint loading all support; the four new
options are declared once, in :class:`SoftTopKAttentionConfig`, and generated into argparse.

The paper's "WMT16 En-De" experiment follows OpenNMT-py's ``extended.html`` example, which
is the WMT'16 *multimodal* task (Multi30k) with OpenNMT-py's default 2-layer LSTM;
``softtopk_transformer_wmt16`` is Transformer base as in OpenNMT-py's Transformer recipe
(see ``configs/softtopk_transformer_wmt16.sh``), not the paper's model.
"""

from dataclasses import dataclass, field, fields
from typing import Optional

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (TransformerConfig, TransformerDecoderBase, TransformerEncoderBase,
                                        TransformerModel, base_architecture)
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.utils import safe_getattr

from fairseq_softtopk.models._attention_config import AttentionNormalizerConfig, check_model_options
from fairseq_softtopk.modules.attention_normalizer import AttentionNormalizer
from fairseq_softtopk.models.topk_multihead_attention import TopKMultiheadAttention
from fairseq_softtopk.renamed_options import alias_metadata, use_renamed

__all__ = [
    "SoftTopKAttentionConfig",
    "SoftTopKTransformerDecoder",
    "SoftTopKTransformerDecoderLayer",
    "SoftTopKTransformerEncoder",
    "SoftTopKTransformerEncoderLayer",
    "SoftTopKTransformerModel",
]


@dataclass
class SoftTopKAttentionConfig(AttentionNormalizerConfig):
    """The options ``softtopk_transformer`` adds to fairseq's Transformer options."""

    attention_normalize_self_attention: bool = field(default=False, metadata={
        "help": "also normalise encoder and decoder self-attention with --attention-normalizer"})
    # deprecated alias (renamed_options): None = not given
    topk_self_attention: Optional[bool] = field(default=None, metadata=alias_metadata("topk_self_attention"))


def build_attention_normalizer(cfg) -> AttentionNormalizer:
    """The normaliser named by ``cfg`` (a namespace or ``TransformerConfig`` with the fields above)."""
    return AttentionNormalizer(cfg.attention_normalizer, k=cfg.attention_topk, epsilon=cfg.attention_topk_epsilon,
                               backend=str(cfg.attention_topk_backend))


class SoftTopKTransformerEncoderLayer(TransformerEncoderLayerBase):
    """Encoder layer whose self-attention uses the normaliser if ``cfg.attention_normalize_self_attention``."""

    def build_self_attention(self, embed_dim, cfg):
        if not cfg.attention_normalize_self_attention:
            return super().build_self_attention(embed_dim, cfg)
        return TopKMultiheadAttention(embed_dim, cfg.encoder.attention_heads, build_attention_normalizer(cfg),
                                      dropout=cfg.attention_dropout, self_attention=True,
                                      q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size)


class SoftTopKTransformerDecoderLayer(TransformerDecoderLayerBase):
    """Decoder layer with normalised encoder-decoder attention (and self-attention if asked)."""

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if not cfg.attention_normalize_self_attention:
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        return TopKMultiheadAttention(embed_dim, cfg.decoder.attention_heads, build_attention_normalizer(cfg),
                                      dropout=cfg.attention_dropout, add_bias_kv=add_bias_kv,
                                      add_zero_attn=add_zero_attn, self_attention=not cfg.cross_self_attention,
                                      q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size)

    def build_encoder_attention(self, embed_dim, cfg):
        return TopKMultiheadAttention(embed_dim, cfg.decoder.attention_heads, build_attention_normalizer(cfg),
                                      kdim=cfg.encoder.embed_dim, vdim=cfg.encoder.embed_dim,
                                      dropout=cfg.attention_dropout, encoder_decoder_attention=True,
                                      q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size)


def _wrap_layer(layer, cfg):
    """Activation checkpointing and FSDP wrapping, as fairseq's encoder and decoder do."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    min_params_to_wrap = cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0
    return fsdp_wrap(layer, min_num_params=min_params_to_wrap)


class SoftTopKTransformerEncoder(TransformerEncoderBase):
    """fairseq's Transformer encoder built from :class:`SoftTopKTransformerEncoderLayer`."""

    def build_encoder_layer(self, cfg):
        return _wrap_layer(SoftTopKTransformerEncoderLayer(cfg, return_fc=self.return_fc), cfg)


class SoftTopKTransformerDecoder(TransformerDecoderBase):
    """fairseq's Transformer decoder built from :class:`SoftTopKTransformerDecoderLayer`."""

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return _wrap_layer(SoftTopKTransformerDecoderLayer(cfg, no_encoder_attn), cfg)


@register_model("softtopk_transformer")
class SoftTopKTransformerModel(TransformerModel):
    """Transformer (Vaswani et al., 2017) with top-k attention (Xie et al., NeurIPS 2020, C.3).

    The encoder-decoder attention of every decoder layer (and the self-attention with
    ``--attention-normalize-self-attention``) computes its weights with ``--attention-normalizer``:
    ``softmax`` (fairseq's attention, unfused), ``soft_topk`` (``softmax(s + log A)``,
    ``A = soft_topk(s, k, epsilon)``), ``hard_topk`` (softmax over the exact top-k),
    ``sparsemax`` or ``entmax15``. ``fairseq-generate --print-alignment`` reads the last
    layer's encoder-decoder weights, which are these normalised weights.
    """

    @classmethod
    def add_args(cls, parser):
        """fairseq's Transformer options plus :class:`SoftTopKAttentionConfig`."""
        super().add_args(parser)
        gen_parser_from_dataclass(parser, SoftTopKAttentionConfig(), delete_default=True)

    @classmethod
    def build_model(cls, args, task):
        """Fills defaults, checks the normaliser options, builds as fairseq's Transformer does.

        Raises:
            ValueError: for a bad normaliser option or ``--bf16`` (:func:`check_model_options`), or xFormers
                attention (not supported).
        """
        softtopk_defaults(args)
        check_model_options(args)
        for side in ("encoder", "decoder"):
            if safe_getattr(args, f"{side}_xformers_att_config", None):
                raise ValueError(f"--{side}-xformers-att-config is not supported by softtopk_transformer")
        return super().build_model(args, task)

    def set_num_updates(self, num_updates: int) -> None:
        """Remembers the update number (for the epsilon schedule of ``soft_beam_search``, as ``softtopk_lstm``)."""
        super().set_num_updates(num_updates)
        self.num_updates = num_updates

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return SoftTopKTransformerEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return SoftTopKTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


def softtopk_defaults(args) -> None:
    """Defaults of the :class:`SoftTopKAttentionConfig` options, then fairseq's Transformer base."""
    defaults = SoftTopKAttentionConfig()
    for name in (f.name for f in fields(SoftTopKAttentionConfig) if not f.name.startswith("_")):
        if safe_getattr(args, name, None) is None:
            setattr(args, name, getattr(defaults, name))
    # the deprecated name, from a command or from the saved arguments of an older checkpoint; a
    # checkpoint saved before the rename holds False when the option was not given: not a use
    old = safe_getattr(args, "topk_self_attention", None)
    args.attention_normalize_self_attention = use_renamed(
        "topk_self_attention", old or None, bool(args.attention_normalize_self_attention),
        defaults.attention_normalize_self_attention)
    args.topk_self_attention = None
    base_architecture(args)


def _set_default(args, name, value) -> None:
    if safe_getattr(args, name, None) is None:
        setattr(args, name, value)


@register_model_architecture("softtopk_transformer", "softtopk_transformer_tiny")
def softtopk_transformer_tiny(args):
    """For tests: 2+2 layers of size 32, 2 heads."""
    for side in ("encoder", "decoder"):
        _set_default(args, f"{side}_embed_dim", 32)
        _set_default(args, f"{side}_ffn_embed_dim", 64)
        _set_default(args, f"{side}_layers", 2)
        _set_default(args, f"{side}_attention_heads", 2)
    softtopk_defaults(args)


@register_model_architecture("softtopk_transformer", "softtopk_transformer_multi30k")
def softtopk_transformer_multi30k(args):
    """CPU-sized, for Multi30k-scale data (~30k pairs): 3+3 layers of size 256, 4 heads, dropout 0.3."""
    for side in ("encoder", "decoder"):
        _set_default(args, f"{side}_embed_dim", 256)
        _set_default(args, f"{side}_ffn_embed_dim", 512)
        _set_default(args, f"{side}_layers", 3)
        _set_default(args, f"{side}_attention_heads", 4)
    _set_default(args, "dropout", 0.3)
    softtopk_defaults(args)


@register_model_architecture("softtopk_transformer", "softtopk_transformer_prenorm_multi30k")
def softtopk_transformer_prenorm_multi30k(args):
    """For beam-search training on Multi30k: pre-LN, 3+3 layers of size 256, 4 heads, FFN 1024, all
    embeddings tied (a joined dictionary), dropout 0.3; 7,519,232 parameters with the 7,764-type joint
    Multi30k dictionary: the size of the Transformer (7.6M with its 8k BPE) in the peer beamgrad's published
    Multi30k protocol (docs/beam_search_training.md)."""
    for side in ("encoder", "decoder"):
        _set_default(args, f"{side}_embed_dim", 256)
        _set_default(args, f"{side}_ffn_embed_dim", 1024)
        _set_default(args, f"{side}_layers", 3)
        _set_default(args, f"{side}_attention_heads", 4)
        _set_default(args, f"{side}_normalize_before", True)
    _set_default(args, "share_all_embeddings", True)
    _set_default(args, "dropout", 0.3)
    softtopk_defaults(args)


@register_model_architecture("softtopk_transformer", "softtopk_transformer_wmt16")
def softtopk_transformer_wmt16(args):
    """Transformer base (6+6 layers of size 512, FFN 2048, 8 heads, dropout and attention dropout 0.1).

    The model of OpenNMT-py's Transformer recipe (its FAQ, "How do I train the Transformer
    model?"): fairseq's ``transformer_wmt_en_de`` plus its attention dropout of 0.1. The
    optimiser settings are in ``configs/softtopk_transformer_wmt16.sh``.
    """
    _set_default(args, "attention_dropout", 0.1)
    softtopk_defaults(args)
