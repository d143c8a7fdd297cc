"""Checks of what a training search is given (:mod:`.beam_search`, :mod:`.beam_search_to_eos`): each raises a
``ValueError`` naming the argument, its value and what it must be, before the first step, where a bad value would
otherwise fail deep inside torch or, worse, search something else without a word (a target with padding between
its tokens is read at the wrong positions; an encoder output with a row too many loses it).

The checks of the target's values read the data on the host (one read per search); the sync-free search
(``fixed_iterations``) skips them, as it reads nothing of the data on the host.

What the decoder's ``step`` returns is checked at every step: its shape (free: no data is read), and whether its
log-probabilities hold NaN or ``+inf`` (:func:`bad_lprobs`, :func:`bad_lprobs_error`), where the search reads the
data on the host anyway (see :mod:`.beam_search`), so that the check adds no host synchronisation to a soft search.
"""

import math
from typing import Any, Iterable, Optional, Set

import torch
from torch import Tensor

from ..number_checks import is_finite_number, is_integer


def check_config(config, config_class) -> None:
    """``config`` is None (the defaults) or a ``config_class`` (the search's options)."""
    if config is not None and not isinstance(config, config_class):
        raise TypeError(f"config must be a {config_class.__name__} (or None: the defaults), got "
                        f"{type(config).__name__}")


def check_token_id(name: str, value, vocab: Optional[int] = None) -> None:
    """``value`` is an integer, in ``[0, vocab)`` where ``vocab`` is given (the decoder's embedding rows)."""
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer token id, got {value!r}")
    if vocab is not None and not 0 <= value < vocab:
        raise ValueError(f"{name} must be a token id in [0, {vocab}) (the rows of the decoder's embedding matrix), "
                         f"got {value}")


def check_beam_fits(beam: int, vocab: int, never_extend: Iterable[int], why: str) -> None:
    """The first step extends one beam: ``beam`` must not exceed its candidates, the ``vocab`` tokens less those
    in ``never_extend`` (``why`` names them). For the soft selection (the sorted soft top-k of ``beam`` needs as
    many finite scores); the hard one keeps ``-inf`` beams until there are candidates enough, as exhaustive search
    does."""
    excluded: Set[int] = set()
    for token in never_extend:
        token = int(token) if torch.is_tensor(token) and token.dim() == 0 and not token.is_floating_point() else token
        check_token_id(f"a token of {why}", token, vocab)
        excluded.add(int(token))
    candidates = vocab - len(excluded)
    if beam > candidates:
        raise ValueError(f"beam {beam} exceeds the first step's candidates: the decoder's {vocab} tokens less "
                         f"{len(excluded)} {why} ({candidates})")


def check_gold_target(target: Tensor, pad: int, vocab: int, read_values: bool) -> None:
    """``target`` ``(batch, T)``: integer ids, right-padded with ``pad`` (no token after padding: the search takes a
    sentence's length as its count of tokens), every id but padding in ``[0, vocab)``; the values only where
    ``read_values`` (one host read)."""
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer token ids, got dtype {target.dtype}")
    if not read_values:
        return
    real = target.ne(pad)
    after_padding = (real[:, 1:] & ~real[:, :-1]).any(-1)
    out_of_range = (real & ((target < 0) | (target >= vocab))).any(-1)
    if bool(torch.stack([after_padding.any(), out_of_range.any()]).any()):  # the one read of the good case
        if bool(after_padding.any()):
            row = int(after_padding.nonzero()[0, 0])
            raise ValueError(f"target must be right-padded with pad ({pad}): row {row} has a token after padding "
                             f"({target[row].tolist()})")
        ids = target[real]
        raise ValueError(f"target ids must be in [0, {vocab}) (the decoder's vocabulary) except padding ({pad}), got "
                         f"ids from {int(ids.min())} to {int(ids.max())}")


def encoder_rows(encoder_out: Any) -> Set[int]:
    """The first sizes of the tensors in ``encoder_out`` (a tensor, or tuples, lists and dicts of them), as
    :func:`~fairseq_softtopk.search.repeat_rows` takes their rows."""
    if torch.is_tensor(encoder_out):
        return {encoder_out.shape[0]} if encoder_out.dim() > 0 else set()
    if isinstance(encoder_out, dict):
        encoder_out = list(encoder_out.values())
    if isinstance(encoder_out, (tuple, list)):
        return set().union(*(encoder_rows(value) for value in encoder_out)) if encoder_out else set()
    return set()


def check_encoder_batch(encoder_out: Any, batch: int, given_as: str) -> None:
    """Every tensor of ``encoder_out`` has ``batch`` rows (``given_as``: where the search's batch comes from)."""
    rows = encoder_rows(encoder_out)
    if rows and rows != {batch}:
        raise ValueError(f"encoder_out has tensors of {', '.join(map(str, sorted(rows)))} rows but {given_as} "
                         f"{batch} sentences (the default reorder_encoder_out takes the rows of every tensor, batch "
                         f"first)")


def check_batch(batch) -> None:
    if not is_integer(batch) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")


def check_eos_search(batch, pad, bos, eos, max_len, lenpen, vocab: int, beam: Optional[int]) -> None:
    """The arguments of the search to EOS: ids in the vocabulary, EOS not the padding, at least one step; the soft
    selection's ``beam`` (None: hard) against the first step's candidates."""
    check_batch(batch)
    for name, value in (("pad", pad), ("bos", bos), ("eos", eos)):
        check_token_id(name, value, vocab)
    if eos == pad:
        raise ValueError(f"eos and pad are the same token ({eos}): padding never extends a beam, so no hypothesis "
                         f"could finish")
    if not is_integer(max_len) or max_len < 1:
        raise ValueError(f"max_len must be an integer >= 1 (the step at which only EOS is allowed: one token and "
                         f"EOS at least), got {max_len!r}")
    if not is_finite_number(lenpen):
        raise ValueError(f"lenpen must be a finite number, got {lenpen!r}")
    if beam is not None:
        check_beam_fits(beam, vocab, (pad, eos), "never first (padding, and EOS: no empty hypothesis)")


def check_step_output(lprobs, rows: int, vocab: int, t: int) -> None:
    """``decoder.step``'s log-probabilities at step ``t`` are a ``(rows, vocab)`` tensor, ``vocab`` the rows of the
    decoder's embedding matrix (the tokens a beam can take as its next input). Reads only the shape."""
    if not torch.is_tensor(lprobs) or tuple(lprobs.shape) != (rows, vocab):
        got = tuple(lprobs.shape) if torch.is_tensor(lprobs) else type(lprobs).__name__
        raise ValueError(f"decoder.step returned log-probabilities of shape {got} at step {t}; the search expects "
                         f"({rows}, {vocab}): (batch * beam, V), V the rows of decoder.embedding_matrix()")


def bad_lprobs(lprobs: Tensor) -> Tensor:
    """The number of NaN and ``+inf`` entries of ``lprobs`` (a 0-dim tensor on its device: nothing is read)."""
    return (~(lprobs < math.inf)).sum()


def bad_lprobs_error(count, t: int, shape) -> ValueError:
    """The error for ``count`` NaN or ``+inf`` log-probabilities at step ``t`` (``shape``: the step's output)."""
    return ValueError(f"decoder.step returned {int(count)} NaN or +inf log-probabilities at step {t} (of its "
                      f"{tuple(shape)} output): each must be finite, or -inf for a token never chosen (look for an "
                      f"overflow, fp16 say, or a division by zero in the decoder)")
