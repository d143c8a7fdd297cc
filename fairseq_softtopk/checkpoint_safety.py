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
with ``weights_only=False``, which would run that code; it is not repeated). A file that is
truncated or damaged raises :class:`CorruptCheckpointError`, naming the file, its size and what is
wrong with it, and a missing file :class:`MissingCheckpointError`. The file is read whole first
(:func:`check_whole_checkpoint`: every member's CRC-32), since torch checks none: a checkpoint whose
tensor bytes changed on disk would otherwise load, and be trained on or scored, without a word.

With ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` set, torch loads fairseq's checkpoints with the full
unpickler, which runs code stored in them: registering the plugin then warns once
(:func:`warn_if_unsafe_loading_forced`).
"""

import argparse
import functools
import importlib
import os
import pickle
import re
import warnings
import zipfile
import zlib
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


class CorruptCheckpointError(ValueError):
    """A checkpoint file that torch cannot read (truncated, damaged, or no checkpoint at all): it was not loaded."""


class MissingCheckpointError(FileNotFoundError):
    """A checkpoint path with no file behind it."""


def refusal_message(path, error: Exception) -> str:
    """The plain statement of why ``path`` was not loaded, from torch's ``UnpicklingError``."""
    found = sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(error))))
    named = f" ({', '.join(found)})" if found else ""
    return (f"{path} was not loaded: the file contains pickled code or objects{named} outside the allowlist of "
            f"torch's safe (weights-only) loading. Checkpoints written by fairseq and this package hold only "
            f"tensors, plain values, argparse.Namespace and numeric numpy arrays; treat this file as untrusted.")


def _is_weights_only_refusal(error: Exception) -> bool:
    return isinstance(error, pickle.UnpicklingError) and "weights only load failed" in str(error).lower()


#: how a zip archive (torch's checkpoint format since torch 1.6) starts
_ZIP_MAGIC = b"PK\x03\x04"
#: how torch's legacy format (``_use_new_zipfile_serialization=False``) starts: a pickled magic number
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_TRUNCATED = "truncated by an interrupted copy or write?"


def _reason(error: Optional[BaseException]) -> str:
    """``error`` in one short line: its type and first sentence (torch's run on for a paragraph)."""
    first = " ".join(str(error).split()).split(". ")[0].rstrip(".")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _because(error: Optional[BaseException], before: str = " (", after: str = ")") -> str:
    """:func:`_reason` of ``error`` between ``before`` and ``after``, or nothing where there is no error (the
    file was checked before any load)."""
    return f"{before}{_reason(error)}{after}" if error is not None else ""


def _zip_damage(path, size: int, error: Optional[BaseException]) -> Optional[str]:
    """What is wrong with a file that starts as a zip archive, else None."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every member and checks its CRC-32
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error):  # its central directory, written last, is gone
        failed = f"torch's zip reader failed ({_reason(error)})" if error is not None else \
            "its zip directory, written last, cannot be read"
        return f"{failed}; {size:,} bytes; {_TRUNCATED}"
    if bad is not None:
        return (f"its member {bad} fails its CRC-32 check{_because(error)}; {size:,} bytes; the bytes changed "
                f"after they were written: damaged on disk or in a copy?")
    if not any(name.endswith("/data.pkl") or name == "data.pkl" for name in names):
        return f"a zip archive without data.pkl, so not a torch checkpoint; {size:,} bytes"
    return None


def describe_damage(path, error: Optional[BaseException] = None) -> Optional[str]:
    """Why the file at ``path`` is not a complete torch checkpoint, found from the file's structure
    (``error``, torch's, is only quoted), or None where nothing is wrong with it that way.

    Found: an empty file; a zip archive (torch's format) that Python's zipfile cannot read to its end
    (its central directory, written last, is missing), whose member fails its CRC-32, or that holds no
    ``data.pkl``; a file cut inside the first bytes of a zip or legacy-format checkpoint; a file that
    is neither. Not found: anything in a whole zip archive, or in a legacy-format file past its start;
    None also when ``path`` cannot be read as a local file.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(len(_LEGACY_MAGIC))
    except (OSError, TypeError):
        return None
    if size == 0:
        return f"the file is empty (0 bytes); {_TRUNCATED}"
    if head.startswith(_ZIP_MAGIC):
        return _zip_damage(path, size, error)
    if head.startswith(_LEGACY_MAGIC):
        if isinstance(error, EOFError):
            return f"a legacy-format checkpoint that ends early{_because(error)}; {size:,} bytes; {_TRUNCATED}"
        return None
    if _ZIP_MAGIC.startswith(head) or _LEGACY_MAGIC.startswith(head):  # cut inside the first bytes
        return f"only {size:,} bytes, the start of a checkpoint's header{_because(error)}; {_TRUNCATED}"
    return (f"not a zip archive, the format of torch checkpoints (it starts with {head[:8]!r}"
            f"{_because(error, '; ', '')}); {size:,} bytes; an unfinished download, or not a checkpoint at all?")


def plain_checkpoint_error(path, error: BaseException) -> Optional[Exception]:
    """The plain error for ``error``, raised while loading ``path``: :class:`MissingCheckpointError`,
    :class:`UnsafeCheckpointError` (torch's weights-only refusal) or :class:`CorruptCheckpointError`
    (:func:`describe_damage` found something); None where ``error`` is none of these (raise it as it is)."""
    if isinstance(error, FileNotFoundError) and isinstance(path, (str, os.PathLike)) and not os.path.exists(path):
        return MissingCheckpointError(f"{path}: no such checkpoint file")
    refused = _is_weights_only_refusal(error)
    if refused and re.search(r"GLOBAL [\w.]+", str(error)):  # names what it refused: not mere damage
        return UnsafeCheckpointError(refusal_message(path, error))
    damage = describe_damage(path, error)
    if damage:
        return CorruptCheckpointError(f"{path} is not a complete checkpoint: {damage}")
    return UnsafeCheckpointError(refusal_message(path, error)) if refused else None


def check_whole_checkpoint(path, what_to_do: str = "") -> None:
    """Reads the whole file at ``path`` before it is used (scored, resumed, fine-tuned from): a zip archive (torch's
    format) must hold every member with its CRC-32 intact, so a checkpoint whose tensor bytes changed on disk or in a
    copy (which torch loads without a word: it checks no CRC) is refused like a truncated one. About 0.05 s for 30
    MB. A legacy-format file is checked as far as :func:`describe_damage` can; a path that is not a local file is
    left to the loader.

    Raises:
        CorruptCheckpointError: :func:`describe_damage` found something: one line naming the file, its size, what
            is wrong and then ``what_to_do`` (a sentence).
    """
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return
    damage = describe_damage(path)
    if damage:
        then = f"{'' if damage.endswith('?') else '.'} {what_to_do}" if what_to_do else ""
        raise CorruptCheckpointError(f"{path} is not a complete checkpoint: {damage}{then}")


def read_checkpoint(path, mmap: bool = True) -> dict:
    """``torch.load`` of ``path`` to the CPU, weights-only with :data:`FAIRSEQ_CHECKPOINT_GLOBALS` allowed
    (the same as fairseq's loader under the plugin); ``mmap``: tensors are read from the file when used (so
    changed tensor bytes go unnoticed: :func:`check_whole_checkpoint` reads the whole file).

    Raises:
        MissingCheckpointError, CorruptCheckpointError, UnsafeCheckpointError: see
            :func:`plain_checkpoint_error`; torch's other errors as they are.
    """
    allow_fairseq_checkpoint_globals()
    if not os.path.isfile(path):
        raise MissingCheckpointError(f"{path}: no such checkpoint file")
    with open(path, "rb") as f:
        mmap = mmap and f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC  # torch maps zip archives only
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:
        plain = plain_checkpoint_error(path, error)
        if plain is None:
            raise
        raise plain from None


def guard_checkpoint_loading() -> None:
    """Makes fairseq's checkpoint loader report a refused, damaged or missing checkpoint plainly (idempotent).

    ``fairseq.checkpoint_utils.load_checkpoint_to_cpu`` (training's ``--restore-file`` and
    ``--finetune-from-model``, resuming from ``checkpoint_last.pt``, ``fairseq-generate --path``) raises
    :class:`UnsafeCheckpointError` with :func:`refusal_message` instead of torch's refusal,
    :class:`CorruptCheckpointError` for a truncated or damaged file (checked whole before it is loaded:
    :func:`check_whole_checkpoint`) and :class:`MissingCheckpointError` for no file (:func:`plain_checkpoint_error`),
    each one line naming the file; loading stays weights-only.
    """
    from fairseq import checkpoint_utils

    load = checkpoint_utils.load_checkpoint_to_cpu
    if getattr(load, "refuses_plainly", False):
        return

    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        check_whole_checkpoint(path, "It was not loaded.")  # torch reads no CRC: changed bytes would load silently
        try:
            return load(path, *args, **kwargs)
        except Exception as error:
            plain = plain_checkpoint_error(path, error)
            if plain is None:
                raise
            # "from None": torch's message (and its advice to load with weights_only=False) is not shown again
            raise plain from None

    load_checkpoint_to_cpu.refuses_plainly = True
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu


#: the environment variable that makes torch.load unpickle anything where the caller (fairseq) does not
#: pass weights_only, and the values torch takes as set (torch/serialization.py, torch 2.6 to 2.13)
UNSAFE_LOADING_VARIABLE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
SAFE_LOADING_VARIABLE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
TORCH_TRUE_VALUES = ("1", "y", "yes", "true")


class UnsafeLoadingWarning(UserWarning):
    """torch was told to load checkpoints with the full unpickler, which runs the code they carry."""


_warned_unsafe_loading = False


def unsafe_loading_forced(environ=None) -> bool:
    """Whether torch (2.6 to 2.13) loads checkpoints with the full unpickler where the caller does not
    pass ``weights_only``, as fairseq does not: :data:`UNSAFE_LOADING_VARIABLE` is set (any case of
    :data:`TORCH_TRUE_VALUES`) and :data:`SAFE_LOADING_VARIABLE` is not (with both, torch refuses to load)."""
    environ = os.environ if environ is None else environ
    return (environ.get(UNSAFE_LOADING_VARIABLE, "0").lower() in TORCH_TRUE_VALUES
            and environ.get(SAFE_LOADING_VARIABLE, "0").lower() not in TORCH_TRUE_VALUES)


def warn_if_unsafe_loading_forced(environ=None) -> bool:
    """Warns (:class:`UnsafeLoadingWarning`, once per process) where :func:`unsafe_loading_forced`.
    Returns whether it warned now."""
    global _warned_unsafe_loading
    environ = os.environ if environ is None else environ
    if _warned_unsafe_loading or not unsafe_loading_forced(environ):
        return False
    _warned_unsafe_loading = True
    value = environ[UNSAFE_LOADING_VARIABLE]
    warnings.warn(f"{UNSAFE_LOADING_VARIABLE}={value} is set: torch loads fairseq's checkpoints with the full "
                  f"unpickler, not weights-only, so a checkpoint can run code it carries when it is loaded, and "
                  f"fairseq-softtopk cannot refuse it. Unset {UNSAFE_LOADING_VARIABLE} unless you trust every "
                  f"checkpoint you load.", UnsafeLoadingWarning, stacklevel=2)
    return True
