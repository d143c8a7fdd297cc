"""Lets fairseq load its own checkpoints with torch's safe (``weights_only=True``) unpickler.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``; fairseq checkpoints of
models configured through the legacy argparse path keep their model config as an
``argparse.Namespace``, which the safe unpickler refuses, so ``fairseq-generate`` and
``--restore-file`` fail; with ``--eval-bleu`` the saved metrics hold numpy arrays, which it
refuses too. We allowlist exactly the globals that fairseq checkpoints carry (found with
``torch.serialization.get_unsafe_globals_in_checkpoint`` on checkpoints written by every model
and criterion of this package, and by training with ``--eval-bleu``) and nothing else: weights-only loading stays
on, and a checkpoint that pickles any other object is still refused.

Refused, such a file is reported plainly: fairseq's checkpoint loader raises
:class:`UnsafeCheckpointError`, which says that the file contains code or objects outside the
allowlist, names them, and says that it was not loaded (torch's own message suggests reloading
with ``weights_only=False``, which would run that code; it is not repeated).
"""

import argparse
import functools
import importlib
import pickle
import re
from typing import Optional

import torch


def _numpy_array_globals() -> tuple:
    """What pickled numeric numpy arrays need: ``fairseq-train --eval-bleu`` keeps its n-gram counts
    as int64 arrays in the checkpoint's saved metrics (``extra_state["metrics"]``).

    ``_reconstruct`` only builds an empty array of an allowlisted type (ndarray); the elements
    of a numeric array are raw bytes, and an object array's elements would still pass through
    the weights-only unpickler (torch's documented recipe for numpy arrays).
    """
    try:
        import numpy
    except ImportError:  # pragma: no cover - fairseq depends on numpy
        return ()
    # numpy 2 pickles arrays through numpy._core, numpy 1 through numpy.core; numpy 1.26 also has an
    # (unimported) numpy._core stub, so the version decides, not which attribute exists
    major = int(numpy.__version__.split(".")[0])
    multiarray = importlib.import_module("numpy._core.multiarray" if major >= 2 else "numpy.core.multiarray")
    dtypes = tuple(type(numpy.dtype(name)) for name in ("int64", "int32", "float64", "float32"))
    return (multiarray._reconstruct, numpy.ndarray, numpy.dtype, *dtypes)


#: The only non-tensor globals fairseq checkpoints were found to need: the legacy model
#: config's argparse.Namespace, and numeric numpy arrays (``--eval-bleu``'s saved metrics).
FAIRSEQ_CHECKPOINT_GLOBALS = (argparse.Namespace, *_numpy_array_globals())


def allow_fairseq_checkpoint_globals() -> None:
    """Adds :data:`FAIRSEQ_CHECKPOINT_GLOBALS` to torch's weights-only allowlist (idempotent; torch >=
    2.6, which :func:`require_weights_only_torch` checks first in ``register``)."""
    already = set(torch.serialization.get_safe_globals())
    missing = [g for g in FAIRSEQ_CHECKPOINT_GLOBALS if g not in already]
    if missing:
        torch.serialization.add_safe_globals(missing)


#: The first torch whose ``torch.load`` is weights-only by default. fairseq calls ``torch.load``
#: without ``weights_only``: under an older torch it unpickles anything, so a checkpoint could run
#: code, and the plugin refuses to register (the operators in :mod:`fairseq_softtopk.ops` need no
#: fairseq and run on torch >= 2.1).
MIN_TORCH_FOR_SAFE_LOADING = (2, 6)


def torch_release(version: str) -> tuple:
    """``(major, minor)`` of a torch version string such as ``2.11.0+cu130`` or ``2.6.0a0+git1234``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a torch release from the version {version!r}")
    return int(match.group(1)), int(match.group(2))


def require_weights_only_torch(version: Optional[str] = None) -> None:
    """Raises a RuntimeError naming the problem when torch (``version``: default the installed one) is
    older than :data:`MIN_TORCH_FOR_SAFE_LOADING`."""
    version = version or torch.__version__
    if torch_release(version) < MIN_TORCH_FOR_SAFE_LOADING:
        need = ".".join(map(str, MIN_TORCH_FOR_SAFE_LOADING))
        raise RuntimeError(
            f"fairseq-softtopk's fairseq plugin needs torch >= {need}, found torch {version}: before {need}, "
            f"torch.load unpickles any object by default, so fairseq (which does not pass weights_only) would run "
            f"code stored in a checkpoint. Upgrade torch (pip install 'torch>={need}'); the operators in "
            f"fairseq_softtopk.ops need no fairseq and run on torch >= 2.1.")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint refused by torch's weights-only unpickler: it was not loaded."""


def refusal_message(path, error: Exception) -> str:
    """The plain statement of why ``path`` was not loaded, from torch's ``UnpicklingError``."""
    found = sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(error))))
    named = f" ({', '.join(found)})" if found else ""
    return (f"{path} was not loaded: the file contains pickled code or objects{named} outside the allowlist of "
            f"torch's safe (weights-only) loading. Checkpoints written by fairseq and this package hold only "
            f"tensors, plain values, argparse.Namespace and numeric numpy arrays; treat this file as untrusted.")


def _is_weights_only_refusal(error: Exception) -> bool:
    return isinstance(error, pickle.UnpicklingError) and "weights only load failed" in str(error).lower()


def guard_checkpoint_loading() -> None:
    """Makes fairseq's checkpoint loader report a refused checkpoint plainly (idempotent).

    ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` (training's ``--restore-file`` and
    ``--finetune-from-model``, ``fairseq-generate --path``) raises :class:`UnsafeCheckpointError`
    with :func:`refusal_message` instead of torch's error; loading stays weights-only.
    """
    from fairseq import checkpoint_utils

    load = checkpoint_utils.load_checkpoint_to_cpu
    if getattr(load, "refuses_plainly", False):
        return

    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        try:
            return load(path, *args, **kwargs)
        except pickle.UnpicklingError as error:
            if not _is_weights_only_refusal(error):
                raise
            # "from None": torch's message (and its advice to load with weights_only=False) is not shown again
            raise UnsafeCheckpointError(refusal_message(path, error)) from None

    load_checkpoint_to_cpu.refuses_plainly = True
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
