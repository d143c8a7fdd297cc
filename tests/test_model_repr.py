"""``repr()`` of every registered architecture with every attention normaliser.

fairseq logs ``repr(model)`` at the start of training; a module whose ``extra_repr`` returns a
non-string (fairseq's ``ChoiceEnum`` member on Python 3.12) turns that line into a logging
error. The name reaches the models both as text (command line) and as the ``ChoiceEnum``
member that fairseq's dataclass configs hold.
"""

from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
from fairseq import options
from fairseq.dataclass import ChoiceEnum
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models import ARCH_MODEL_REGISTRY
from omegaconf import open_dict

from conftest import word_dictionary

import fairseq_softtopk
from fairseq_softtopk.modules.attention_normalizer import ATTENTION_NORMALIZERS

fairseq_softtopk.register()
ARCHS = sorted(name for name, cls in ARCH_MODEL_REGISTRY.items() if cls.__module__.startswith("fairseq_softtopk"))


def _dictionary():
    return word_dictionary(20)


def test_every_architecture_of_the_package_is_listed():
    assert {"softtopk_lstm_tiny", "softtopk_lstm_multi30k", "softtopk_lstm_wmt14", "softtopk_transformer_tiny",
            "softtopk_transformer_multi30k", "softtopk_transformer_wmt16"} <= set(ARCHS)


@pytest.mark.parametrize("as_choice", [False, True], ids=["str", "ChoiceEnum"])
@pytest.mark.parametrize("arch", ARCHS)
def test_repr_of_every_architecture_and_normalizer(arch, as_choice):
    dictionary = _dictionary()
    task = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    choices = ChoiceEnum(list(ATTENTION_NORMALIZERS))
    torch.manual_seed(0)
    for name in ATTENTION_NORMALIZERS:
        args = options.parse_args_and_arch(options.get_training_parser(), [
            "unused-data-dir", "--arch", arch, "--attention-normalizer", name, "--attention-topk", "2",
            "--task", "translation", "--source-lang", "src", "--target-lang", "tgt"])
        cfg = convert_namespace_to_omegaconf(args).model
        if as_choice and isinstance(cfg, Namespace):  # models without a dataclass get the namespace
            cfg.attention_normalizer = choices(name)
        elif as_choice:
            with open_dict(cfg):
                cfg.attention_normalizer = choices(name)
        model = ARCH_MODEL_REGISTRY[arch].build_model(cfg, task)
        text = repr(model)
        assert isinstance(text, str)
        assert f"AttentionNormalizer({name}" in text, (arch, name)
        assert "Choices" not in text
