"""Renamed options (fairseq_softtopk.renamed_options): the old names keep working, with a warning,
through fairseq's own parser, in the criterion, and in a Transformer checkpoint's saved arguments."""

import argparse
import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch

import fairseq_softtopk  # noqa: F401  (registers the components)
from builders import build_criterion, build_transformer
from conftest import word_dictionary
from fairseq_softtopk.criterions.soft_beam_search import SoftBeamSearchConfig
from fairseq_softtopk.models import softtopk_transformer as stt
from fairseq_softtopk.models.topk_multihead_attention import TopKMultiheadAttention
from fairseq_softtopk.renamed_options import RENAMED_OPTIONS

@pytest.fixture
def dictionary():
    return word_dictionary(13)


CRITERION_RENAMES = [("candidate_pool", "topk_candidate_pool", 20), ("selection_grad", "topk_grad", "full"),
                     ("selection_grad_cap", "topk_grad_cap", 0.5)]


def test_every_renamed_option_is_a_deprecated_field_beside_its_new_name():
    configs = [SoftBeamSearchConfig, stt.SoftTopKAttentionConfig]
    fields = {f.name: f for config in configs for f in dataclasses.fields(config)}
    for old, new in RENAMED_OPTIONS.items():
        assert fields[old].metadata.get("deprecated") and fields[old].default is None
        assert new in fields and not fields[new].metadata.get("deprecated")
        assert f"--{new.replace('_', '-')}" in fields[old].metadata["help"]


@pytest.mark.parametrize("old, new, value", CRITERION_RENAMES)
def test_an_old_criterion_name_acts_as_the_new_one_and_warns(dictionary, old, new, value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name: no warning at all
        expected = build_criterion(dictionary, **{new: value}).search
    unset = _default(new)  # the new name as fairseq passes it when only the old one is given
    with pytest.warns(FutureWarning, match=f"--{old.replace('_', '-')} is deprecated.*--{new.replace('_', '-')}"):
        got = build_criterion(dictionary, **{old: value, new: unset}).search
    assert got == expected
    assert got != build_criterion(dictionary).search  # the value was used, not dropped


def _default(name):
    return next(f.default for f in dataclasses.fields(SoftBeamSearchConfig) if f.name == name)


@pytest.mark.parametrize("old, new, value", CRITERION_RENAMES)
def test_old_and_new_names_that_disagree_are_refused(dictionary, old, new, value):
    other = {"topk_candidate_pool": 30, "topk_grad": "none", "topk_grad_cap": 0.7}[new]
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="disagree"):
        build_criterion(dictionary, **{old: value, new: other})


def test_an_old_name_with_a_value_outside_the_choices_is_refused(dictionary):
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="must be one of"):
        build_criterion(dictionary, selection_grad="clipped", topk_grad="capped")


def test_old_flags_parse_with_fairseq_train_and_build_the_same_criterion(toy_data_bin, dictionary):
    """The path of a real command: fairseq's parser (the aliases are options of the criterion's
    dataclass), its conversion to a config, the criterion built from that config."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    def criterion(flags):
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, [str(toy_data_bin[1]), "--user-dir", fairseq_softtopk.__path__[0],
                                                    "--arch", "softtopk_lstm_tiny", "--criterion", "soft_beam_search",
                                                    "--cpu", *flags])
        cfg = convert_namespace_to_omegaconf(args)
        task = tasks.setup_task(cfg.task)
        return task.build_criterion(cfg.criterion).search

    new = criterion(["--topk-grad", "full", "--topk-candidate-pool", "20", "--topk-grad-cap", "0.5"])
    with pytest.warns(FutureWarning) as caught:
        old = criterion(["--selection-grad", "full", "--candidate-pool", "20", "--selection-grad-cap", "0.5"])
    assert old == new and new.selection_grad == "full" and new.candidate_pool == 20
    assert sorted({str(w.message).split()[0] for w in caught if str(w.message).startswith("--")}) == [
        "--candidate-pool", "--selection-grad", "--selection-grad-cap"]


def test_the_old_self_attention_flag_still_normalises_self_attention(dictionary):
    with pytest.warns(FutureWarning, match="--topk-self-attention is deprecated"):
        model = build_transformer(dictionary, attention_normalizer="soft_topk", attention_topk=2,
                                  topk_self_attention=True)
    assert all(isinstance(layer.self_attn, TopKMultiheadAttention) for layer in model.encoder.layers)


def _args_saved_before_the_rename(topk_self_attention: bool) -> argparse.Namespace:
    """The model arguments an older checkpoint holds: the old field, not the new one."""
    args = argparse.Namespace(arch="softtopk_transformer_tiny", dropout=0.0, attention_normalizer="soft_topk",
                              attention_topk=2)
    stt.softtopk_transformer_tiny(args)
    del args.attention_normalize_self_attention
    args.topk_self_attention = topk_self_attention
    return args


def test_a_checkpoint_saved_before_the_rename_loads_with_its_self_attention(dictionary):
    task = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    reference = build_transformer(dictionary, attention_normalizer="soft_topk", attention_topk=2,
                                  attention_normalize_self_attention=True)
    with pytest.warns(FutureWarning, match="--topk-self-attention is deprecated"):
        loaded = stt.SoftTopKTransformerModel.build_model(_args_saved_before_the_rename(True), task)
    loaded.load_state_dict(reference.state_dict())
    assert all(isinstance(layer.self_attn, TopKMultiheadAttention) for layer in loaded.decoder.layers)
    with warnings.catch_warnings():  # False, the old default, is in every older checkpoint: no warning
        warnings.simplefilter("error")
        plain = stt.SoftTopKTransformerModel.build_model(_args_saved_before_the_rename(False), task)
    assert not any(isinstance(layer.self_attn, TopKMultiheadAttention) for layer in plain.decoder.layers)
