"""The initialisation shared by the LSTM encoder and decoder of ``softtopk_lstm``."""

import torch
from torch import nn

__all__ = ["uniform_init_"]


def uniform_init_(module: nn.Module, embedding: nn.Embedding, padding_idx: int) -> None:
    """Uniform(-0.1, 0.1) for every parameter of ``module`` (as fairseq's ``lstm``), zero padding row."""
    for param in module.parameters():
        nn.init.uniform_(param, -0.1, 0.1)
    with torch.no_grad():
        embedding.weight[padding_idx].zero_()
