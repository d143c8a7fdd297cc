"""Small models, criteria and batches shared by the tests (the criterion's, the device check, the CUDA tests)."""

import argparse
from types import SimpleNamespace

import torch

import fairseq_softtopk
from fairseq_softtopk.criterions.soft_beam_search import SoftBeamSearchCriterion
from fairseq_softtopk.models.softtopk_lstm import SoftTopKLSTMConfig, SoftTopKLSTMModel

fairseq_softtopk.register()
from fairseq_softtopk.models import softtopk_transformer as stt  # noqa: E402  (after registering)


def build_model(dictionary, scale: float = 1.0, dtype: torch.dtype = torch.float64, **overrides) -> SoftTopKLSTMModel:
    """A tiny ``softtopk_lstm`` (every size different) in training mode, without dropout; its parameters
    from seed 0, multiplied by ``scale`` (larger: more peaked distributions). ``overrides``: config fields
    (e.g. ``attention_normalizer``)."""
    torch.manual_seed(0)
    values = dict(dropout=0.0, encoder_embed_dim=6, encoder_hidden_size=7, decoder_embed_dim=8,
                  decoder_hidden_size=12, decoder_out_embed_dim=8, attention_dim=10,
                  max_source_positions=64, max_target_positions=64)
    values.update(overrides)
    model = SoftTopKLSTMModel.build_model(SoftTopKLSTMConfig(**values), SimpleNamespace(
        source_dictionary=dictionary, target_dictionary=dictionary)).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(scale)
    return model.train()


def build_transformer(dictionary, dtype: torch.dtype = torch.float64, **options):
    """A tiny ``softtopk_transformer`` (``softtopk_transformer_tiny``) without dropout, in training mode;
    ``options`` as parsed args (e.g. ``attention_normalizer="soft_topk"``, ``attention_normalize_self_attention=True``)."""
    task = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    args = argparse.Namespace(arch="softtopk_transformer_tiny", dropout=0.0, **options)
    stt.softtopk_transformer_tiny(args)
    torch.manual_seed(0)
    return stt.SoftTopKTransformerModel.build_model(args, task).to(dtype).train()


def build_stock_transformer(dictionary, dtype: torch.dtype = torch.float64, **options):
    """fairseq's own ``transformer`` (post-LN, sinusoidal positions), 2+2 layers of size 16, without dropout."""
    from fairseq.models.transformer import TransformerModel, base_architecture

    task = argparse.Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    sizes = dict(encoder_embed_dim=16, decoder_embed_dim=16, encoder_ffn_embed_dim=24, decoder_ffn_embed_dim=24,
                 encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2)
    args = argparse.Namespace(arch="transformer", dropout=0.0, **{**sizes, **options})
    base_architecture(args)
    torch.manual_seed(0)
    return TransformerModel.build_model(args, task).to(dtype).train()


def build_fairseq_lstm(dictionary, dtype: torch.dtype = torch.float64):
    """fairseq's own ``lstm`` (a decoder that keeps its recurrent state itself): 1 layer of size 8."""
    from fairseq.models.lstm import LSTMModel, base_architecture

    task = argparse.Namespace(source_dictionary=dictionary, target_dictionary=dictionary)
    args = argparse.Namespace(arch="lstm", criterion="cross_entropy", dropout=0.0, encoder_embed_dim=8, encoder_hidden_size=8,
                              decoder_embed_dim=8, decoder_hidden_size=8, decoder_out_embed_dim=8)
    base_architecture(args)
    torch.manual_seed(0)
    return LSTMModel.build_model(args, task).to(dtype).train()


#: The criterion's options in the tests unless overridden (a tight tolerance: gradients are compared).
CRITERION_DEFAULTS = dict(train_beam=3, topk_epsilon=0.1, topk_epsilon_start=0.0, topk_epsilon_anneal_updates=0,
                          topk_epsilon_relative=0.0, topk_cost="linear", topk_tol=1e-8, topk_max_iter=50,
                          teacher_forcing_ratio=0.8, topk_mode="soft", topk_candidate_pool=0, topk_fixed_iterations=False,
                          topk_grad="capped", topk_grad_cap=1.0, label_smoothing=0.1, sentence_avg=False,
                          topk_compile="none")


def build_criterion(dictionary, **overrides) -> SoftBeamSearchCriterion:
    """``soft_beam_search`` with :data:`CRITERION_DEFAULTS` and ``overrides``."""
    return SoftBeamSearchCriterion(SimpleNamespace(target_dictionary=dictionary), **{**CRITERION_DEFAULTS, **overrides})


#: The criterion's modes, as options over :data:`CRITERION_DEFAULTS`: every cost, the hard ablation, the
#: candidate pool, the sync-free search (alone and on a pool), the relative epsilon, the epsilon schedule and the
#: risk loss on the beams.
CRITERION_MODES = {
    "soft_linear": {},
    "soft_sqeuclidean": {"topk_cost": "sqeuclidean"},
    "soft_paper": {"topk_cost": "paper"},
    "hard": {"topk_mode": "hard"},
    "pool": {"topk_candidate_pool": 12},
    "fixed_iterations": {"topk_fixed_iterations": True, "topk_max_iter": 12},
    "fixed_iterations_pool": {"topk_fixed_iterations": True, "topk_max_iter": 12, "topk_candidate_pool": 12},
    "relative_epsilon": {"topk_epsilon_relative": 0.5},
    "epsilon_schedule": {"topk_epsilon_start": 0.4, "topk_epsilon_anneal_updates": 10},
    "risk": {"beam_loss": "risk"},
    "quadratic": {"topk_regularizer": "quadratic"},
    "quadratic_fixed_iterations": {"topk_regularizer": "quadratic", "topk_fixed_iterations": True, "topk_max_iter": 12},
}


def make_sample(dictionary, rng, lengths, src_len=6) -> dict:
    """A fairseq translation batch: right-padded targets ending in EOS, shifted inputs."""
    batch, T = len(lengths), max(lengths)
    pad, eos = dictionary.pad(), dictionary.eos()
    src = torch.randint(dictionary.nspecial, len(dictionary), (batch, src_len), generator=rng)
    src[:, -1] = eos
    target = torch.full((batch, T), pad)
    prev = torch.full((batch, T), pad)
    for row, n in enumerate(lengths):
        body = torch.randint(dictionary.nspecial, len(dictionary), (n - 1,), generator=rng)
        target[row, :n] = torch.cat([body, torch.tensor([eos])])
        prev[row, :n] = torch.cat([torch.tensor([eos]), body])
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), src_len),
                          "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(pad).sum()), "nsentences": batch}


def sample_to(sample: dict, device) -> dict:
    """The batch with every tensor on ``device``."""
    def move(value):
        if isinstance(value, dict):
            return {key: move(item) for key, item in value.items()}
        return value.to(device) if torch.is_tensor(value) else value
    return move(sample)
