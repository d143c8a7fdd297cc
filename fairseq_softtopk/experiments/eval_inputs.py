"""What scoring a checkpoint checks before it translates, and the one-line cause of a failed fairseq tool.

fairseq-generate reports bad input (``--beam 0``, a missing data directory, a checkpoint trained with
another dictionary, a damaged checkpoint file) with a traceback after a long config dump, some of it
only after it has loaded everything; an output file that cannot be written was found only after the
whole translation. :mod:`.scoring` and ``fairseq-softtopk-bleu`` run these checks first (an output file by
trying to write there: :func:`check_output_file`): each raises
one line naming the flag or file, the value and what is wrong (``ValueError``, or
``FileNotFoundError`` for a missing file or directory). :func:`refused_checkpoint` pulls the
cause out of the output of a fairseq tool that failed on a checkpoint anyway.
"""

import os
import re
import tempfile
from pathlib import Path
from typing import Optional

from ..number_checks import is_finite_number, is_integer

#: the last line of a fairseq tool that failed on a checkpoint (fairseq_softtopk.checkpoint_safety)
_PLAIN_ERROR = re.compile(r"^\S*(?:Unsafe|Corrupt|Missing)CheckpointError: (.*)$", re.M)
#: fairseq's own errors for a checkpoint path with no file (before the plugin's loader is reached)
_FAIRSEQ_MISSING = (re.compile(r"^ValueError: --finetune-from-model (.+) does not exist$", re.M),
                    re.compile(r"^OSError: Model file not found: (.+)$", re.M))
_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) "
                            r"from checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)")
_CHECKPOINT_NAMED = re.compile(r"(?:Cannot load model parameters from checkpoint|loading model\(s\) from) "
                               r"([^\s;]+)")
#: parameters with one row per dictionary entry (fairseq's and this package's models)
_VOCABULARY_ROWS = re.compile(r"embed_tokens\.weight$|output_proj(?:ection)?\.(?:weight|bias)$|fc_out\.weight$")


def refused_checkpoint(output: str) -> Optional[str]:
    """The one-line cause in the output of a fairseq tool that failed on a checkpoint, else None: the
    plugin's refusal of an unsafe, damaged or missing file, fairseq's own missing-file errors, or a
    checkpoint whose parameter shapes do not fit the model built for the data (another dictionary)."""
    found = _PLAIN_ERROR.findall(output)
    if found:
        return found[-1]
    for pattern in _FAIRSEQ_MISSING:
        found = pattern.findall(output)
        if found:
            return f"{found[-1]}: no such checkpoint file"
    mismatch = _SIZE_MISMATCH.search(output)
    if mismatch is None:
        return None
    key, saved, built = mismatch.groups()
    named = _CHECKPOINT_NAMED.findall(output)
    which = f"checkpoint {named[-1]}" if named else "the checkpoint"
    cause = "another architecture or model settings"
    if _VOCABULARY_ROWS.search(key) and saved.split(",")[1:] == built.split(",")[1:]:
        rows = (saved.split(",")[0], built.split(",")[0])
        cause = f"another dictionary ({rows[0]} symbols; the data directory's has {rows[1]})"
    return (f"{which} does not fit the model fairseq built for this data: its {key} has shape [{saved}], the "
            f"model's [{built}]; it was trained with {cause}")


def check_decoding_numbers(beam, batch_size=None, lenpen=None) -> None:
    """Raises ``ValueError`` naming the setting and its value: ``beam`` and ``batch_size`` (None: the
    default) must be integers >= 1, ``lenpen`` (None: fairseq's default) a finite number."""
    if not is_integer(beam) or beam < 1:
        raise ValueError(f"--beam must be an integer >= 1 (beams kept per sentence), got {beam!r}")
    if batch_size is not None and (not is_integer(batch_size) or batch_size < 1):
        raise ValueError(f"--batch-size must be an integer >= 1 (sentences per batch), got {batch_size!r}")
    if lenpen is not None and not is_finite_number(lenpen):
        raise ValueError(f"--lenpen must be a finite number (fairseq's default is 1), got {lenpen!r}")


def check_output_file(path, flag: str) -> None:
    """Raises ``ValueError`` naming ``flag`` and ``path`` when ``path`` could not be written later: it is a
    directory, a parent of it is a file, or it cannot be opened for writing (an existing file, opened to append
    and closed unchanged) or a file cannot be created in the nearest existing parent directory (a probe file,
    removed at once). Found by trying: ``os.access`` says yes to root whatever the mode, and knows nothing of
    file systems that refuse every write (``/sys``, ``/proc``). Leaves nothing behind."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give the name of a file to write")
    if path.exists():
        try:  # non-blocking: a FIFO without a reader fails at once instead of waiting
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
        except OSError as error:
            why = "no permission to write that file" if isinstance(error, PermissionError) else \
                f"opening it for writing failed ({error.strerror or error})"
            raise ValueError(f"{flag} {path} cannot be written: {why}") from None
        return
    parent = path.parent
    while not parent.exists() and parent != parent.parent:  # the directories that would be created
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path} cannot be written: {parent} is a file, not a directory")
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".write-probe-", dir=parent)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        why = f"no permission to create files in {parent}" if isinstance(error, PermissionError) else \
            f"creating a file in {parent} failed ({error.strerror or error})"
        raise ValueError(f"{flag} {path} cannot be written: {why}") from None


def data_directory(data_bin: str) -> Path:
    """The directory of ``data_bin`` that holds the dictionaries and evaluation subsets (fairseq's
    first, where ``data_bin`` lists shards separated by ``os.pathsep``)."""
    return Path(str(data_bin).split(os.pathsep)[0])


def check_data_dir(data_bin: str, subset: str) -> None:
    """Raises ``FileNotFoundError`` naming the directory when ``data_bin`` is no fairseq-preprocess output
    (missing, or without ``dict*.txt``) or, where it holds binarised subsets, none is ``subset``."""
    root = data_directory(data_bin)
    if not root.is_dir():
        raise FileNotFoundError(f"data directory not found: {root} (give fairseq-preprocess's --destdir)")
    if not any(root.glob("dict*.txt")):
        raise FileNotFoundError(f"{root} has no dict*.txt: it is not a fairseq-preprocess output directory")
    subsets = sorted({p.name.split(".")[0] for p in root.iterdir() if p.suffix in (".idx", ".bin")})
    if subsets and subset not in subsets:
        raise FileNotFoundError(f"no '{subset}' subset in {root} (it has {', '.join(subsets)}); choose one "
                                f"with --subset")


def _task_settings(state: dict) -> dict:
    """The task part of a checkpoint's config: ``cfg["task"]`` (a dict), or the legacy ``args`` Namespace."""
    cfg = state.get("cfg")
    task = cfg.get("task") if isinstance(cfg, dict) else None
    if isinstance(task, dict):
        return task
    args = state.get("args")
    return vars(args) if args is not None and hasattr(args, "__dict__") else {}


def check_checkpoint_matches_data(checkpoint: str, data_bin: str, source_lang: Optional[str] = None,
                                  target_lang: Optional[str] = None) -> None:
    """Reads ``checkpoint`` (memory-mapped, weights-only) and compares the rows of its embeddings with the
    sizes of ``data_bin``'s dictionaries, as fairseq's translation task loads them.

    Languages: ``source_lang``/``target_lang`` (fairseq-generate's ``-s``/``-t``), else inferred from the
    data directory as fairseq does. Nothing is compared for other tasks or models without
    ``encoder.embed_tokens.weight``/``decoder.embed_tokens.weight``, or where the languages are unknown.

    Raises:
        ValueError: the checkpoint was trained with another dictionary (both sizes named), or
            (``CorruptCheckpointError``) the file is truncated or damaged, or it holds pickled code
            and ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` would let fairseq-generate run it.
        FileNotFoundError: (``MissingCheckpointError``) no such file.
    """
    from fairseq_softtopk.checkpoint_safety import (UNSAFE_LOADING_VARIABLE, UnsafeCheckpointError,
                                                    read_checkpoint, unsafe_loading_forced)

    try:
        state = read_checkpoint(checkpoint)  # weights-only, whatever the environment says
    except UnsafeCheckpointError as error:
        if unsafe_loading_forced():  # fairseq-generate would load it with the full unpickler: run its code
            raise ValueError(f"{error} It is not passed to fairseq-generate: {UNSAFE_LOADING_VARIABLE} is set, "
                             f"under which fairseq would load it with the full unpickler.") from None
        return  # fairseq-generate refuses it itself, in the same words; nothing in it is run here
    task = _task_settings(state)
    model = state.get("model")
    if task.get("_name", task.get("task", "translation")) != "translation" or not isinstance(model, dict):
        return
    if not (source_lang and target_lang):
        from fairseq.data import data_utils

        source_lang, target_lang = data_utils.infer_language_pair(str(data_directory(data_bin)))
    for side, lang in (("encoder", source_lang), ("decoder", target_lang)):
        weight = model.get(f"{side}.embed_tokens.weight")
        dictionary = data_directory(data_bin) / f"dict.{lang}.txt"
        if lang is None or getattr(weight, "dim", lambda: 0)() != 2 or not dictionary.is_file():
            continue
        from fairseq.data import Dictionary

        size = len(Dictionary.load(str(dictionary)))
        if weight.shape[0] != size:
            raise ValueError(f"checkpoint {checkpoint} was trained with another dictionary than {data_bin}: its "
                             f"{side} embedding has {weight.shape[0]} rows, {dictionary} holds {size} symbols; "
                             f"score it on data binarised with the dictionary it was trained with "
                             f"(fairseq-preprocess --srcdict/--tgtdict)")
